"""torch.distributed through the backend "collectives" against "gloo", in one job.

Two groups of the same ranks: the default group of the "collectives" backend (made without MASTER_ADDR,
over MPI) and a gloo group (``dist.new_group(backend="gloo")``, set up through the same job's store).
Both measured with torch's own calls on the same tensors:

- ``dist.all_reduce`` (SUM, float32 CPU tensors) from 8 B to 64 MiB, and as a third side the library's own
  blocking ``allreduce`` on the backend's communicator (what the backend's async path costs on top);
  with ``--ops``, the same three sides for ``dist.all_gather_into_tensor`` (the library's ``allgather``),
  ``dist.reduce_scatter_tensor`` (SUM; ``reduce_scatter``; the input's size rounded down to a multiple of
  the ranks) and ``dist.reduce`` (SUM to rank 0; ``reduce``), the size being the input's;
- one training step of an MLP under ``DistributedDataParallel`` (forward, backward with DDP's bucketed
  allreduces, SGD step), one DDP model per group, the same parameters and batch; beside them, in the same
  rounds, two floors: the same model without DDP (``local``: forward, backward, SGD step, no communication
  at all), and DDP with no communication (``no comm``: a comm hook that hands each bucket back as it is,
  so DDP's own work stays: its hooks, the copies into and out of its buckets). ``no comm/gloo`` is the
  least ratio to gloo that any backend of DDP could reach in that job; ``collectives/no comm`` what ours
  adds to DDP's own step.

The sides alternate within each round (the first side changes every round), each block after an MPI
barrier, each block about ``--round-ms`` of calls (at least one); a block's time is the slowest rank's. Quoted:
the median per call over the rounds and the median of the per-round ratios collectives/gloo (below 1:
collectives faster).

    mpiexec -n 2 python benchmarks/bench_torch_backend.py [--sizes 8B..64MiB] [--rounds 15] [--json out]
    mpiexec -n 2 python benchmarks/bench_torch_backend.py --sizes 8B,1MiB --no-step \
        --ops all_reduce,all_gather_into_tensor,reduce_scatter_tensor,reduce
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from _common import fmt_time, human, parse_sizes
from mpi4py import MPI


def timed(world, sides, rounds: int, round_s: float) -> np.ndarray:
    """Per-call seconds, shape (rounds, sides): the slowest rank's block time / calls."""
    perf = time.perf_counter
    first = np.empty(len(sides))
    for i, f in enumerate(sides):
        f(2)  # warm-up: first calls allocate, make buckets
        world.Barrier()
        t0 = perf()
        f(3)
        first[i] = (perf() - t0) / 3
    world.Allreduce(MPI.IN_PLACE, first, MPI.MAX)
    ks = [int(max(1, min(2000, round_s // max(t, 1e-9)))) for t in first]
    times = np.empty((rounds, len(sides)))
    for r in range(rounds):
        for j in range(len(sides)):
            i = (j + r) % len(sides)
            world.Barrier()
            t0 = perf()
            sides[i](ks[i])
            times[r, i] = (perf() - t0) / ks[i]
    world.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    return times


def ddp_step(args, world, groups: dict, names: list, rank: int) -> dict:
    """One DDP training step per group in ``names`` and the two floors beside them (see the module's
    docstring), timed in the same rounds; printed on rank 0, returned as a dict."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    h = args.hidden

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, h), torch.nn.ReLU(), torch.nn.Linear(h, h), torch.nn.ReLU(),
                                   torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, 10))

    models = {n: DDP(mlp(), process_group=groups[n]) for n in names}
    opts = {n: torch.optim.SGD(models[n].parameters(), lr=1e-3) for n in names}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 256, generator=g), torch.randint(0, 10, (args.batch,), generator=g)

    def step_side(n):
        def f(k, n=n):
            for _ in range(k):
                opts[n].zero_grad()
                torch.nn.functional.cross_entropy(models[n](x), y).backward()
                opts[n].step()
        return f

    local = mlp()  # the floors: the same step without DDP, and DDP without communication

    def no_comm(state, bucket):  # a comm hook that reduces nothing: DDP's own work only
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    floor = DDP(mlp(), process_group=groups["collectives"])
    floor.register_comm_hook(None, no_comm)
    models.update({"local": local, "no comm": floor})
    opts.update({n: torch.optim.SGD(models[n].parameters(), lr=1e-3) for n in ("local", "no comm")})
    sides = [*names, "local", "no comm"]
    times = timed(world, [step_side(n) for n in sides], args.rounds, max(args.round_ms, 1) / 1e3)
    params = sum(p.numel() for p in models["gloo"].parameters())
    col = {n: times[:, i] for i, n in enumerate(sides)}
    d = {"params": params, "grad_bytes": 4 * params, "batch_per_rank": args.batch,
         **{n: float(np.median(col[n])) for n in sides},
         "ratio": float(np.median(col["collectives"] / col["gloo"])),
         "floor_ratio": float(np.median(col["no comm"] / col["gloo"])),
         "over_floor": float(np.median(col["collectives"] / col["no comm"]))}
    if rank == 0:
        print(f"DDP MLP step ({params} params, {args.batch} rows/rank): collectives {fmt_time(d['collectives']).strip()}"
              f"  gloo {fmt_time(d['gloo']).strip()}  ratio {d['ratio']:.2f}   (no DDP: {fmt_time(d['local']).strip()};"
              f" DDP without communication: {fmt_time(d['no comm']).strip()}, {d['floor_ratio']:.2f} of gloo;"
              f" collectives / it {d['over_floor']:.2f})", file=sys.stderr, flush=True)
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8B..64MiB")
    ap.add_argument("--factor", type=int, default=8, help="between sizes of a range (default 8)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--round-ms", type=float, default=30.0)
    ap.add_argument("--hidden", type=int, default=1024, help="MLP width (3 hidden layers)")
    ap.add_argument("--batch", type=int, default=32, help="rows per rank")
    ap.add_argument("--ops", default="all_reduce", help="comma list of all_reduce, all_gather_into_tensor, "
                    "reduce_scatter_tensor, reduce (default all_reduce)")
    ap.add_argument("--no-step", action="store_true", help="leave out the DDP step")
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    import collectives
    import collectives.torch_backend  # registers "collectives" (also binds the name used below)

    world = MPI.COMM_WORLD.Dup()
    rank, size = world.Get_rank(), world.Get_size()
    dist.init_process_group("collectives")
    groups = {"collectives": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    names = list(groups)
    torch.set_num_threads(1)
    header = {"ranks": size, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "load_average_at_start": [round(v, 2) for v in os.getloadavg()], "torch": torch.__version__,
              "collectives": collectives.__version__, "mpi_library": MPI.Get_library_version().split("\n")[0],
              "rounds": args.rounds, "round_ms": args.round_ms, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    ops = [o for o in args.ops.split(",") if o]
    results: dict = {**{o: [] for o in ops}, "ddp_step": None}
    comm = groups["collectives"].communicator
    calls = {  # op -> (torch's call on group g, the library's blocking call): t the input, o the output
        "all_reduce": (lambda g, t, o: dist.all_reduce(t, group=g), lambda t, o: comm.allreduce(t)),
        "all_gather_into_tensor": (lambda g, t, o: dist.all_gather_into_tensor(o, t, group=g),
                                   lambda t, o: comm.allgather(t)),
        "reduce_scatter_tensor": (lambda g, t, o: dist.reduce_scatter_tensor(o, t, group=g),
                                  lambda t, o: comm.reduce_scatter(t)),
        "reduce": (lambda g, t, o: dist.reduce(t, 0, group=g), lambda t, o: comm.reduce(t, root=0)),
    }
    # torch 2.13 names all_gather_single and reduce_scatter_single as the successors of these two (the same
    # backend operations): the benchmark keeps the names its figures were published under
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use", category=FutureWarning)
    unknown = set(ops) - set(calls)
    if unknown:
        ap.error(f"--ops: unknown {sorted(unknown)}; choose from {list(calls)}")

    for op in ops:
        theirs, ours = calls[op]
        for nbytes in parse_sizes(args.sizes, args.factor):
            count = nbytes // 4 // size * size if op == "reduce_scatter_tensor" else nbytes // 4
            if count == 0:
                continue
            t = torch.zeros(count, dtype=torch.float32)  # zeros: sums stay finite
            o = torch.zeros(count * size if op == "all_gather_into_tensor" else count // size)

            def side(g, t=t, o=o, theirs=theirs):
                def f(k, g=g, t=t, o=o):
                    for _ in range(k):
                        theirs(g, t, o)
                return f

            def library(k, t=t, o=o, ours=ours):
                for _ in range(k):
                    ours(t, o)  # the library's blocking call on the same communicator: the backend's cost

            times = timed(world, [side(groups[n]) for n in names] + [library], args.rounds, args.round_ms / 1e3)
            row = {"bytes": 4 * count, **{n: float(np.median(times[:, i])) for i, n in enumerate(names)},
                   "library": float(np.median(times[:, 2])),
                   "ratio": float(np.median(times[:, 0] / times[:, 1])),
                   "library_ratio": float(np.median(times[:, 2] / times[:, 1]))}
            results[op].append(row)
            if rank == 0:
                print(f"{op} {human(4 * count):>8}: collectives {fmt_time(row['collectives']).strip()}  "
                      f"gloo {fmt_time(row['gloo']).strip()}  ratio {row['ratio']:.2f}   (the library's call "
                      f"{fmt_time(row['library']).strip()}, {row['library_ratio']:.2f} of gloo)",
                      file=sys.stderr, flush=True)
    if not args.no_step:
        results["ddp_step"] = ddp_step(args, world, groups, names, rank)
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps({"header": header, "results": results}, indent=1))
    dist.destroy_process_group()
    world.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Point-to-point round trips: ``dist.send``/``dist.recv`` through the backend "collectives" against gloo
and against raw mpi4py, and the library's own ``coll.send``/``coll.recv``, in one job.

Ranks 0 and 1 bounce one tensor (float32, CPU) from 8 B to 64 MiB: rank 0 sends and then receives it
back, rank 1 receives and sends it back; the other ranks wait at the barriers. The sides, on the same
tensors:

- ``collectives``: ``dist.send``/``dist.recv`` on the default group (backend "collectives", over MPI);
- ``gloo``: the same calls on a gloo group of the same ranks (``dist.new_group(backend="gloo")``);
- ``mpi4py``: ``Comm.Send``/``Comm.Recv`` of the tensors' NumPy views on a duplicate of MPI_COMM_WORLD
  (what MPI itself costs: the floor);
- ``library``: ``coll.send``/``coll.recv`` (blocking) on the backend's communicator (what torch's Work
  path adds on top of the library).

Timed as ``bench_torch_backend.py`` times (sides alternating within each round, each block after a
barrier, the slowest rank's time per round trip). Quoted: the median per round trip and the medians of
the per-round ratios collectives/gloo and collectives/mpi4py (below 1: collectives faster).

    mpiexec -n 2 python benchmarks/bench_p2p.py [--sizes 8B..64MiB] [--rounds 15] [--json out]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
from _common import fmt_time, human, parse_sizes
from bench_torch_backend import timed
from mpi4py import MPI


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8B..64MiB")
    ap.add_argument("--factor", type=int, default=8, help="between sizes of a range (default 8)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--round-ms", type=float, default=30.0)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    import collectives
    import collectives.torch_backend  # registers "collectives"

    world = MPI.COMM_WORLD.Dup()
    raw = MPI.COMM_WORLD.Dup()
    rank, size = world.Get_rank(), world.Get_size()
    if size < 2:
        sys.exit("bench_p2p.py needs at least 2 ranks")
    dist.init_process_group("collectives")
    groups = {"collectives": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    comm = groups["collectives"].communicator
    torch.set_num_threads(1)
    header = {"ranks": size, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "load_average_at_start": [round(v, 2) for v in os.getloadavg()], "torch": torch.__version__,
              "collectives": collectives.__version__, "mpi_library": MPI.Get_library_version().split("\n")[0],
              "rounds": args.rounds, "round_ms": args.round_ms, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    names = ["collectives", "gloo", "mpi4py", "library"]
    rows = []
    for nbytes in parse_sizes(args.sizes, args.factor):
        t = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32)
        a = t.numpy()

        def torch_side(g, t=t):
            def f(k):
                for _ in range(k):
                    if rank == 0:
                        dist.send(t, 1, group=g)
                        dist.recv(t, 1, group=g)
                    elif rank == 1:
                        dist.recv(t, 0, group=g)
                        dist.send(t, 0, group=g)
            return f

        def mpi_side(k, a=a):
            for _ in range(k):
                if rank == 0:
                    raw.Send(a, 1)
                    raw.Recv(a, 1)
                elif rank == 1:
                    raw.Recv(a, 0)
                    raw.Send(a, 0)

        def library_side(k, a=a):
            for _ in range(k):
                if rank == 0:
                    comm.send(a, 1)
                    comm.recv(a, 1)
                elif rank == 1:
                    comm.recv(a, 0)
                    comm.send(a, 0)

        times = timed(world, [torch_side(groups["collectives"]), torch_side(groups["gloo"]), mpi_side, library_side],
                      args.rounds, args.round_ms / 1e3)
        row = {"bytes": t.numel() * 4, **{n: float(np.median(times[:, i])) for i, n in enumerate(names)},
               "ratio_gloo": float(np.median(times[:, 0] / times[:, 1])),
               "ratio_mpi4py": float(np.median(times[:, 0] / times[:, 2])),
               "library_ratio_mpi4py": float(np.median(times[:, 3] / times[:, 2]))}
        rows.append(row)
        if rank == 0:
            print(f"round trip {human(row['bytes']):>8}: collectives {fmt_time(row['collectives']).strip()}  "
                  f"gloo {fmt_time(row['gloo']).strip()}  mpi4py {fmt_time(row['mpi4py']).strip()}  "
                  f"coll.send/recv {fmt_time(row['library']).strip()}   ratio to gloo {row['ratio_gloo']:.2f}, "
                  f"to mpi4py {row['ratio_mpi4py']:.2f}", file=sys.stderr, flush=True)
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps({"header": header, "results": {"round_trip": rows}}, indent=1))
    dist.destroy_process_group()
    raw.Free()
    world.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())

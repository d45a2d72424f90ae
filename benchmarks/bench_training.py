"""Training steps with DistributedOptimizer's gradient buckets against no communication, raw mpi4py and DDP.

    mpiexec -n 2 python benchmarks/bench_training.py                      # both models, 7 rounds
    mpiexec -n 2 python benchmarks/bench_training.py --rounds 9 --json out.json
    mpiexec -n 3 python benchmarks/bench_training.py --memory-only        # optimizer state per rank

Models (torch, CPU, one thread per rank, batch 64 per rank, SGD for the timings):

* ``mlp``: 784-1024-1024-10 (1.9 M parameters, 7.6 MB of gradients);
* ``deep``: 8 Linear 1024x1024 layers with ReLU (8.4 M parameters, 33.6 MB of gradients).

Each row is one way of running the same step (``opt.zero_grad(); loss.backward(); opt.step()``); per
round every row runs ``--steps`` steps (a barrier first; the slowest rank's time), in an order that
changes per round; each figure is the median over rounds of the per-round ratio to ``no-comm`` (one
process's step, no communication), with the median times (and, for our rows, of the per-round ratio to
``floor: flat``):

* ``no-comm, keep``: the same with ``zero_grad(set_to_none=False)`` (torch then adds each new gradient
  into the zeroed ``.grad``: the baseline of ``overlap+views``);
* ``floor: barrier``: ``no-comm`` plus one ``MPI_Barrier`` per step (what any synchronous data-parallel
  step pays for waiting on the slower rank);
* ``floor: flat``: ``no-comm`` plus one raw in-place ``MPI_Allreduce`` (sum) of a preallocated flat buffer
  of all the gradients' bytes, not packed and not unpacked: the least a step that reduces after backward
  can cost;
* ``tree``: ``DistributedOptimizer(opt, overlap=False)``: every gradient averaged after backward by
  one fused ``allreduce_tree`` (the path before the gradient buckets);
* ``overlap``: the buckets leave during backward (``grad_views=False``: copied in and out);
* ``overlap+views``: the same, ``.grad`` as views of the buckets, ``zero_grad(set_to_none=False)`` (no copy);
* ``sharded``: ``shard_state=True`` (reduce-scatter, a step over 1/size of the parameters, allgather);
* ``mpi4py``: one ``Allreduce`` per gradient after backward, then a division (what a user writes alone);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over gloo.

Memory: Adam's state bytes per rank (``DistributedOptimizer.state_bytes()``: every torch optimizer the
wrapper holds) with and without ``shard_state``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import numpy as np
from _common import finish
from mpi4py import MPI

import collectives as coll

RAW = MPI.COMM_WORLD.Dup()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_model(torch, kind: str):
    torch.manual_seed(0)
    L = torch.nn.Linear
    if kind == "mlp":
        return torch.nn.Sequential(L(784, 1024), torch.nn.ReLU(), L(1024, 1024), torch.nn.ReLU(), L(1024, 10))
    layers = []
    for _ in range(8):
        layers += [L(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def timed(fn) -> float:
    RAW.Barrier()
    t0 = time.perf_counter()
    fn()
    return RAW.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def rows_for(torch, comm, kind: str, steps: int, device: str = "cpu") -> dict:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(64, 784 if kind == "mlp" else 1024, generator=g).to(device)
    y = torch.randint(0, 10 if kind == "mlp" else 1024, (64,), generator=g).to(device)
    cuda = device != "cpu"

    def make_model(torch, kind):
        return _make_model(torch, kind).to(device)
    size = comm.size

    def stepper(model, opt, set_to_none=True):
        def step():
            for _ in range(steps):
                opt.zero_grad(set_to_none=set_to_none)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            if cuda:
                torch.cuda.synchronize()
        return step

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=1e-3)

    rows = {}
    m = make_model(torch, kind)
    rows["no-comm"] = stepper(m, sgd(m))
    m = make_model(torch, kind)
    rows["no-comm, keep"] = stepper(m, sgd(m), set_to_none=False)
    if not cuda:
        floor_model = make_model(torch, kind)
        floor_opt = sgd(floor_model)
        flat = np.zeros(sum(p.numel() for p in floor_model.parameters()), np.float32)

        def floor_step(reduce):
            def step():
                for _ in range(steps):
                    floor_opt.zero_grad()
                    torch.nn.functional.cross_entropy(floor_model(x), y).backward()
                    reduce()
                    floor_opt.step()
            return step

        rows["floor: barrier"] = floor_step(RAW.Barrier)
        rows["floor: flat"] = floor_step(lambda: RAW.Allreduce(MPI.IN_PLACE, flat, MPI.SUM))
    m = make_model(torch, kind)
    rows["tree"] = stepper(m, coll.DistributedOptimizer(sgd(m), overlap=False, comm=comm))
    m = make_model(torch, kind)
    rows["overlap"] = stepper(m, coll.DistributedOptimizer(sgd(m), grad_views=False, comm=comm))
    m = make_model(torch, kind)
    rows["overlap+views"] = stepper(m, coll.DistributedOptimizer(sgd(m), comm=comm), set_to_none=False)
    m = make_model(torch, kind)
    rows["sharded"] = stepper(m, coll.DistributedOptimizer(sgd(m), shard_state=True, comm=comm), set_to_none=False)
    raw_model = make_model(torch, kind)
    raw_opt = sgd(raw_model)

    def raw_step():
        for _ in range(steps):
            raw_opt.zero_grad()
            torch.nn.functional.cross_entropy(raw_model(x), y).backward()
            for p in raw_model.parameters():
                RAW.Allreduce(MPI.IN_PLACE, p.grad.numpy(), MPI.SUM)
                p.grad.div_(size)
            raw_opt.step()

    if not cuda:
        rows["mpi4py"] = raw_step
    if dist.is_initialized() and not cuda:
        ddp = torch.nn.parallel.DistributedDataParallel(make_model(torch, kind))
        rows["ddp"] = stepper(ddp, sgd(ddp))
    return rows


def run_rows(rows: dict, rounds: int, steps: int) -> dict:
    names = list(rows)
    for name in names:  # warm-up
        rows[name]()
    times = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        if r % 2:
            order.reverse()
        for name in order:
            times[name].append(timed(rows[name]) / steps)
    base = times["no-comm"]
    out = {}
    for name in names:
        out[name] = {"step_ms": 1e3 * statistics.median(times[name]),
                     "vs_no_comm": statistics.median(t / b for t, b in zip(times[name], base))}
        if "ddp" in times and name != "ddp":
            out[name]["vs_ddp"] = statistics.median(t / d for t, d in zip(times[name], times["ddp"]))
        if name in ("tree", "overlap", "overlap+views", "sharded"):  # against the floor of the same round
            out[name]["vs_floor"] = statistics.median(t / f for t, f in zip(times[name], times["floor: flat"]))
    return out


def memory(torch, comm, device: str = "cpu") -> dict:
    out = {}
    for kind in ("mlp", "deep"):
        got = {}
        for shard in (False, True):
            m = _make_model(torch, kind).to(device)
            opt = coll.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=1e-3), shard_state=shard, comm=comm)
            x = torch.randn(2, 784 if kind == "mlp" else 1024, device=device)
            m(x).sum().backward()
            opt.step()
            got["sharded" if shard else "unsharded"] = max(RAW.allgather(opt.state_bytes()))
        got["ratio"] = got["sharded"] / got["unsharded"]
        got["ratio_times_size"] = got["ratio"] * comm.size
        out[kind] = got
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="training steps per timed round")
    ap.add_argument("--models", default="mlp,deep")
    ap.add_argument("--no-ddp", action="store_true")
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda (NCCL; no DDP row)")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    comm = coll.init()
    if args.device == "cuda":
        torch.cuda.set_device(comm.local_rank % torch.cuda.device_count())
        args.no_ddp = True
    start = time.perf_counter()
    results = {"size": comm.size, "rounds": args.rounds, "steps": args.steps, "device": args.device,
               "memory": memory(torch, comm, args.device)}
    if comm.rank == 0:
        print(f"optimizer state per rank (Adam), {comm.size} ranks:")
        for kind, m in results["memory"].items():
            print(f"  {kind:5s} unsharded {m['unsharded'] / 2**20:8.2f} MiB  sharded {m['sharded'] / 2**20:8.2f} MiB"
                  f"  ratio x size {m['ratio_times_size']:.4f}")
    if not args.memory_only:
        if not args.no_ddp:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(RAW.bcast(free_port() if comm.rank == 0 else None, root=0))
            dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
        for kind in args.models.split(","):
            rows = rows_for(torch, comm, kind, args.steps, args.device)
            results[kind] = run_rows(rows, args.rounds, args.steps)
            if comm.rank == 0:
                print(f"\n{kind}: training step, batch 64 per rank, {comm.size} ranks "
                      f"(medians of {args.rounds} rounds x {args.steps} steps)")
                for name, r in results[kind].items():
                    extra = f"   vs ddp {r['vs_ddp']:5.2f}x" if "vs_ddp" in r else ""
                    extra += f"   vs floor: flat {r['vs_floor']:5.3f}x" if "vs_floor" in r else ""
                    print(f"  {name:14s} {r['step_ms']:8.2f} ms   vs no-comm {r['vs_no_comm']:5.2f}x{extra}")
        if dist.is_initialized():
            dist.destroy_process_group()
    if comm.rank == 0:
        finish(start, results, args.json)


if __name__ == "__main__":
    main()

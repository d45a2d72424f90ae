"""Gradient compression (``DistributedOptimizer(compression=...)``) against none, ratios in one job.

    mpiexec -n 2 python benchmarks/bench_compression.py --rounds 9 --json out.json

Two measures, each row timed per round in an order that changes per round (a barrier first; the slowest
rank's time), the figure the median over rounds of the per-round ratio to the uncompressed row:

* ``mlp``: the MLP step of ``bench_training.py`` (784-1024-1024-10, batch 64 per rank, SGD, one torch
  thread per rank), with the default overlap, ``compression=None`` / ``"fp16"`` / ``"bf16"``;
* ``64MiB``: averaging one float32 gradient of 64 MiB (``opt.average_gradients()`` of a
  ``DistributedOptimizer(overlap=False)`` over one parameter of 16 Mi elements): ``None`` (one allreduce,
  shared memory on one node), ``"fp16"``, ``"bf16"`` (an alltoall and an allgather of the narrow type,
  the float32 sum of this rank's block in between, and the casts).
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import finish
from mpi4py import MPI

import collectives as coll

RAW = MPI.COMM_WORLD.Dup()
COMPRESSIONS = (None, "fp16", "bf16")


def timed(fn, reps: int) -> float:
    RAW.Barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return RAW.allreduce(time.perf_counter() - t0, op=MPI.MAX) / reps


def interleaved(rows: dict, rounds: int, reps: int) -> dict:
    names = list(rows)
    for n in names:
        rows[n]()
    times: dict = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in (reversed(order) if r % 2 else order):
            times[n].append(timed(rows[n], reps))
    base = times[names[0]]
    return {n: {"ms": 1e3 * statistics.median(times[n]),
                "vs_none": statistics.median(t / b for t, b in zip(times[n], base))} for n in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    comm = coll.init()
    start = time.perf_counter()
    g = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g)

    def mlp_row(compression):
        torch.manual_seed(0)
        L = torch.nn.Linear
        model = torch.nn.Sequential(L(784, 1024), torch.nn.ReLU(), L(1024, 1024), torch.nn.ReLU(), L(1024, 10))
        opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), comm=comm,
                                        compression=compression)

        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return step

    def allreduce_row(compression):
        p = torch.nn.Parameter(torch.zeros(16 << 20))
        p.grad = torch.randn(16 << 20, generator=g)
        opt = coll.DistributedOptimizer(torch.optim.SGD([p], lr=0.0), comm=comm, overlap=False,
                                        compression=compression)

        def run():
            opt.average_gradients()
            opt.zero_grad(set_to_none=False)  # the round dropped; .grad kept for the next
        return run

    results = {"size": comm.size, "rounds": args.rounds}
    results["mlp"] = interleaved({str(c): mlp_row(c) for c in COMPRESSIONS}, args.rounds, args.steps)
    results["64MiB"] = interleaved({str(c): allreduce_row(c) for c in COMPRESSIONS}, args.rounds, 1)
    if comm.rank == 0:
        for what in ("mlp", "64MiB"):
            print(f"{what} ({comm.size} ranks, medians of {args.rounds} rounds):")
            for name, r in results[what].items():
                print(f"  compression={name:5s} {r['ms']:9.2f} ms   vs none {r['vs_none']:5.2f}x")
        finish(start, results, args.json)


if __name__ == "__main__":
    main()

"""How the tree collectives scale with the number of leaves (1k to 100k small leaves), issue 12 item 13.

    mpiexec -n 2 python benchmarks/bench_scaling.py
    mpiexec -n 2 python benchmarks/bench_scaling.py --leaves 1000,10000,100000 --rounds 5 --json out.json

For each leaf count N: a fresh tree of N float32 leaves of 4 elements each (so the data is small and the
per-leaf handling is what is measured), as a dict of N arrays. Rows:

- ``synchronize, first call``: a *fresh* tree each round (new arrays at new addresses, so nothing the
  library caches per tree applies: structure description, receive datatypes);
- ``synchronize, repeated``: the same tree again (the cached case of a training loop);
- ``allreduce_tree, first call``: a fresh tree each round, ``op="sum"``.

A round's time is the slowest rank's; reported are the median over the rounds and the time per leaf
(microseconds). Linear handling shows a flat time per leaf across N; a quadratic one grows with N. Only
the shape of the curve means something on a shared machine; run it several times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

import collectives as coll


def fresh_tree(n: int, rank: int) -> dict:
    return {f"p{i:06d}": np.full(4, float(rank), dtype=np.float32) for i in range(n)}


def timed(world, fn, *args, **kwargs) -> float:
    world.Barrier()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    dt = time.perf_counter() - t0
    return world.allreduce(dt, op=MPI.MAX)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leaves", default="1000,3000,10000,30000,60000,100000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    comm = coll.init()
    world = MPI.COMM_WORLD
    counts = [int(s) for s in args.leaves.split(",") if s]
    rows = []
    if comm.rank == 0:
        print(f"{comm.size} ranks; median of {args.rounds} rounds (slowest rank per round)")
        print(f"{'leaves':>8}  {'row':<28} {'median':>10}  {'per leaf':>10}")
    for n in counts:
        firsts, repeats, reduces = [], [], []
        for _ in range(args.rounds):
            tree = fresh_tree(n, comm.rank)
            firsts.append(timed(world, coll.synchronize, tree, comm=comm))
            repeats.append(timed(world, coll.synchronize, tree, comm=comm))
            tree2 = fresh_tree(n, comm.rank)
            reduces.append(timed(world, coll.allreduce_tree, tree2, op="sum", comm=comm))
        for name, times in (("synchronize, first call", firsts), ("synchronize, repeated", repeats),
                            ("allreduce_tree, first call", reduces)):
            med = statistics.median(times)
            rows.append({"leaves": n, "row": name, "median_s": med, "per_leaf_us": med / n * 1e6,
                         "times_s": times})
            if comm.rank == 0:
                print(f"{n:>8}  {name:<28} {med * 1e3:>8.1f} ms  {med / n * 1e6:>7.2f} us", flush=True)
    if args.json and comm.rank == 0:
        with open(args.json, "w") as f:
            json.dump({"size": comm.size, "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

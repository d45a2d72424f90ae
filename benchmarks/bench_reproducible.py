"""What ``reproducible=True`` costs: the ordinary and the reproducible allreduce, alternating, same job.

    mpiexec -n 2 python benchmarks/bench_reproducible.py
    mpiexec -n 2 python benchmarks/bench_reproducible.py --sizes 1MiB,64MiB --dtype float32 --json out.json

Rows per size: ``allreduce(x, op)`` ("ordinary") against ``allreduce(x, op, reproducible=True)``
("reproducible"), on the same buffer in alternating rounds (``_common.measure``), and the ratio
reproducible/ordinary (the median of per-round ratios; the slowest rank's time of each round). A third
side, "transfers", runs only the reproducible call's two collectives (the codes' max and the words' sum,
on buffers of their sizes, no conversion): the part of the cost that the bytes on the wire set. The op is
``mean`` by default: every rank holds the same values after the first call, and their mean is those values
again, so every call reduces the same data (a sum in place would grow to inf). The data is normal random
values (no zeros, no specials: the common case of gradients). The issue's target (issue 36): at most 2.5x
at 1 MiB and 64 MiB of float32 at 2 ranks. Only ratios of one run mean something.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from _common import finish, fmt_time, human, measure, parse_sizes, plan

import collectives


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4KiB,1MiB,64MiB")
    ap.add_argument("--dtype", default="float32", choices=["float16", "float32", "float64"])
    ap.add_argument("--op", default="mean", choices=["mean", "sum"])
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    world = collectives.init()
    start = time.perf_counter()
    rows = []
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(world.rank)
    for nbytes in parse_sizes(args.sizes, 4):
        x = rng.standard_normal(max(1, nbytes // dtype.itemsize)).astype(dtype)
        rounds, k = plan(nbytes, args.iters)
        codes = np.zeros(x.size, np.uint8 if dtype.itemsize <= 4 else np.int16)
        words = np.zeros(x.size * (2 if dtype.itemsize == 8 else 1) + 1)  # (zeros: the sums stay the same)

        def transfers(codes=codes, words=words):
            world.allreduce(codes, "max")
            world.allreduce(words, "sum")

        sides = (lambda x=x: world.allreduce(x, args.op), lambda x=x: world.allreduce(x, args.op, reproducible=True),
                 transfers)
        times = measure(world.barrier, sides, rounds, k)
        times = np.asarray(world.allreduce(times, "max"))
        a, b, c = np.median(times, axis=0)
        rows.append({"bytes": nbytes, "ordinary_s": float(a), "reproducible_s": float(b), "transfers_s": float(c),
                     "ratio": float(np.median(times[:, 1] / times[:, 0])),
                     "transfers_ratio": float(np.median(times[:, 2] / times[:, 0]))})
    if world.rank == 0:
        print(f"reproducible allreduce of {args.dtype}, op={args.op}, {world.size} ranks ({world.backend}): "
              f"reproducible / ordinary (median of per-round ratios)")
        print(f"{'size':>9} {'ordinary':>11} {'reproducible':>12} {'ratio':>8} {'transfers':>11} {'ratio':>8}")
        for r in rows:
            print(f"{human(r['bytes']):>9} {fmt_time(r['ordinary_s'])} {fmt_time(r['reproducible_s'], 9)} "
                  f"{r['ratio']:>7.2f}x {fmt_time(r['transfers_s'])} {r['transfers_ratio']:>7.2f}x")
    finish(start, {"dtype": args.dtype, "op": args.op, "size": world.size, "rows": rows},
           args.json if world.rank == 0 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

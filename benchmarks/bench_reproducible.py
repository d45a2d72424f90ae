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

Then the training step (``--step``, torch; skipped with ``--no-step``): an MLP 784-1024-1024-10 (1.9 M
parameters, 7.6 MB of float32 gradients), SGD, one thread per rank, a global batch of 64 samples per rank
in micro-batches of ``--micro`` samples. "ordinary": ``DistributedOptimizer(sgd)`` (the gradient buckets
during backward) over one backward pass of the rank's whole share; "reproducible":
``DistributedOptimizer(sgd, reproducible=True)``, one backward pass per micro-batch (each one unit of the
exact sum), summed in ``step()``; "ordinary, micro-batched": ``DistributedOptimizer(sgd, overlap=False)``
over the same backward passes as the reproducible side (torch adds them up; one fused allreduce), so that
the cost of the micro-batching itself and of the reproducible sum can be told apart; "ordinary, again": a
second ordinary side (A/A: what two identical sides differ by in the job). 31 rounds of 3 steps each side
(``--step-rounds``; 9 rounds let the median move by 0.15 between runs). The issue's target:
reproducible <= 1.3x ordinary.
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
    ap.add_argument("--no-step", dest="step", action="store_false", help="skip the training step")
    ap.add_argument("--micro", type=int, default=64, help="samples per micro-batch (unit) of the step (default 64: "
                    "one unit per rank)")
    ap.add_argument("--step-rounds", type=int, default=31)
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
    result = {"dtype": args.dtype, "op": args.op, "size": world.size, "rows": rows}
    if args.step:
        result["step"] = step_rows(world, args.micro, args.step_rounds)
    finish(start, result, args.json if world.rank == 0 else None)
    return 0


def step_rows(world, micro: int, rounds: int) -> dict:
    """The MLP step, ordinary against reproducible (see the module docstring); rank 0 prints the rows."""
    import torch

    torch.set_num_threads(1)
    batch = 64
    g = torch.Generator().manual_seed(world.rank)
    x, y = torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def side(**kwargs):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                    torch.nn.ReLU(), torch.nn.Linear(1024, 10))
        opt = collectives.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), comm=world, **kwargs)
        whole = not kwargs

        def step():
            opt.zero_grad()
            for lo in range(0, batch, batch if whole else micro):
                torch.nn.functional.cross_entropy(model(x[lo:lo + micro if not whole else batch]),
                                                  y[lo:lo + micro if not whole else batch]).backward()
            opt.step()
        return step

    names = ["ordinary", "reproducible", "ordinary, micro-batched", "ordinary, again"]
    sides = (side(), side(reproducible=True), side(overlap=False), side())
    times = measure(world.barrier, sides, rounds, 3)
    times = np.asarray(world.allreduce(times, "max"))
    ratios = times[:, 1] / times[:, 0]
    out = {"micro": micro, "times_s": {n: times[:, i].tolist() for i, n in enumerate(names)},
           "ratio": float(np.median(ratios)), "ratios": ratios.tolist(),
           "ratio_to_micro_batched": float(np.median(times[:, 1] / times[:, 2])),
           "a_a": float(np.median(times[:, 3] / times[:, 0]))}
    if world.rank == 0:
        print(f"\nMLP step (784-1024-1024-10, SGD, 64 samples per rank, micro-batches of {micro}), {world.size} "
              f"ranks: median of {rounds} rounds, and every round's ratio reproducible / ordinary")
        for i, n in enumerate(names):
            print(f"  {n:24} {fmt_time(float(np.median(times[:, i])))}")
        print(f"  reproducible / ordinary: {out['ratio']:.2f}x (rounds: {' '.join(f'{r:.2f}' for r in ratios)}); "
              f"/ ordinary, micro-batched: {out['ratio_to_micro_batched']:.2f}x; A/A (ordinary again / ordinary): "
              f"{out['a_a']:.2f}x")
    return out


if __name__ == "__main__":
    sys.exit(main())

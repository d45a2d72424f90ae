"""What the fingerprint beside every non-blocking call costs: the same calls with and without it, same job.

    mpiexec -n 2 python benchmarks/bench_fingerprint.py
    mpiexec -n 2 python benchmarks/bench_fingerprint.py --sizes 8B,1MiB,64MiB --json out.json

Every non-blocking path (``async_op=True`` handles, every call of the deadline transport, the torch
backend's Work, the gradient buckets) reduces a 80-byte fingerprint of its call (collective, count, dtype,
op, root) beside the call, on a communicator of its own, so that ranks making different calls raise
MismatchError instead of returning each other's data (docs/semantics.md). This measures its price: rows

- ``async``: ``allreduce(x, "sum", async_op=True).wait()`` on a plain communicator;
- ``deadline``: ``allreduce(x, "sum")`` on a communicator made with ``COLLECTIVES_TIMEOUT`` (every call polled);

- ``floor``: raw mpi4py, ``Iallreduce`` + ``Wait`` ("off") against the same with an 80-byte ``Iallreduce``
  started beside it on another communicator ("on"): the least any check by a collective beside the call
  can cost on this machine;

each with the fingerprint ("on") and on a second, identical communicator whose transport has it switched off
("off": the transport's ``fingerprints`` attribute, a benchmark-only switch reached here because no public
name turns a guarantee off). Both sides run on the same buffer in alternating rounds (``_common.measure``);
the ratio on/off is the median of per-round ratios. Only ratios of one run mean something.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from _common import fmt_time, finish, human, measure, parse_sizes, plan

import collectives


def communicator(fingerprints: bool, deadline: bool):
    from mpi4py import MPI

    if deadline:
        os.environ["COLLECTIVES_TIMEOUT"] = "300"
    try:
        c = collectives.init(comm=MPI.COMM_WORLD.Dup())
    finally:
        os.environ.pop("COLLECTIVES_TIMEOUT", None)
    c._host.fingerprints = fingerprints  # the benchmark-only switch (see the module docstring)
    return c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8B,4KiB,1MiB,64MiB")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    world = collectives.init()
    if world.backend != "mpi" or world.size < 2:
        print("run it under mpiexec with 2 or more ranks", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = []
    for mode in ("async", "deadline"):
        on, off = communicator(True, mode == "deadline"), communicator(False, mode == "deadline")
        for nbytes in parse_sizes(args.sizes, 4):
            x = np.zeros(max(1, nbytes // 4), np.float32)
            rounds, k = plan(nbytes, args.iters)
            if mode == "async":
                sides = (lambda on=on, x=x: on.allreduce(x, "sum", async_op=True).wait(),
                         lambda off=off, x=x: off.allreduce(x, "sum", async_op=True).wait())
            else:
                sides = (lambda on=on, x=x: on.allreduce(x, "sum"), lambda off=off, x=x: off.allreduce(x, "sum"))
            times = measure(world.barrier, sides, rounds, k)
            times = np.asarray(world.allreduce(times, "max"))
            a, b = np.median(times, axis=0)
            rows.append({"mode": mode, "bytes": nbytes, "on_s": float(a), "off_s": float(b),
                         "ratio": float(np.median(times[:, 0] / times[:, 1]))})
        on.close()
        off.close()
    # The floor of the design, in raw mpi4py: one non-blocking allreduce, against the same with an 80-byte
    # one started beside it (both waited): what any check of a call by a collective beside it costs here.
    from mpi4py import MPI

    raw, lane = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
    fp = np.zeros(10, np.int64)
    for nbytes in parse_sizes(args.sizes, 4):
        x = np.zeros(max(1, nbytes // 4), np.float32)
        rounds, k = plan(nbytes, args.iters)

        def beside(x=x):
            f = lane.Iallreduce(MPI.IN_PLACE, fp, MPI.MAX)
            r = raw.Iallreduce(MPI.IN_PLACE, x, MPI.SUM)
            MPI.Request.Waitall([f, r])

        sides = (beside, lambda x=x: raw.Iallreduce(MPI.IN_PLACE, x, MPI.SUM).Wait())
        times = measure(world.barrier, sides, rounds, k)
        times = np.asarray(world.allreduce(times, "max"))
        a, b = np.median(times, axis=0)
        rows.append({"mode": "floor", "bytes": nbytes, "on_s": float(a), "off_s": float(b),
                     "ratio": float(np.median(times[:, 0] / times[:, 1]))})
    raw.Free()
    lane.Free()
    if world.rank == 0:
        print(f"fingerprint beside each call, {world.size} ranks: on / off (median of per-round ratios)")
        print(f"{'path':>9} {'size':>9} {'on':>11} {'off':>11} {'on/off':>8}")
        for r in rows:
            print(f"{r['mode']:>9} {human(r['bytes']):>9} {fmt_time(r['on_s'])} {fmt_time(r['off_s'])} "
                  f"{r['ratio']:>7.3f}x")
    finish(start, {"rows": rows}, args.json if world.rank == 0 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

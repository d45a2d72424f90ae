"""What the flight recorder costs: the same calls on a communicator that records and on one that does not.

    mpiexec -n 2 python benchmarks/bench_trace.py
    mpiexec -n 2 python benchmarks/bench_trace.py --sizes 8B,1MiB --json out.json

Every communicator keeps a ring of its last ``COLLECTIVES_TRACE_BUFFER`` calls (docs/troubleshooting.md,
"My job hangs"); a hot-path call stores its cached call (one store; a broadcast its root too), any
other call a record with its call site and times. Rows:

- ``allreduce``: ``comm.allreduce(x, "sum")`` (the hot path from the second call);
- ``broadcast``: ``comm.broadcast(x, 0)`` (the hot path);
- ``async``: ``comm.allreduce(x, "sum", async_op=True).wait()`` (a full record per call);
- ``async, paired`` (8 B to 4 KiB): the same, measured call by call (see :func:`paired`): its ``on-off``
  is the median of 50 000 pairs' differences, the record's cost where the difference of two medians of
  blocks moves by microseconds between runs;

each on two communicators over duplicates of ``COMM_WORLD``, made one with the record ("on") and one with
``COLLECTIVES_TRACE_BUFFER=0`` ("off", set while that one is made). The rows ``timeline ...`` time the
same calls on a communicator made with ``COLLECTIVES_TIMELINE`` set (every call timed with its phases and
written to ``<dir>/timeline.<rank>``, in a temporary directory) against one made without it, both with the
record on: what the timeline costs on top of the record. Both sides run on the same buffer in
alternating rounds (``_common.measure``): 1600 MiB a side, up to 200 000 calls for a blocking call
(100 000 for an asynchronous one): what the A/A row needs to stay within 3% at 8 bytes; on/off is the
median of per-round ratios. Only ratios of one run
mean something. A row ``A/A`` times the allreduce on "off" against a second "off"
communicator: what two identical sides differ by in this job (the measurement's floor; a ratio within
it of 1.0 is no cost that this job can see). The row ``timeline floor`` times the least that any timing of
a call from Python adds, against the same call untimed: a function around the allreduce that reads the
hosts' clock before and after it and appends the two readings to a list (a frame, two clock readings, a
tuple, an append); ``timeline allreduce`` is then to be read against it. The column ``on-off`` is the
difference per call of the two medians (for ``async``: what the record of an asynchronous call costs).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
from _common import communicator_with, fmt_time, finish, human, measure, parse_sizes, plan

import collectives


def communicator(record: bool):
    return communicator_with("COLLECTIVES_TRACE_BUFFER", "2000" if record else "0")


def timeline_communicator(directory: str):
    return communicator_with("COLLECTIVES_TIMELINE", os.path.join(directory, "timeline"))


def paired(world, on, off, x, pairs: int) -> dict:
    """The row ``async, paired``: the record of an asynchronous call measured call by call. ``pairs`` times
    an asynchronous allreduce on ``on`` and one on ``off`` back to back, from one line (the same call site),
    in alternating order, each timed alone: ``on_s``/``off_s`` the medians, ``diff_s`` the median of the
    pairs' differences (what a machine that drifts over seconds cannot move: both calls of a pair run within
    the same 100 us), on every rank, the largest rank's."""
    def call(c):
        c.allreduce(x, "sum", async_op=True).wait()

    clock = time.perf_counter_ns
    for _ in range(min(pairs, 2000)):
        call(on)
        call(off)
    d = np.empty((pairs, 2), np.int64)
    world.barrier()
    for i in range(pairs):
        first, second = (off, on) if i & 1 else (on, off)
        t0 = clock()
        call(first)
        t1 = clock()
        call(second)
        t2 = clock()
        d[i] = (t2 - t1, t1 - t0) if i & 1 else (t1 - t0, t2 - t1)
    mine = np.array([np.median(d[:, 0]), np.median(d[:, 1]), np.median(d[:, 0] - d[:, 1])]) * 1e-9
    worst = np.asarray(world.allreduce(mine, "max"))
    return {"call": "async, paired", "bytes": x.nbytes, "on_s": float(worst[0]), "off_s": float(worst[1]),
            "ratio": float(worst[0] / worst[1]), "diff_s": float(worst[2])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8B,1MiB")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    world = collectives.init()
    start = time.perf_counter()
    on, off, off2 = communicator(True), communicator(False), communicator(False)
    directory = world.broadcast_object(tempfile.mkdtemp(prefix="bench-timeline-") if world.rank == 0 else None)
    timed = timeline_communicator(directory)
    rows = []
    clock, kept = time.time_ns, []
    keep = kept.append

    def floor_timed(c, x):  # the least a timed call adds (see the module)
        t0 = clock()
        c.allreduce(x, "sum")
        keep((t0, clock()))

    for nbytes in parse_sizes(args.sizes, 4):
        x = np.zeros(max(1, nbytes // 4), np.float32)
        for name, call, first in (("allreduce", lambda c, x: c.allreduce(x, "sum"), on),
                               ("broadcast", lambda c, x: c.broadcast(x, 0), on),
                               ("async", lambda c, x: c.allreduce(x, "sum", async_op=True).wait(), on),
                               ("A/A", lambda c, x: c.allreduce(x, "sum"), off2),
                               ("timeline allreduce", lambda c, x: c.allreduce(x, "sum"), timed),
                               ("timeline broadcast", lambda c, x: c.broadcast(x, 0), timed),
                               ("timeline async", lambda c, x: c.allreduce(x, "sum", async_op=True).wait(), timed),
                               ("timeline floor", floor_timed, on)):
            second = on if name.startswith("timeline") else off
            # (a blocking call of a few us: 200 000 calls a side, whose A/A rows stay within 3%; 20 000 moved
            # them by 5%, more than the differences measured; an asynchronous call of 30 us: 100 000; 1 MiB:
            # 1600 calls, not 160)
            rounds, k = plan(nbytes, args.iters, budget=1600 * 2**20,
                             max_calls=100_000 if "async" in name else 200_000)
            untimed = (lambda c, x: c.allreduce(x, "sum")) if call is floor_timed else call  # (the floor's other side)
            sides = (lambda x=x, call=call, first=first: call(first, x),
                     lambda x=x, call=untimed, second=second: call(second, x))
            times = measure(world.barrier, sides, rounds, k)
            times = np.asarray(world.allreduce(times, "max"))
            a, b = np.median(times, axis=0)
            rows.append({"call": name, "bytes": nbytes, "on_s": float(a), "off_s": float(b),
                         "ratio": float(np.median(times[:, 0] / times[:, 1]))})
            kept.clear()
        if nbytes <= 4096:
            rows.append(paired(world, on, off, x, 50_000 if args.iters is None else args.iters))
    for c in (on, off, off2, timed):
        c.close()
    if world.rank == 0:
        print(f"the flight recorder, {world.size} ranks: on / off (median of per-round ratios)")
        print(f"{'call':>20} {'size':>9} {'on':>11} {'off':>11} {'on/off':>8} {'on-off':>9}")
        for r in rows:
            print(f"{r['call']:>20} {human(r['bytes']):>9} {fmt_time(r['on_s'])} {fmt_time(r['off_s'])} "
                  f"{r['ratio']:>7.3f}x {r.get('diff_s', r['on_s'] - r['off_s']) * 1e6:>7.2f}us")
    finish(start, {"rows": rows}, args.json if world.rank == 0 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

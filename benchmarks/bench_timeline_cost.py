"""Where the timeline's cost at 8 B goes: four sides of one allreduce, alternating, same job.

    mpiexec -n 2 python benchmarks/bench_timeline_cost.py
    mpiexec -n 2 python benchmarks/bench_timeline_cost.py --no-flush   # the timeline's flush thread idle
    mpiexec -n 2 python benchmarks/bench_timeline_cost.py --no-gc      # the garbage collector off

Sides: the allreduce of 8 bytes on a communicator with the flight recorder ("plain"); the same on one made
with ``COLLECTIVES_TIMELINE`` ("timeline"); the plain call inside a function that reads the clock before
and after it and appends the two readings ("floor": the least any timing of a call from Python adds); and
the floor plus exactly the timeline's own work per hot-path call, written by hand (the sequence number,
``x.size``, a tuple of five: "by hand"). Printed: each side's median time less the plain call's, and its
median per-round ratio (three repetitions). docs/performance.md, "The timeline", has the figures.
"""

from __future__ import annotations

import argparse
import gc
import operator
import os
import sys
import tempfile
import time

import numpy as np
from _common import communicator_with, measure

import collectives
from collectives import _timeline


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-flush", action="store_true", help="the timeline's thread flushes never (FLUSH_S 1e6)")
    ap.add_argument("--no-gc", action="store_true", help="gc.freeze() and gc.disable() before timing")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.no_flush:
        _timeline.FLUSH_S = 1e6  # (read by the flush thread, which the timeline communicator starts)
    world = collectives.init()
    plain = communicator_with("COLLECTIVES_TRACE_BUFFER", "2000")
    directory = world.broadcast_object(tempfile.mkdtemp(prefix="bench-timeline-") if world.rank == 0 else None)
    timed = communicator_with("COLLECTIVES_TIMELINE", os.path.join(directory, "timeline"))
    x = np.zeros(2, np.float32)
    clock, kept = time.time_ns, []
    keep = kept.append
    seq = operator.attrgetter("_seq")  # (what the timeline reads through the engine)

    def floor():
        t0 = clock()
        plain.allreduce(x, "sum")
        keep((t0, clock()))

    def by_hand():
        t0 = clock()
        plain.allreduce(x, "sum")
        keep((3, seq(plain), x.size, t0, clock()))

    if args.no_gc:
        gc.collect()
        gc.freeze()
        gc.disable()
    sides = [lambda: plain.allreduce(x, "sum"), lambda: timed.allreduce(x, "sum"), floor, by_hand]
    tag = " ".join(a for a in sys.argv[1:] if a.startswith("--no")) or "default"
    for _ in range(args.repeat):
        t = np.asarray(world.allreduce(measure(world.barrier, sides, 21, 3000), "max"))
        med = np.median(t, axis=0) * 1e6
        ratio = [float(np.median(t[:, i] / t[:, 0])) for i in range(4)]
        kept.clear()
        if world.rank == 0:
            print(f"{tag}: plain {med[0]:.2f} us  timeline {ratio[1]:.3f}x (+{med[1] - med[0]:.2f})  floor "
                  f"{ratio[2]:.3f}x (+{med[2] - med[0]:.2f})  by hand {ratio[3]:.3f}x (+{med[3] - med[0]:.2f})",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

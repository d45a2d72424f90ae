"""What the NaN check (``COLLECTIVES_CHECK_NAN=1``) costs: the same reductions on a communicator that checks
and on one that does not.

    mpiexec -n 2 python benchmarks/bench_nan_check.py
    mpiexec -n 2 python benchmarks/bench_nan_check.py --sizes 1MiB,64MiB --json out.json

With the check on, every floating reduction first scans its input on every rank (one pass of NumPy's sum;
an element-by-element pass only when the sum is not finite) and the ranks exchange what they found (one
allgather of 24 bytes per rank), and the call takes the general path (the hot path, which skips the
engine's validation, is not used). Rows, float32 inputs of finite values:

- ``allreduce``: ``comm.allreduce(x, "sum")`` (off: the hot path from the second call);
- ``async``: ``comm.allreduce(x, "sum", async_op=True).wait()`` (the general path on both sides);
- ``tree``: ``allreduce_tree({"a": x, "b": x2}, "sum")`` with two leaves of half the size each;

each on two communicators over duplicates of ``COMM_WORLD``, one made with ``COLLECTIVES_CHECK_NAN=1``
("on") and one without ("off"). Both sides run on the same buffer in alternating rounds
(``_common.measure``); on/off is the median of per-round ratios. Only ratios of one run mean something.
``scan`` is the scan alone on this rank (``_finite.first``, a private: the part of the cost that grows
with the size) against the allreduce off; ``A/A`` times the allreduce on "off" against a second "off"
communicator: what two identical sides differ by in this job.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from _common import communicator_with, fmt_time, finish, human, measure, parse_sizes, plan

import collectives
from collectives import _dtypes, _finite


def communicator(check: bool):
    return communicator_with("COLLECTIVES_CHECK_NAN", "1" if check else "0")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1MiB,64MiB")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    world = collectives.init()
    start = time.perf_counter()
    on, off, off2 = communicator(True), communicator(False), communicator(False)
    rows = []
    f32 = _dtypes.from_numpy(np.dtype(np.float32))
    for nbytes in parse_sizes(args.sizes, 4):
        n = max(2, nbytes // 4)
        x = np.zeros(n, np.float32)
        tree = {"a": np.zeros(n // 2, np.float32), "b": np.zeros(n - n // 2, np.float32)}
        rounds, k = plan(nbytes, args.iters)
        for name, call, first, second in (
                ("allreduce", lambda c, x: c.allreduce(x, "sum"), on, off),
                ("async", lambda c, x: c.allreduce(x, "sum", async_op=True).wait(), on, off),
                ("tree", lambda c, x, tree=tree: c.allreduce_tree(tree, "sum"), on, off),
                ("scan", None, None, off),
                ("A/A", lambda c, x: c.allreduce(x, "sum"), off2, off)):
            if call is None:  # the scan alone against the allreduce off
                sides = (lambda x=x: _finite.first(x, f32), lambda x=x: off.allreduce(x, "sum"))
            else:
                sides = (lambda x=x, call=call, first=first: call(first, x),
                         lambda x=x, call=call, second=second: call(second, x))
            times = measure(world.barrier, sides, rounds, k)
            times = np.asarray(world.allreduce(times, "max"))
            a, b = np.median(times, axis=0)
            rows.append({"call": name, "bytes": nbytes, "on_s": float(a), "off_s": float(b),
                         "ratio": float(np.median(times[:, 0] / times[:, 1]))})
    for c in (on, off, off2):
        c.close()
    if world.rank == 0:
        print(f"the NaN check, {world.size} ranks, float32: on / off (median of per-round ratios); "
              f"'scan': the scan alone / the allreduce off")
        print(f"{'call':>10} {'size':>9} {'on':>11} {'off':>11} {'on/off':>8}")
        for r in rows:
            print(f"{r['call']:>10} {human(r['bytes']):>9} {fmt_time(r['on_s'])} {fmt_time(r['off_s'])} "
                  f"{r['ratio']:>7.3f}x")
    finish(start, {"rows": rows}, args.json if world.rank == 0 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

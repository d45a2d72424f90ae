"""How much of an asynchronous allreduce hides behind compute (issue 14's overlap figure).

    mpiexec -n 2 python benchmarks/bench_overlap.py                  # 16 MiB float32, 9 rounds
    mpiexec -n 2 python benchmarks/bench_overlap.py --mib 16 --rounds 15 --json out.json

Per round (a barrier first; each figure is the slowest rank's time, the median over rounds):

* ``allreduce``: ``coll.allreduce(x)`` alone; ``compute``: the NumPy loop alone (``--steps`` passes of
  ``np.sqrt``/``np.multiply`` over a 4 MiB array, so about as long as the allreduce);
* ``serial``: the allreduce, then the loop;
* ``async``: ``h = coll.allreduce(x, async_op=True)``, the loop, ``h.wait()``;
* ``async+done``: the same, calling ``h.done()`` between the loop's passes (which lets MPI progress).

``hidden`` = (serial - async) / min(allreduce, compute): 1 is perfect overlap, 0 none. MPI progresses a
non-blocking collective only inside MPI calls (docs/semantics.md), so without ``done()`` calls little is
expected to hide; ``async`` is never the shared-memory allreduce, ``allreduce`` and ``serial`` are (from
``COLLECTIVES_SHM_THRESHOLD`` up, between ranks of one node): run with ``COLLECTIVES_SHM=0`` to compare
the same MPI algorithm.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import collectives as coll


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=16.0, help="allreduce size in MiB (default 16)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=0, help="compute passes (default: about the allreduce's time)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    comm = coll.init()
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    x = np.zeros(int(args.mib * 2**20) // 4, np.float32)
    work = np.random.default_rng(comm.rank).random(2**20).astype(np.float32) + 1

    def compute(steps, h=None):
        for _ in range(steps):
            np.sqrt(work, out=work)
            np.multiply(work, work, out=work)
            if h is not None:
                h.done()

    def timed(fn):
        world.Barrier()
        t0 = time.perf_counter()
        fn()
        return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    coll.allreduce(x)
    coll.allreduce(x, async_op=True).wait()  # warm both paths
    t_ar = np.median([timed(lambda: coll.allreduce(x)) for _ in range(3)])
    one = timed(lambda: compute(10)) / 10
    steps = args.steps or max(1, round(float(t_ar) / one))
    rows = {k: [] for k in ("allreduce", "compute", "serial", "async", "async+done")}
    for _ in range(args.rounds):
        rows["allreduce"].append(timed(lambda: coll.allreduce(x)))
        rows["compute"].append(timed(lambda: compute(steps)))
        rows["serial"].append(timed(lambda: (coll.allreduce(x), compute(steps))))

        def overlapped(poll):
            h = coll.allreduce(x, async_op=True)
            compute(steps, h if poll else None)
            h.wait()

        rows["async"].append(timed(lambda: overlapped(False)))
        rows["async+done"].append(timed(lambda: overlapped(True)))
    med = {k: float(np.median(v)) for k, v in rows.items()}
    best = min(med["allreduce"], med["compute"])
    if comm.rank == 0:
        print(f"# {comm.size} ranks, allreduce of {args.mib:g} MiB float32, compute {steps} passes; "
              f"slowest rank, median of {args.rounds} rounds")
        for k, v in med.items():
            extra = ""
            if k.startswith("async"):
                extra = f"   hidden {(med['serial'] - v) / best:+.2f}"
            print(f"{k:>12}: {v * 1e3:9.2f} ms{extra}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": comm.size, "mib": args.mib, "steps": steps, "median_s": med, "rounds": rows}, f,
                          indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What checked mode (``init(check=True)``, ``COLLECTIVES_CHECK=1``) and the deadline
(``COLLECTIVES_TIMEOUT``) cost per call, against the plain path, on the same buffers in the same job.

    mpiexec -n 2 python benchmarks/bench_check.py
    mpiexec -n 2 python benchmarks/bench_check.py --sizes 8B,64KiB,1MiB --ops allreduce,broadcast \
        --json out.json

Three communicators over duplicates of ``COMM_WORLD``, one per side:

==============  ==================================================================================
side            what runs per call
==============  ==================================================================================
``plain``       ``comm.allreduce(x)`` (or ``broadcast``): validation, then the blocking MPI call
``checked``     the same after the agreement step: one ``allgather`` of the pickled call description
``deadline``    unchecked, with ``COLLECTIVES_TIMEOUT`` set: the non-blocking MPI call, polled with
                ``MPI_Test`` until it completes (busy for ~50 us, then sleeping with a backoff)
==============  ==================================================================================

Measured as ``bench_collectives.py`` does, so that the machine's noise hits every side alike: rounds in
which the sides take turns (the order reverses every round), each round starting with a barrier and timing
a block of back-to-back calls per side on each rank; a call's time is the block time / calls on the
slowest rank; reported are the median over rounds, and the median over rounds of the per-round ratio
side/plain. Only ratios mean something, and only within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
from _common import fmt_time, human, measure, parse_bytes, plan

import collectives


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8B,1MiB", help="comma-separated sizes (default 8B,1MiB)")
    ap.add_argument("--ops", default="allreduce", help="comma-separated from allreduce, broadcast")
    ap.add_argument("--iters", type=int, default=None, help="calls per side per size (default: by size)")
    ap.add_argument("--no-deadline", action="store_true", help="leave out the deadline side")
    ap.add_argument("--json", metavar="PATH", help="also write the results (rank 0) as JSON here")
    args = ap.parse_args()
    sizes = sorted({parse_bytes(s) for s in args.sizes.split(",") if s.strip()})
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for o in ops:
        if o not in ("allreduce", "broadcast"):
            ap.error(f"--ops: unknown {o!r}; expected allreduce or broadcast")
    for s in sizes:
        if s < 4 or s % 4:
            ap.error(f"size {s} B is not a whole number of float32 elements")

    os.environ.pop("COLLECTIVES_TIMEOUT", None)
    plain = collectives.init(check=False)
    if plain.backend != "mpi":
        print("this benchmark needs the MPI backend: run it under mpiexec", file=sys.stderr)
        return 2
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    dup_checked, dup_deadline = world.Dup(), world.Dup()
    checked = collectives.init(comm=dup_checked, check=True)
    names = ["plain", "checked"]
    comms = [plain, checked]
    if not args.no_deadline:
        os.environ["COLLECTIVES_TIMEOUT"] = "600"  # read once, when the communicator's transport is made
        try:
            deadline = collectives.init(comm=dup_deadline, check=False)
        finally:
            del os.environ["COLLECTIVES_TIMEOUT"]
        assert type(deadline._host).__name__ == "DeadlineMPITransport"
        names.append("deadline")
        comms.append(deadline)
    assert not plain.check and type(plain._host).__name__ == "MPITransport"
    barrier = world.Barrier

    results = []
    started = time.perf_counter()
    for nbytes in sizes:
        rounds, k = plan(nbytes, args.iters, budget=64 * 2**20, min_calls=61, max_calls=8000, max_rounds=41)
        for op in ops:
            x = np.zeros(nbytes // 4, np.float32)  # zeros: the sum stays finite however often it runs
            if op == "allreduce":
                sides = [lambda c=c, x=x: c.allreduce(x, op="sum") for c in comms]
            else:
                sides = [lambda c=c, x=x: c.broadcast(x, root=0) for c in comms]
            times = measure(barrier, sides, rounds, k, warmup=(5, 100))
            world.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
            med = np.median(times, axis=0)
            row = {"op": op, "bytes": nbytes, "calls_per_side": rounds * k, "rounds": rounds}
            for i, name in enumerate(names):
                row[f"{name}_s"] = float(med[i])
                if i:
                    row[f"{name}_ratio"] = float(np.median(times[:, i] / times[:, 0]))
                    row[f"{name}_extra_s"] = float(np.median(times[:, i] - times[:, 0]))
            results.append(row)
    elapsed = world.allreduce(time.perf_counter() - started, op=MPI.MAX)

    if world.Get_rank() == 0:
        print(f"checked mode and deadline vs the plain path: {world.Get_size()} ranks, "
              f"{platform.machine()}, Python {platform.python_version()}, "
              f"{' '.join(MPI.Get_library_version().split()[:3])}, float32; run took {elapsed:.1f} s")
        print("  per call: median over rounds of the slowest rank; ratio: median of per-round ratios to plain")
        head = f"{'op':>10} {'size':>8} {'calls':>6} {'plain':>12} {'checked':>12} {'ratio':>7} {'+extra':>11}"
        if "deadline" in names:
            head += f" {'deadline':>12} {'ratio':>7}"
        print(head)
        for r in results:
            line = (f"{r['op']:>10} {human(r['bytes']):>8} {r['calls_per_side']:>6} {fmt_time(r['plain_s'])} "
                    f"{fmt_time(r['checked_s'])} {r['checked_ratio']:>6.2f}x {fmt_time(r['checked_extra_s'])}")
            if "deadline" in names:
                line += f" {fmt_time(r['deadline_s'])} {r['deadline_ratio']:>6.2f}x"
            print(line)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": world.Get_size(), "elapsed_s": elapsed, "results": results}, f, indent=2)
            print(f"wrote {args.json}")
    for c in comms[1:]:
        c.close()
    dup_checked.Free()
    dup_deadline.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())

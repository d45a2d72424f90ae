"""The node-shared window's slot size (``COLLECTIVES_SHM_SLOT_BYTES``), several sizes in one job.

One communicator per slot size (the variable set before each one's first shared-memory allreduce, which
makes its window), and raw mpi4py on a duplicate of the same communicator, on the same float32 buffer:
``allreduce(x, op)`` against ``Allreduce(IN_PLACE, x, SUM)`` (``mean``: followed by ``np.divide``, as
``bench_collectives.py`` times it). The sides alternate within each round (the first side changes every
round), each block after a barrier, about ``--round-ms`` of calls; a block's time is the slowest rank's.
Quoted per size: each side's median time per call and the median of its per-round ratios to raw.

    mpiexec -n 2 python benchmarks/bench_shm_slots.py [--sizes 1MiB..64MiB] [--slots 8MiB,2MiB,1MiB,512KiB]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from _common import fmt_time, human, parse_sizes
from mpi4py import MPI


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1MiB..64MiB")
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--slots", default="8MiB,2MiB,1MiB,512KiB", help="window bytes per rank, one communicator each")
    ap.add_argument("--op", default="sum", choices=["sum", "mean"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--round-ms", type=float, default=50.0)
    args = ap.parse_args()

    import collectives

    world = MPI.COMM_WORLD
    comms = {}
    for slot in parse_sizes(args.slots, 2):
        os.environ["COLLECTIVES_SHM_SLOT_BYTES"] = str(slot)
        c = collectives.init(comm=world.Dup())  # (a communicator of its own for each slot size)
        c.allreduce(np.zeros(2**20, np.float32))  # 4 MiB: its window is made now, with this slot size
        comms[slot] = c
    os.environ.pop("COLLECTIVES_SHM_SLOT_BYTES")
    raw = world.Dup()
    size = world.Get_size()
    if world.Get_rank() == 0:
        print(f"# {size} ranks, {MPI.Get_library_version().splitlines()[0]}, op {args.op}, "
              f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    for nbytes in parse_sizes(args.sizes, args.factor):
        x = np.zeros(nbytes // 4, np.float32)

        def ours(c, x=x):
            return lambda: c.allreduce(x, op=args.op)

        def peer(x=x):
            raw.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
            if args.op == "mean":
                np.divide(x, size, out=x)

        sides = {f"slot {human(s)}": ours(c) for s, c in comms.items()}
        sides["raw"] = peer
        names = list(sides)
        k = max(3, int(args.round_ms / 1e3 / (nbytes / 3e9)))
        times = np.empty((args.rounds, len(names)))
        for r in range(args.rounds):
            for j in range(len(names)):
                i = (j + r) % len(names)
                world.Barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    sides[names[i]]()
                times[r, i] = (time.perf_counter() - t0) / k
        world.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
        if world.Get_rank() == 0:
            ratio = times / times[:, -1:]
            print(f"{human(nbytes):>8}: " + "  ".join(
                f"{n} {fmt_time(float(np.median(times[:, i]))).strip()} ({np.median(ratio[:, i]):.2f}x)"
                for i, n in enumerate(names)), file=sys.stderr, flush=True)
    raw.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The asynchronous allgather and reduce_scatter at 8 B and 1 MiB (float64), against raw mpi4py's non-blocking calls in
the same job: the library's calls (``async_op=True``, into a new array and into ``out=``) and the torch backend's
``dist.all_gather_into_tensor`` / ``dist.reduce_scatter_tensor`` with ``async_op=True`` (what FSDP starts). Raw
mpi4py's non-blocking reduce-scatter both ways: ``Ireduce_scatter_block`` (the library's) and ``Ireduce_scatter``
with equal counts, which MPICH 5 runs with another algorithm for blocks of about 256 KiB to 1 MiB
(docs/performance.md, "MPICH's non-blocking reduce-scatter"). The sides alternate within each of ``--rounds`` rounds
(the first side changes every round), each block after a barrier; a block's time is the slowest rank's; printed: the
median per call over the rounds.

    mpiexec -n 2 python benchmarks/bench_async_blocks.py

(docs/performance.md, "The asynchronous hot path of allgather and reduce_scatter"; the runs quoted there are in
benchmarks/results/issue34/async-blocks/.)
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def sides_for(c, raw, dist, torch, MPI, n: int) -> dict:
    """name -> one call of that side, on buffers of ``n`` float64 per rank (made here, kept by the closures)."""
    size = c.size
    x, xs = np.ones(n), np.ones(n * size)
    out, blk, rbuf = np.empty((size, n)), np.empty(n), np.empty(n * size)
    t, o = torch.ones(n, dtype=torch.float64), torch.empty(n * size, dtype=torch.float64)
    ts, to = torch.ones(n * size, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    return {
        "raw Iallgather": lambda: raw.Iallgather(x, rbuf).Wait(),
        "raw Ireduce_scatter_block": lambda: raw.Ireduce_scatter_block(xs, blk, MPI.SUM).Wait(),
        "raw Ireduce_scatter": lambda: raw.Ireduce_scatter(xs, blk, [n] * size, MPI.SUM).Wait(),
        "allgather async": lambda: c.allgather(x, async_op=True).wait(),
        "allgather async out": lambda: c.allgather(x, out=out, async_op=True).wait(),
        "reduce_scatter async": lambda: c.reduce_scatter(xs, async_op=True).wait(),
        "reduce_scatter async out": lambda: c.reduce_scatter(xs, out=blk, async_op=True).wait(),
        "torch all_gather_into_tensor async": lambda: dist.all_gather_into_tensor(o, t, async_op=True).wait(),
        "torch reduce_scatter_tensor async": lambda: dist.reduce_scatter_tensor(to, ts, async_op=True).wait(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import collectives.torch_backend  # noqa: F401 - registers the backend "collectives"

    dist.init_process_group("collectives")
    c = dist.group.WORLD.communicator
    raw = MPI.COMM_WORLD.Dup()
    torch.set_num_threads(1)
    for nbytes in (8, 1 << 20):
        sides = sides_for(c, raw, dist, torch, MPI, max(nbytes // 8, 1))
        calls = 300 if nbytes == 8 else 20
        times: dict = {s: [] for s in sides}
        for f in sides.values():  # warm: the general path's first call, then the hot path's
            for _ in range(5):
                f()
        names = list(sides)
        for r in range(args.rounds):
            for s in names[r % len(names):] + names[:r % len(names)]:
                raw.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    sides[s]()
                times[s].append(raw.allreduce(time.perf_counter() - start, MPI.MAX) / calls)
        if c.rank == 0:
            for s, v in times.items():
                print(f"{nbytes:>8} B  {s:<36} {np.median(v) * 1e6:9.1f} us", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

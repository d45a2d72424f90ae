"""Our CUDA allreduce against raw NCCL calls (through ``_libnccl``) on the same buffers, same communicator.

    mpiexec -n 2 python benchmarks/bench_nccl.py                      # needs a GPU per rank, or
    NCCL_MULTI_RANK_GPU_ENABLE=1 mpiexec -n 2 python benchmarks/bench_nccl.py   # two ranks on one GPU
    python benchmarks/bench_nccl.py --lib cupy --json out.json

===========  ===================================================  ======================================================
row          ours                                                 raw
===========  ===================================================  ======================================================
allreduce    ``collectives.allreduce(x, op="sum")`` (torch/CuPy)  ``lib.all_reduce(p, p, n, ncclFloat32, ncclSum, comm,
                                                                  stream)`` on our own NCCL communicator and x's pointer
===========  ===================================================  ======================================================

How: every size runs in rounds that alternate which side goes first (ABBA); a round is a host barrier, a
device synchronisation, ``k`` back-to-back calls and a synchronisation; the time of one call is the block
time / ``k`` on the slowest rank. Reported: the median over rounds, and the median of the per-round ratio
ours / raw. Small messages (8 B .. 64 KiB) measure per-call overhead (the Python work before the launch);
large ones (1 .. 256 MiB) bandwidth, shown as NCCL's bus bandwidth ``2 (n-1)/n * bytes / time``.

Before timing, the result of each side is checked (``x`` of ones sums to the world size).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

SMALL = [8, 64, 512, 4 << 10, 32 << 10, 64 << 10]
LARGE = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def human(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


class Torch:
    def __init__(self, index):
        import torch

        self.torch, self.index = torch, index
        torch.cuda.set_device(index)

    def ones(self, n):
        return self.torch.ones(n, dtype=self.torch.float32, device=f"cuda:{self.index}")

    def fill_(self, x, v):
        x.fill_(v)

    def ptr(self, x):
        return x.data_ptr()

    def stream(self, x):
        return self.torch.cuda.current_stream(x.device).cuda_stream

    def sync(self):
        self.torch.cuda.synchronize(self.index)

    def first(self, x):
        return float(x[0].item())

    def versions(self):
        return {"torch": self.torch.__version__, "cuda": self.torch.version.cuda,
                "gpu": self.torch.cuda.get_device_name(self.index)}


class Cupy:
    def __init__(self, index):
        import cupy

        self.cp, self.index = cupy, index
        cupy.cuda.Device(index).use()

    def ones(self, n):
        return self.cp.ones(n, dtype=self.cp.float32)

    def fill_(self, x, v):
        x.fill(v)

    def ptr(self, x):
        return x.data.ptr

    def stream(self, x):
        return self.cp.cuda.get_current_stream().ptr

    def sync(self):
        self.cp.cuda.Device(self.index).synchronize()

    def first(self, x):
        return float(x[0].get())

    def versions(self):
        return {"cupy": self.cp.__version__, "cuda_runtime": self.cp.cuda.runtime.runtimeGetVersion()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", choices=("torch", "cupy"), default="torch")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--small-calls", type=int, default=300, help="calls per side per round, small sizes")
    ap.add_argument("--large-calls", type=int, default=5, help="calls per side per round, large sizes")
    ap.add_argument("--max-bytes", type=int, default=256 << 20)
    ap.add_argument("--json", help="write the results here (rank 0)")
    args = ap.parse_args(argv)

    import collectives as coll
    from collectives._backends import _libnccl, cuda

    comm = coll.init()
    try:
        __import__(args.lib)  # the library must be imported before collectives can see the GPU through it
        api = cuda.device_api()
    except (ImportError, coll.BackendUnavailableError) as exc:
        if comm.rank == 0:
            print(f"bench_nccl: no GPU: {exc}", file=sys.stderr)
        return 2
    index = cuda.choose_device(comm.local_rank, api.device_count())
    xp = (Torch if args.lib == "torch" else Cupy)(index)

    x = xp.ones(1024)
    coll.allreduce(x, comm=comm)
    transport = comm._devices[(2, index)]
    if transport.name != "nccl":
        if comm.rank == 0:
            print(f"bench_nccl: CUDA arrays use {transport.name!r}, not NCCL: nothing to compare", file=sys.stderr)
        return 2
    lib, handle = transport._lib, transport._handle

    def raw(buf, n):
        p = xp.ptr(buf)
        status = lib.all_reduce(p, p, n, _libnccl.ncclFloat32, _libnccl.ncclSum, handle, xp.stream(buf))
        if status != _libnccl.ncclSuccess:
            transport._settle("raw ncclAllReduce")

    def ours(buf, n):
        coll.allreduce(buf, comm=comm)

    def slowest(seconds: float) -> float:
        return float(comm.allreduce(np.array([seconds]), op="max")[0])

    def block(fn, buf, n, k) -> float:
        comm.barrier()
        xp.sync()
        start = time.perf_counter()
        for _ in range(k):
            fn(buf, n)
        xp.sync()
        return slowest((time.perf_counter() - start) / k)

    rows = []
    sizes = [s for s in SMALL + LARGE if s <= args.max_bytes]
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        buf = xp.ones(n)
        for name, fn in (("ours", ours), ("raw", raw)):  # correctness first, then warm-up
            xp.fill_(buf, 1.0)
            fn(buf, n)
            xp.sync()
            got = xp.first(buf)
            if got != comm.size:
                print(f"bench_nccl: {name} allreduce of ones gave {got}, expected {comm.size}", file=sys.stderr)
                return 1
        k = args.small_calls if nbytes < (1 << 20) else args.large_calls
        times = {"ours": [], "raw": []}
        ratios = []
        for r in range(args.rounds):
            order = (("ours", ours), ("raw", raw)) if r % 2 == 0 else (("raw", raw), ("ours", ours))
            got = {name: block(fn, buf, n, k) for name, fn in order}
            for name in got:
                times[name].append(got[name])
            ratios.append(got["ours"] / got["raw"])
        t_ours, t_raw = statistics.median(times["ours"]), statistics.median(times["raw"])
        row = {"bytes": nbytes, "ours_us": t_ours * 1e6, "raw_us": t_raw * 1e6, "ratio": statistics.median(ratios),
               "calls_per_round": k, "rounds": args.rounds}
        if nbytes >= (1 << 20):
            factor = 2 * (comm.size - 1) / comm.size if comm.size > 1 else 1.0
            row["ours_busbw_GBps"] = factor * nbytes / t_ours / 1e9
            row["raw_busbw_GBps"] = factor * nbytes / t_raw / 1e9
        rows.append(row)
        del buf

    if comm.rank == 0:
        print(f"allreduce float32 sum, {comm.size} rank(s), {args.lib}, NCCL "
              f"{'.'.join(map(str, lib.version_tuple))}; ours/raw: median of per-round ratios")
        print(f"{'size':>9} {'ours us':>10} {'raw us':>10} {'ratio':>7} {'ours GB/s':>10} {'raw GB/s':>10}")
        for row in rows:
            bw = (f"{row['ours_busbw_GBps']:>10.1f} {row['raw_busbw_GBps']:>10.1f}"
                  if "ours_busbw_GBps" in row else "")
            print(f"{human(row['bytes']):>9} {row['ours_us']:>10.2f} {row['raw_us']:>10.2f} {row['ratio']:>7.3f} {bw}")
        if args.json:
            meta = {"size": comm.size, "lib": args.lib, "nccl": ".".join(map(str, lib.version_tuple)),
                    "python": platform.python_version(), **xp.versions()}
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

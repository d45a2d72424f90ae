"""``python -m collectives bench``: time the collectives, in the manner of nccl-tests and the OSU benchmarks.

    mpiexec -n 2 python -m collectives bench                          # allreduce sum, float32, 8 B..64 MiB
    mpiexec -n 2 python -m collectives bench -c allreduce,broadcast -b 1K -e 128M -f 4
    mpiexec -n 2 python -m collectives bench -o sum,mean -d float64 --check
    mpiexec -n 4 python -m collectives bench -c allreduce_tree --leaves 16 --json > out.json
    mpiexec -n 2 python -m collectives bench -a torch-cuda -d bfloat16   # on GPUs, one per rank
    mpiexec -n 2 python -m collectives bench -o sum,mean --reproducible  # reproducible=True sums

For each collective, reduction op and size, every rank times ``-n`` calls one by one (after ``-w``
warm-up calls; a barrier between calls, outside the timed region, as the OSU benchmarks do), takes the
median of its own times, and the table shows the median over ranks of these per-rank medians ("time")
with their smallest and largest ("min", "max": the spread across ranks).

Sizes are bytes per rank (the buffer each rank passes: for reduce_scatter and alltoall the whole input of
``n`` blocks, as nccl-tests counts them; the element count is rounded down to a multiple of ``n``). Bandwidths follow nccl-tests
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md), with ``n`` ranks:

* ``algbw = bytes / time`` (for allgather and gather, the gathered bytes: ``n * size``);
* ``busbw = algbw * factor``: ``2(n-1)/n`` for allreduce and allreduce_tree, ``(n-1)/n`` for allgather, gather,
  reduce_scatter and alltoall, ``1`` for broadcast, reduce and synchronize. busbw is what each rank's link must carry with an optimal
  algorithm, so it can be compared with the hardware's bandwidth (memory bandwidth on one node) and
  across rank counts.

``--reproducible`` makes float and complex sums and means reproducible (``comm.reproducible = True``,
as ``COLLECTIVES_REPRODUCIBLE=1`` does, which the bench also honours), and times the ordinary call too
(``comm.reproducible = False``, the same buffer, right after): the tables of such sums and means gain the
columns ``ordinary(us)`` (its time, as "time") and ``cost``, the ratio of the two: the mode's cost. ``--check`` runs one more call per size on patterned data and counts the wrong elements over all ranks
(exit status 1 if any). Progress goes to stderr on sweeps that take more than a few seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from typing import Any

import numpy as np

COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "gather", "synchronize", "allreduce_tree",
               "reduce_scatter", "alltoall")
REDUCING = ("allreduce", "reduce", "allreduce_tree", "reduce_scatter")
BLOCKS = ("reduce_scatter", "alltoall")  # the input is split into n blocks
TREE = ("synchronize", "allreduce_tree")
OPS = ("sum", "prod", "min", "max", "mean")
ARRAYS = ("numpy", "torch", "cupy", "torch-cuda")
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30}
GB = 1e9  # bandwidths in GB/s (10^9 bytes), as nccl-tests


def parse_bytes(text: str) -> int:
    """``8``, ``1K``, ``64M``, ``1GiB`` -> bytes (powers of two, as nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 8, 4K, 64M or 1G")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def human(nbytes: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def pretty(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def sizes_from(begin: int, end: int, factor: float) -> list[int]:
    """begin, begin*factor, ... up to end (inclusive), as ``-b -e -f`` of nccl-tests."""
    if begin < 1 or end < begin:
        raise ValueError(f"sizes: need 1 <= -b ({begin}) <= -e ({end})")
    if factor <= 1:
        raise ValueError(f"-f must be more than 1, got {factor}")
    out, s = [], float(begin)
    while s <= end * (1 + 1e-9):
        out.append(round(s))
        s *= factor
    return sorted(set(out))


def bus_factor(collective: str, n: int) -> float:
    if collective in ("allreduce", "allreduce_tree"):
        return 2 * (n - 1) / n
    if collective in ("allgather", "gather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 1.0


def default_iters(nbytes: int) -> int:
    """About 1 GiB moved per size: 1000 calls up to 1 MiB, then fewer, at least 20 (20 at 64 MiB)."""
    return int(min(1000, max(20, 2**30 // max(nbytes, 1))))


# ---------------------------------------------------------------------------------------------------------
# array libraries: made here, by name, so that the rest of the tool only sees "make", "sync", "to_numpy"

class Arrays:
    """How the benchmark makes arrays of one library and device, waits for them, and reads them back."""

    def __init__(self, name: str, dtype: str, local_rank: int):
        self.name = name
        self.dtype: Any  # the library's own: a NumPy dtype (numpy, cupy) or a torch.dtype (torch, torch-cuda)
        if name in ("numpy", "cupy"):
            try:
                np.dtype(dtype)
            except TypeError:
                raise ValueError(f"-d {dtype}: not a NumPy dtype (e.g. float32, int64, complex64)") from None
        if name == "numpy":
            self.dtype = np.dtype(dtype)
            self.version = np.__version__
            self.device = "cpu"
        elif name in ("torch", "torch-cuda"):
            import torch

            self.torch = torch
            self.dtype = getattr(torch, dtype, None)
            if not isinstance(self.dtype, torch.dtype):
                raise ValueError(f"-d {dtype}: not a torch dtype")
            self.version = torch.__version__
            if name == "torch-cuda":
                if not torch.cuda.is_available():
                    raise ValueError("-a torch-cuda: torch sees no CUDA device")
                self.device = f"cuda:{local_rank % torch.cuda.device_count()}"
                torch.cuda.set_device(self.device)
            else:
                self.device = "cpu"
        elif name == "cupy":
            import cupy

            self.cupy = cupy
            self.dtype = np.dtype(dtype)
            self.version = cupy.__version__
            dev = local_rank % cupy.cuda.runtime.getDeviceCount()
            cupy.cuda.Device(dev).use()
            self.device = f"cuda:{dev}"
        else:
            raise ValueError(f"-a {name}: expected one of {', '.join(ARRAYS)}")

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    @property
    def kind(self) -> str:
        """NumPy-style kind letter of the dtype: b, i, u, f or c."""
        if self.name in ("numpy", "cupy"):
            return self.dtype.kind
        t = self.torch
        if self.dtype == t.bool:
            return "b"
        if self.dtype.is_complex:
            return "c"
        if self.dtype.is_floating_point:
            return "f"
        return "u" if self.dtype == t.uint8 else "i"

    def from_numpy(self, a: np.ndarray):
        if self.name == "numpy":
            return a.astype(self.dtype)
        if self.name == "cupy":
            return self.cupy.asarray(a.astype(self.dtype))
        t = self.torch
        return t.from_numpy(np.ascontiguousarray(a)).to(device=self.device, dtype=self.dtype)

    def filled(self, count: int, value: float):
        """A fresh array of ``count`` elements, all ``value``."""
        if self.name == "numpy":
            return np.full(count, value, dtype=self.dtype)
        if self.name == "cupy":
            return self.cupy.full(count, value, dtype=self.dtype)
        return self.torch.full((count,), value, dtype=self.dtype, device=self.device)

    def to_numpy(self, x) -> np.ndarray:
        if self.name == "numpy":
            return np.asarray(x)
        if self.name == "cupy":
            return self.cupy.asnumpy(x)
        t = self.torch
        x = x.detach().cpu()
        if x.dtype == t.bfloat16:
            x = x.float()
        return x.numpy()

    def sync(self) -> None:
        if self.name == "torch-cuda":
            self.torch.cuda.synchronize()
        elif self.name == "cupy":
            self.cupy.cuda.get_current_stream().synchronize()


# ---------------------------------------------------------------------------------------------------------
# what one call is, and what it must produce

def pattern(count: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s check input: small integers, exact in every dtype (also float16 and bfloat16)."""
    return (np.arange(count) % 5 + rank).astype(np.float64)


def check_input(collective: str, op: str, count: int, rank: int, n: int, kind: str) -> np.ndarray:
    """Rank ``rank``'s input for the checked call."""
    x = pattern(count, rank)
    if kind == "b":
        return x % 2 == 0
    if op == "prod" and collective in REDUCING:  # small products: one rank contributes 2, the others 1
        return np.where(np.arange(count) % n == rank, 2.0, 1.0)
    return x


def expected(collective: str, op: str, count: int, rank: int, n: int, root: int, kind: str) -> np.ndarray:
    """What rank ``rank`` must hold after the checked call, as float64 (``(n, count)`` for allgather)."""
    inputs = [check_input(collective, op, count, q, n, kind).astype(np.float64) for q in range(n)]
    if collective in ("broadcast", "synchronize"):
        return inputs[root]
    if collective == "allgather" or (collective == "gather" and rank == root):
        return np.stack(inputs)
    if collective in ("reduce", "gather") and rank != root:  # (gather: None there, checked as x unchanged)
        return inputs[rank]
    block = slice(count // n * rank, count // n * (rank + 1))
    if collective == "alltoall":
        return np.concatenate([x[block] for x in inputs])
    ufunc = {"sum": np.add, "mean": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    out = inputs[0]
    for x in inputs[1:]:
        out = ufunc(out, x)
    out = out / n if op == "mean" else out
    return out[block] if collective == "reduce_scatter" else out


def tolerance(kind: str, dtype_name: str) -> float:
    if kind not in "fc":
        return 0.0
    return {"float16": 1e-3, "bfloat16": 1e-2, "complex64": 1e-6, "float32": 1e-6}.get(dtype_name, 1e-12)


def wrong_count(got: np.ndarray, want: np.ndarray, tol: float) -> int:
    got = np.asarray(got).astype(np.complex128 if np.iscomplexobj(got) else np.float64).reshape(want.shape)
    if tol == 0.0:
        return int(np.count_nonzero(got != want))
    return int(np.count_nonzero(~np.isclose(got, want, rtol=tol, atol=0.0)))


def make_call(coll, comm, collective: str, op: str, root: int, x, leaves: int):
    """A zero-argument callable running the collective on ``x`` (or on a tree of ``leaves`` parts of it),
    and a function returning its result (after the call) for checking."""
    if collective == "allreduce":
        box = [x]
        return (lambda: box.__setitem__(0, coll.allreduce(x, op=op, comm=comm))), (lambda: box[0])
    if collective == "broadcast":
        box = [x]
        return (lambda: box.__setitem__(0, coll.broadcast(x, root=root, comm=comm))), (lambda: box[0])
    if collective == "reduce":
        box = [x]
        return (lambda: box.__setitem__(0, coll.reduce(x, op=op, root=root, comm=comm))), (lambda: box[0])
    if collective == "allgather":
        box = [None]
        return (lambda: box.__setitem__(0, coll.allgather(x, comm=comm))), (lambda: box[0])
    if collective == "gather":
        box = [None]
        return (lambda: box.__setitem__(0, coll.gather(x, root=root, comm=comm))), \
            (lambda: x if box[0] is None and comm.rank != root else box[0])
    if collective == "reduce_scatter":
        box = [None]
        return (lambda: box.__setitem__(0, coll.reduce_scatter(x, op=op, comm=comm))), (lambda: box[0])
    if collective == "alltoall":
        box = [None]
        return (lambda: box.__setitem__(0, coll.alltoall(x, comm=comm))), (lambda: box[0])
    # tree collectives: ``leaves`` views of x (a model's parameters, as far as the library can tell)
    count = x.shape[0]
    bounds = [count * i // leaves for i in range(leaves + 1)]
    tree = {f"p{i:03d}": x[bounds[i]:bounds[i + 1]] for i in range(leaves) if bounds[i + 1] > bounds[i]}
    box = [tree]
    if collective == "synchronize":
        run = lambda: box.__setitem__(0, coll.synchronize(tree, root=root, comm=comm))
    else:
        run = lambda: box.__setitem__(0, coll.allreduce_tree(tree, op=op, comm=comm))
    return run, (lambda: [box[0][k] for k in sorted(box[0])])  # the leaves, in order


# ---------------------------------------------------------------------------------------------------------
# measuring

def time_calls(comm, call, sync, iters: int, warmup: int) -> np.ndarray:
    """This rank's time of each of ``iters`` calls (seconds), with a barrier between calls, untimed."""
    for _ in range(warmup):
        call()
    sync()
    times = np.empty(iters)
    perf, barrier = time.perf_counter, comm.barrier
    for i in range(iters):
        barrier()
        t0 = perf()
        call()
        sync()
        times[i] = perf() - t0
    return times


def run_check(coll, comm, arrays: Arrays, collective, op, root, count, leaves) -> int:
    """Wrong elements on this rank after one call on patterned data."""
    n, rank, kind = comm.size, comm.rank, arrays.kind
    x = arrays.from_numpy(check_input(collective, op, count, rank, n, kind))
    call, result = make_call(coll, comm, collective, op, root, x, leaves)
    call()
    arrays.sync()
    want = expected(collective, op, count, rank, n, root, kind)
    tol = tolerance(kind, arrays.dtype_name)
    got = result()
    if isinstance(got, list):  # tree: the leaves in order
        got = np.concatenate([arrays.to_numpy(g).reshape(-1) for g in got]) if got else np.empty(0)
        return wrong_count(got, want, tol)
    return wrong_count(arrays.to_numpy(got), want, tol)


def header(coll, comm, arrays: Arrays, args) -> dict:
    info = {"collectives": coll.__version__, "python": platform.python_version(), "numpy": np.__version__,
            "array_library": f"{arrays.name} {arrays.version}", "device": arrays.device,
            "ranks": comm.size, "local_size": comm.local_size, "backend": comm.backend,
            "machine": f"{platform.machine()}, {_cpu_count()} cores", "dtype": arrays.dtype_name,
            "iters": args.iters or "auto", "warmup": args.warmup, "reproducible": comm.reproducible}
    if comm.backend == "mpi":
        from mpi4py import MPI
        import mpi4py

        levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                  MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
        info["mpi_library"] = " ".join(MPI.Get_library_version().replace("\0", "").split("\n")[0].split())
        info["mpi4py"] = mpi4py.__version__
        info["thread_level"] = levels.get(MPI.Query_thread(), str(MPI.Query_thread()))
    return info


def _cpu_count() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m collectives bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--collective", default="allreduce",
                    help=f"comma-separated, from {', '.join(COLLECTIVES)}, or 'all' (default allreduce)")
    ap.add_argument("-o", "--op", default="sum",
                    help=f"reduction op(s) for allreduce, reduce, allreduce_tree: {', '.join(OPS)} "
                         f"(comma-separated; default sum)")
    ap.add_argument("-d", "--dtype", default="float32", help="element type (default float32)")
    ap.add_argument("-a", "--array", default="numpy", choices=ARRAYS, help="array library (default numpy)")
    ap.add_argument("-b", "--minbytes", type=parse_bytes, default=8, help="smallest size per rank (8)")
    ap.add_argument("-e", "--maxbytes", type=parse_bytes, default=64 * 2**20, help="largest size (64M)")
    ap.add_argument("-f", "--stepfactor", type=float, default=2.0, help="factor between sizes (2)")
    ap.add_argument("-n", "--iters", type=int, default=0,
                    help="timed calls per size (default: 1000 up to 1 MiB, then 1 GiB/size, >= 20)")
    ap.add_argument("-w", "--warmup", type=int, default=5, help="untimed calls first (5)")
    ap.add_argument("-r", "--root", type=int, default=0, help="root of broadcast/reduce/synchronize (0)")
    ap.add_argument("--leaves", type=int, default=8, help="leaves of the tree collectives' tree (8)")
    ap.add_argument("--check", action="store_true", help="verify results (one more call per size)")
    ap.add_argument("--reproducible", action="store_true",
                    help="float sums and means with reproducible=True (as COLLECTIVES_REPRODUCIBLE=1)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return ap


def plan(args, ap) -> tuple[list[str], list[str], list[int]]:
    names = COLLECTIVES if args.collective.strip() == "all" else \
        tuple(c.strip() for c in args.collective.split(",") if c.strip())
    for c in names:
        if c not in COLLECTIVES:
            ap.error(f"-c {c!r}: expected one of {', '.join(COLLECTIVES)} or all")
    ops = [o.strip() for o in args.op.split(",") if o.strip()]
    for o in ops:
        if o not in OPS:
            ap.error(f"-o {o!r}: expected one of {', '.join(OPS)}")
    try:
        sizes = sizes_from(args.minbytes, args.maxbytes, args.stepfactor)
    except ValueError as exc:
        ap.error(str(exc))
    if args.iters < 0 or args.warmup < 0 or args.leaves < 1:
        ap.error("-n and -w must be >= 0 and --leaves >= 1")
    return list(names), ops, sizes


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    names, ops, sizes = plan(args, ap)
    import collectives as coll

    comm = coll.init()
    if args.reproducible:
        comm.reproducible = True
    if any(c in TREE for c in names) and not hasattr(coll, "synchronize"):
        names = [c for c in names if c not in TREE]
    if not 0 <= args.root < comm.size:
        ap.error(f"-r {args.root}: out of range for {comm.size} ranks")
    try:
        arrays = Arrays(args.array, args.dtype, comm.local_rank)
    except ImportError as exc:
        ap.error(f"-a {args.array}: cannot import it ({exc}); install it or choose another -a")
    except (ValueError, TypeError) as exc:
        ap.error(f"{exc}")
    info = header(coll, comm, arrays, args)
    n, rank = comm.size, comm.rank
    cases = [(c, o) for c in names for o in (ops if c in REDUCING else [None])]
    if arrays.kind == "b":  # bool reduces with min/max only
        cases = [(c, o) for c, o in cases if o in (None, "min", "max")]
    if arrays.kind not in "fc":
        cases = [(c, o) for c, o in cases if o != "mean"]
    results, failed = [], 0
    started = time.monotonic()
    steps, step = len(cases) * len(sizes), 0
    show = not args.quiet and rank == 0
    for collective, op in cases:
        table = []
        for nbytes in sizes:
            step += 1
            count = nbytes // arrays.itemsize
            if collective in BLOCKS:
                count -= count % n
                nbytes = count * arrays.itemsize
            if count == 0 or (collective in TREE and count < args.leaves):
                continue
            if show and time.monotonic() - started > 3:
                print(f"bench: [{step}/{steps}] {collective}{' ' + op if op else ''} {pretty(nbytes)}",
                      file=sys.stderr, flush=True)
            iters = args.iters or default_iters(nbytes)
            # contents that stay finite however often the call runs: 0 for sum, 1 for mean/prod/min/max
            x = arrays.filled(count, 0 if op in (None, "sum") else 1)
            call, _ = make_call(coll, comm, collective, op or "sum", args.root, x, args.leaves)
            mine = float(np.median(time_calls(comm, call, arrays.sync, iters, args.warmup)))
            ordinary = math.nan
            if costed(comm, arrays, op):  # the mode's cost: the ordinary call of the same buffer, right after
                comm.reproducible = False
                try:
                    call, _ = make_call(coll, comm, collective, op or "sum", args.root, x, args.leaves)
                    ordinary = float(np.median(time_calls(comm, call, arrays.sync, iters, args.warmup)))
                finally:
                    comm.reproducible = True
            del x, call
            wrong = run_check(coll, comm, arrays, collective, op or "sum", args.root, count, args.leaves) \
                if args.check else 0
            gathered = coll.allgather(np.array([mine, float(wrong), ordinary]), comm=comm)
            medians, wrong = gathered[:, 0], int(gathered[:, 1].sum())
            t = float(np.median(medians))
            moved = nbytes * (n if collective in ("allgather", "gather") else 1)
            algbw = moved / t / GB if t > 0 else math.inf
            row = {"collective": collective, "op": op, "dtype": arrays.dtype_name, "bytes": nbytes,
                   "count": count, "iters": iters, "time_us": t * 1e6,
                   "min_us": float(medians.min()) * 1e6, "max_us": float(medians.max()) * 1e6,
                   "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(collective, n)}
            if not math.isnan(ordinary):
                ordinary_s = float(np.median(gathered[:, 2]))
                row["ordinary_us"] = ordinary_s * 1e6
                row["cost"] = t / ordinary_s if ordinary_s > 0 else math.inf
            if args.check:
                row["wrong"] = wrong
                failed += wrong
            table.append(row)
        results.extend(table)
        if rank == 0 and not args.json:
            print_table(info, collective, op, table, args.check)
    if rank == 0 and args.json:
        json.dump({"header": info, "results": results,
                   "elapsed_s": time.monotonic() - started}, sys.stdout, indent=1)
        print()
    elif rank == 0:
        print(f"# took {time.monotonic() - started:.1f} s" + (f"; {failed} wrong elements" if failed else ""))
    return 1 if failed else 0


def costed(comm, arrays, op) -> bool:
    """Whether a row times the ordinary call beside the reproducible one: a float or complex sum or mean
    while the communicator's sums are reproducible (``--reproducible``, ``COLLECTIVES_REPRODUCIBLE=1``)."""
    return bool(comm.reproducible) and op in ("sum", "mean") and arrays.kind in "fc"


_printed_header = False


def print_table(info: dict, collective: str, op, rows: list[dict], check: bool) -> None:
    global _printed_header
    if not _printed_header:
        _printed_header = True
        print(f"# collectives {info['collectives']} bench: {info['ranks']} ranks "
              f"({info['local_size']} on this node), backend {info['backend']}, {info['array_library']} "
              f"on {info['device']}, {info['machine']}, Python {info['python']}")
        if "mpi_library" in info:
            print(f"# {info['mpi_library']}, mpi4py {info['mpi4py']}, thread level {info['thread_level']}")
        print("# time: median over ranks of each rank's median call time; min/max: spread of those "
              "medians across ranks")
        print("# algbw = bytes/time; busbw = algbw * 2(n-1)/n (allreduce), (n-1)/n (allgather, "
              "reduce_scatter, alltoall), 1 (broadcast, reduce); GB = 1e9 B")
    title = collective + (f" op={op}" if op else "") + f" dtype={info['dtype']}" + (
        " reproducible" if info.get("reproducible") and op in ("sum", "mean") else "")
    print(f"#\n# {title}")
    cols = f"{'size':>10} {'count':>11} {'iters':>5} {'time(us)':>11} {'min(us)':>11} {'max(us)':>11} " \
           f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11}"
    cost = any("cost" in r for r in rows)
    if cost:
        cols += f" {'ordinary(us)':>12} {'cost':>6}"
    print("#" + cols[1:] + ("  #wrong" if check else ""))
    for r in rows:
        line = (f"{r['bytes']:>10} {r['count']:>11} {r['iters']:>5} {r['time_us']:>11.2f} {r['min_us']:>11.2f} "
                f"{r['max_us']:>11.2f} {r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f}")
        if cost:
            line += f" {r['ordinary_us']:>12.2f} {r['cost']:>5.2f}x"
        if check:
            line += f"  {r['wrong']:>6}"
        print(line, flush=True)

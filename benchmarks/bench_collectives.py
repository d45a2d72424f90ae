"""Our collectives against raw mpi4py on the same buffers, in the same job.

    mpiexec -n 2 python benchmarks/bench_collectives.py
    mpiexec -n 2 python benchmarks/bench_collectives.py --sizes 8B..64MiB --factor 4 --json out.json
    mpiexec -n 2 python benchmarks/bench_collectives.py --sizes 8B,1MiB --iters 200
    mpiexec -n 2 python benchmarks/bench_collectives.py --sizes 8B..4KiB --array torch

What is compared, on NumPy float32 arrays (``--array torch``: CPU torch tensors, raw mpi4py on ``t.numpy()``,
its new result of ``rscatter``, ``alltoall`` and ``allgather`` made a tensor with ``torch.from_numpy``, as
ours returns one):

==============  =============================================  ====================================================
row             ours                                           raw mpi4py (on a duplicate of COMM_WORLD)
==============  =============================================  ====================================================
``allreduce``   ``collectives.allreduce(x, op="sum")``         ``comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)``
``broadcast``   ``collectives.broadcast(x, root=0)``           ``comm.Bcast(x, root=0)``
``mean``        ``collectives.allreduce(x, op="mean")``        ``Allreduce(IN_PLACE, x, SUM)`` + ``np.divide(x, size, out=x)``
``rscatter``    ``collectives.reduce_scatter(x, op="sum")``    ``np.empty`` of the block + ``comm.Reduce_scatter_block(x, out, MPI.SUM)``
``alltoall``    ``collectives.alltoall(x)``                    ``np.empty_like(x)`` + ``comm.Alltoall(x, out)``
``async``       ``collectives.allreduce(x, async_op=True)``    ``comm.Iallreduce(MPI.IN_PLACE, x, MPI.SUM)``
                ``.wait()``                                    ``.Wait()``
``reduce``      ``collectives.reduce(x, op="sum", root=0)``    ``comm.Reduce(MPI.IN_PLACE or x, x, MPI.SUM, root=0)``
``allgather``   ``collectives.allgather(x)``                   ``np.empty((size, n))`` + ``comm.Allgather(x, out)``
==============  =============================================  ====================================================

(``rscatter``, ``alltoall``, ``async``, ``reduce`` and ``allgather`` only with ``--ops``; the sizes of the first
two are rounded down to a multiple of the ranks. ``async`` is the asynchronous hot path from its second call
(the first, the general path, fills it): its record and the fingerprint beside the transfer (one more small
MPI collective at 2 ranks and more, which raw's side does not run); ``reduce`` and ``allgather`` are their
hot paths from the second call too (allgather: a new array each call, as raw's side makes one). No target
for these three.)

At the smallest size the ``allreduce``, ``broadcast`` and ``async`` rows of NumPy arrays also time a third
side, the **floor**: the least Python that the library's contract needs in front of the MPI call, written as
one function (:func:`floor_sides`): a public function call, the thread guard (``RLock.acquire(False)`` and
``release``), the array check (``x.__class__``, ``x.flags.carray``), the cached call's look-up by op and
dtype, and the same cached call (a closure with the large-buffer test, around ``Allreduce`` on
``[x, datatype]``); for ``async``, the call and its ``wait()`` each under the guard, and the contract's
second MPI call: the fingerprint (22 int64, ``Iallreduce`` with ``MAX`` on a communicator of its own) started
beside the data's ``Iallreduce``, waited first and compared. ours/floor is what the library adds beyond
that least; raw/floor is this machine's price of the contract itself.

How it is measured, so that the machine's noise (shared cores, frequency changes) hits both sides alike:

* ours and raw run on the *same* buffer, in *alternating rounds* (ABBA: the side that goes first swaps every
  round); every round starts with a barrier and times a block of ``k`` back-to-back calls on each rank;
* a round's time of one call is (block time / ``k``) on the slowest rank (the blocks start after a barrier,
  so the slowest rank decides when the collective is over); the time reported is the median over rounds,
  and the ratio ours/raw is the median over rounds of the ratio *within* a round, so that a change of the
  machine's speed between rounds cancels out (the JSON also has the ratio of the two medians);
* ``k`` and the number of rounds shrink with the size (20000 calls at 8 B, 31 from 8 MiB up), so a
  default run takes about 30 s at 2 ranks on a quiet machine. ``--iters N`` sets the calls per side per
  size instead.

Only the ratios (ours / raw) mean something, and only between figures of one run: absolute times move by
2x between runs on a shared machine, so ``--repeat N`` runs everything N times in a row in one job and prints
every run's ratio with their spread. Targets (issue 34): allreduce sum at 8 B within 1.15x of raw mpi4py at
the same MPI thread level (below this machine's floor, see docs/performance.md); allreduce mean at most
0.6x at 1 MiB and 0.5x at 64 MiB in every run; the rest within 1.05x from 1 MiB up. The ``faults`` column
counts minor page faults per call on each side (load-independent: memory a side maps anew on every call). From ``COLLECTIVES_SHM_THRESHOLD`` (256 KiB) up, our allreduce between ranks of one
node goes through node-shared memory rather than MPI's allreduce, so it may beat raw mpi4py there; run
with ``COLLECTIVES_SHM=0`` to compare the same MPI call on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time

import numpy as np
from _common import fmt_time, human, measure, parse_sizes, plan

import collectives

TARGET_SMALL = 1.15  # ours/raw of allreduce sum at the smallest size (issue 34; issue 7 had 1.5x)
TARGET_LARGE = 1.05  # ours/raw from 1 MiB up
TARGET_MEAN = {2**20: 0.6, 2**26: 0.5}  # allreduce mean, ours/raw (issue 34: the node-shared window)
LARGE = 2**20
ROWS = ("allreduce", "broadcast", "mean", "rscatter", "alltoall", "async", "reduce", "allgather")
GENERAL = ("async", "reduce", "allgather")  # rows without a target: async runs a second collective that raw's
# side does not (the fingerprint; its floor has it); reduce and allgather had no hot path before stop 54


def floor_sides(raw, MPI, x: np.ndarray):
    """``{op: f}``: the least the contract needs in front of the MPI call (see the module), for ``x``."""
    guard = threading.RLock()
    enter, leave = guard.acquire, guard.release
    datatype, in_place, mpi_sum = MPI.FLOAT, MPI.IN_PLACE, MPI.SUM
    allreduce, bcast = raw.Allreduce, raw.Bcast
    slow_at = 1 << 18

    def run(b):
        if b.nbytes >= slow_at:
            raise AssertionError("the floor is measured on small buffers only")
        allreduce(in_place, [b, datatype], mpi_sum)

    table = {"sum": {x.dtype: run}}
    broadcasts = {x.dtype: bcast}

    def floor_allreduce(b, op="sum", *, comm=None, async_op=False):
        if not enter(False):
            raise RuntimeError("another thread is inside a collective")
        try:
            if b.__class__ is np.ndarray and b.flags.carray:
                call = table.get(op, {}).get(b.dtype)
                if call is not None:
                    call(b)
                    return b
            raise AssertionError("the floor has no general path")
        finally:
            leave()

    def floor_broadcast(b, root=0, *, comm=None, async_op=False):
        if not enter(False):
            raise RuntimeError("another thread is inside a collective")
        try:
            if b.__class__ is np.ndarray and b.flags.carray and root.__class__ is int and 0 <= root < 2**30:
                call = broadcasts.get(b.dtype)
                if call is not None:
                    call(b, root)
                    return b
            raise AssertionError("the floor has no general path")
        finally:
            leave()

    fingerprints = raw.Dup()  # (collective: every rank makes the floor's sides in the same order)
    mine = np.zeros(22, np.int64)  # a call's fields and their negations, as the fingerprint carries them
    mine[:11] = np.arange(11)
    mine[11:] = -mine[:11]
    expected, mpi_max = mine.tobytes(), MPI.MAX
    istart, ifingerprint = raw.Iallreduce, fingerprints.Iallreduce
    starts = {"sum": {x.dtype: True}}

    def floor_async(b, op="sum"):
        if not enter(False):
            raise RuntimeError("another thread is inside a collective")
        try:
            if b.__class__ is np.ndarray and b.flags.carray and starts.get(op, {}).get(b.dtype):
                v = mine.copy()
                check = ifingerprint(in_place, v, mpi_max)
                request = istart(in_place, [b, datatype], mpi_sum)
            else:
                raise AssertionError("the floor has no general path")
        finally:
            leave()
        if not enter(False):  # (the handle's wait: under the guard too)
            raise RuntimeError("another thread is inside a collective")
        try:
            check.Wait()
            if v.tobytes() != expected:
                raise AssertionError("the ranks' calls differ")
            request.Wait()
        finally:
            leave()
        return b

    return {"allreduce": lambda: floor_allreduce(x, op="sum"), "broadcast": lambda: floor_broadcast(x, root=0),
            "async": lambda: floor_async(x, op="sum")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8B..64MiB",
                    help="LO..HI (sizes HI, HI/factor, ... and LO) or a comma list (default 8B..64MiB)")
    ap.add_argument("--factor", type=int, default=4, help="step between sizes for LO..HI (default 4)")
    ap.add_argument("--iters", type=int, default=None,
                    help="calls per side per size (default: scaled by size, under 90 s in all at 2 ranks)")
    ap.add_argument("--ops", default="allreduce,broadcast,mean",
                    help="rows to run, comma-separated from " + ", ".join(ROWS))
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every measurement this many times in a row in the one job and print each run's "
                         "ratio and their spread (max/min): a figure that jumps between runs is a finding")
    ap.add_argument("--json", metavar="PATH", help="also write the results (rank 0) as JSON here")
    ap.add_argument("--array", choices=("numpy", "torch"), default="numpy",
                    help="what ours is handed: NumPy arrays, or CPU torch tensors (raw mpi4py then gets "
                         "the tensor's .numpy() view, made in the same call, as a user would write it)")
    args = ap.parse_args()
    if args.factor < 2:
        ap.error("--factor must be at least 2")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    sizes = parse_sizes(args.sizes, args.factor)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for o in ops:
        if o not in ROWS:
            ap.error(f"--ops: unknown {o!r}; expected one of {', '.join(ROWS)}")

    ours_comm = collectives.init()  # first, so that *we* choose MPI's thread level, as in an application
    if ours_comm.backend != "mpi":
        print("this benchmark needs the MPI backend: run it under mpiexec with mpi4py installed",
              file=sys.stderr)
        return 2
    from mpi4py import MPI  # already initialised by collectives.init()
    import mpi4py

    raw = MPI.COMM_WORLD.Dup()  # the peer's own communicator, as ours has its own duplicate
    rank, size = raw.Get_rank(), raw.Get_size()
    levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
              MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    header = {
        "ranks": size,
        "nodes_local_size": ours_comm.local_size,
        "mpi_library": " ".join(MPI.Get_library_version().split("\n")[0].replace("Version:", "").split()),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi4py": mpi4py.__version__,
        "thread_level": levels.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "collectives": collectives.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {_cpu_count()} cores",
        "dtype": "float32",
        "array": args.array,
        "load_average": os.getloadavg()[0],
    }

    def sides_for(op: str, x: np.ndarray):
        if args.array == "torch":
            return torch_sides_for(op, torch.from_numpy(x))
        if op == "allreduce":
            return (lambda: collectives.allreduce(x, op="sum"),
                    lambda: raw.Allreduce(MPI.IN_PLACE, x, MPI.SUM))
        if op == "broadcast":
            return (lambda: collectives.broadcast(x, root=0),
                    lambda: raw.Bcast(x, root=0))
        if op == "rscatter":  # both sides allocate their result, as a caller of either would
            return (lambda: collectives.reduce_scatter(x, op="sum"),
                    lambda: raw.Reduce_scatter_block(x, np.empty(x.size // size, x.dtype), MPI.SUM))
        if op == "alltoall":
            return (lambda: collectives.alltoall(x), lambda: raw.Alltoall(x, np.empty_like(x)))
        if op == "async":
            return (lambda: collectives.allreduce(x, op="sum", async_op=True).wait(),
                    lambda: raw.Iallreduce(MPI.IN_PLACE, x, MPI.SUM).Wait())
        if op == "reduce":
            return (lambda: collectives.reduce(x, op="sum", root=0),
                    lambda: raw.Reduce(MPI.IN_PLACE if rank == 0 else x, x, MPI.SUM, root=0))
        if op == "allgather":
            return (lambda: collectives.allgather(x), lambda: raw.Allgather(x, np.empty((size, x.size), x.dtype)))

        def raw_mean():
            raw.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
            np.divide(x, size, out=x)

        return (lambda: collectives.allreduce(x, op="mean"), raw_mean)

    def torch_sides_for(op: str, t):
        if op == "allreduce":
            return (lambda: collectives.allreduce(t, op="sum"),
                    lambda: raw.Allreduce(MPI.IN_PLACE, t.numpy(), MPI.SUM))
        if op == "broadcast":
            return (lambda: collectives.broadcast(t, root=0),
                    lambda: raw.Bcast(t.numpy(), root=0))

        if op == "async":
            return (lambda: collectives.allreduce(t, op="sum", async_op=True).wait(),
                    lambda: raw.Iallreduce(MPI.IN_PLACE, t.numpy(), MPI.SUM).Wait())
        if op == "reduce":
            def raw_reduce():
                v = t.numpy()
                raw.Reduce(MPI.IN_PLACE if rank == 0 else v, v, MPI.SUM, root=0)

            return (lambda: collectives.reduce(t, op="sum", root=0), raw_reduce)
        if op in ("rscatter", "alltoall", "allgather"):  # raw's result made a tensor too, as ours is
            shape = {"rscatter": (t.numel() // size,), "alltoall": tuple(t.shape), "allgather": (size, t.numel())}[op]
            move = {"rscatter": lambda v, out: raw.Reduce_scatter_block(v, out, MPI.SUM), "alltoall": raw.Alltoall,
                    "allgather": raw.Allgather}[op]
            ours = {"rscatter": lambda: collectives.reduce_scatter(t, op="sum"),
                    "alltoall": lambda: collectives.alltoall(t), "allgather": lambda: collectives.allgather(t)}[op]

            def raw_blocks():
                out = np.empty(shape, np.float32)
                move(t.numpy(), out)
                return torch.from_numpy(out)

            return ours, raw_blocks

        def raw_mean():
            raw.Allreduce(MPI.IN_PLACE, t.numpy(), MPI.SUM)
            t.div_(size)

        return (lambda: collectives.allreduce(t, op="mean"), raw_mean)

    torch = None
    if args.array == "torch":
        import torch

    results = []
    probe = cores_probe(raw) if args.repeat > 1 else None
    probes = []
    started = time.perf_counter()
    for run, nbytes, op in [(run, nbytes, op) for run in range(args.repeat) for nbytes in sizes for op in ops]:
        if probe is not None and nbytes == sizes[0] and op == ops[0]:
            probes.append(probe())
        rounds, k = plan(nbytes, args.iters)
        # zeros for sum (stays finite however often it runs), ones for mean (a fixed point)
        count = nbytes // 4 - (nbytes // 4) % size if op in ("rscatter", "alltoall") else nbytes // 4
        if count == 0:
            continue
        x = np.ones(count, np.float32) if op == "mean" else np.zeros(count, np.float32)
        sides = sides_for(op, x)
        with_floor = (nbytes == sizes[0] and nbytes < 1 << 18 and args.array == "numpy"  # (a small size only)
                      and op in ("allreduce", "broadcast", "async"))
        if with_floor:
            sides = (*sides, floor_sides(raw, MPI, x)[op])
        times = measure(raw.Barrier, sides, rounds, k)
        # every block starts after a barrier, so the slowest rank's block time is the collective's
        raw.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
        ours, peer = np.median(times, axis=0)[:2]
        paired = float(np.median(times[:, 0] / times[:, 1]))  # ours/raw within each round
        row = {"op": op, "bytes": nbytes, "run": run, "calls_per_side": rounds * k, "rounds": rounds,
               "ours_s": float(ours), "raw_s": float(peer), "ratio": paired,
               "ratio_of_medians": float(ours / peer),
               "page_faults_per_call": [faults(side, k) for side in sides[:2]],
               "cpus": raw.allgather(current_cpu())}
        if with_floor:
            row.update(floor_s=float(np.median(times[:, 2])),
                       ours_over_floor=float(np.median(times[:, 0] / times[:, 2])),
                       floor_over_raw=float(np.median(times[:, 2] / times[:, 1])))
        results.append(row)
        del x
    elapsed = raw.allreduce(time.perf_counter() - started, op=MPI.MAX)

    if rank == 0:
        print_table(header, results, elapsed)
        if probes and probes[0] is not None:
            print("\nthe two CPUs before each run (benchmarks/c/cores.c: a cache line's round trip between them; "
                  "1 MiB written on one, read on the other):")
            for run, p in enumerate(probes):
                print(f"  run {run + 1}: round trip {p['round_trip_ns']:.0f} ns, {p['transfer_gbps']:.1f} GB/s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"header": header, "elapsed_s": elapsed, "results": results, "cores": probes,
                           "targets": {"small_bytes": sizes[0], "small_ratio": TARGET_SMALL,
                                       "large_bytes": LARGE, "large_ratio": TARGET_LARGE}}, f, indent=2)
            print(f"\nwrote {args.json}")
    raw.Free()
    return 0


def faults(side, k: int) -> float:
    """Minor page faults per call of ``side`` on this rank, over ``k`` calls after the timed ones: memory
    that a side maps anew on every call (MPICH's allreduce of a large message takes a temporary buffer of
    half its size each time; fresh pages cost a fault each, more in a virtual machine) shows here
    whatever the machine's load."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(k):
        side()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / k


def cores_probe(raw):
    """A callable (collective over ``raw``) that measures how far apart this machine's first two CPUs are,
    now, with ``benchmarks/c/cores.c`` (built here with ``cc``) on rank 0 while the other ranks sleep:
    ``{"round_trip_ns", "transfer_gbps"}`` on rank 0, None elsewhere. None (no probe) where the job has
    several nodes, fewer than two CPUs, or no C compiler. On a virtual machine the host may move the two
    virtual CPUs between cores that share a cache and cores that do not: the probe before each run says
    which (docs/performance.md, "Run to run")."""
    import shutil
    import subprocess
    import tempfile

    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "c", "cores.c")
    ok = 0
    binary = os.path.join(tempfile.gettempdir(), f"collectives-cores-{os.getpid()}")
    if raw.Get_rank() == 0 and shutil.which("cc") and len(os.sched_getaffinity(0)) >= 2:
        built = subprocess.run(["cc", "-O2", "-pthread", "-o", binary, source], capture_output=True)
        ok = int(built.returncode == 0)
        if ok:
            import atexit

            atexit.register(lambda: os.path.exists(binary) and os.remove(binary))  # (built per job)
    from mpi4py import MPI

    nodes = raw.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = nodes.Get_size() == raw.Get_size()
    nodes.Free()
    if not raw.bcast(ok and one_node, root=0):
        return None
    cpus = sorted(os.sched_getaffinity(0))[:2]

    def probe():
        raw.Barrier()
        out = None
        if raw.Get_rank() == 0:
            text = subprocess.run([binary, str(cpus[0]), str(cpus[1])], capture_output=True, text=True,
                                  timeout=60).stdout.split()
            out = {"round_trip_ns": float(text[1]), "transfer_gbps": float(text[3])}
        else:
            time.sleep(1.0)  # (not spinning in a barrier on the CPUs being measured)
        raw.Barrier()
        return out

    return probe


def current_cpu() -> int:
    """The CPU this process last ran on (Linux: /proc/self/stat's 39th field), -1 where unknown: two
    ranks on one CPU at the end of a row is a sign that they shared it during the row."""
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


def _cpu_count() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 0


def print_table(header: dict, results: list[dict], elapsed: float) -> None:
    print("collectives vs raw mpi4py, same buffers, same job, alternating rounds")
    print(f"  {header['ranks']} ranks ({header['nodes_local_size']} on this node), {header['machine']}, "
          f"Python {header['python']}, NumPy {header['numpy']}")
    print(f"  {header['mpi_library']} (MPI {header['mpi_standard']}), mpi4py {header['mpi4py']}, "
          f"MPI thread level {header['thread_level']}, collectives {header['collectives']}")
    print(f"  time per call: median over rounds of the slowest rank's time; ours/raw: median of per-round "
          f"ratios; {header.get('array', 'numpy')} arrays of dtype {header['dtype']}; "
          f"run took {elapsed:.1f} s")
    print(f"  targets: smallest size ours/raw <= {TARGET_SMALL}x; from {human(LARGE)} up <= {TARGET_LARGE}x")
    smallest = min(r["bytes"] for r in results)
    names = {"allreduce": "allreduce sum", "broadcast": "broadcast", "mean": "allreduce mean",
             "rscatter": "reduce_scatter sum", "alltoall": "alltoall", "async": "allreduce(async_op=True).wait()",
             "reduce": "reduce sum", "allgather": "allgather"}
    raw_names = {"allreduce": "Allreduce", "broadcast": "Bcast", "mean": "Allreduce+divide",
                 "rscatter": "Reduce_scatter_block", "alltoall": "Alltoall", "async": "Iallreduce().Wait()",
                 "reduce": "Reduce", "allgather": "Allgather"}
    runs = 1 + max(r.get("run", 0) for r in results)
    print(f"  load average {header.get('load_average', float('nan')):.2f} at the start; {runs} run(s) in a row; "
          f"faults: minor page faults per call, ours/raw (rank 0)")
    for op in ROWS:
        keyed: dict = {}
        for r in results:
            if r["op"] == op:
                keyed.setdefault(r["bytes"], []).append(r)
        if not keyed:
            continue
        print(f"\n{names[op]} (ours) vs {raw_names[op]} (raw mpi4py)")
        print(f"{'size':>9}  {'calls':>6}  {'ours':>11}  {'raw':>11}  {'ours/raw':>8}  {'faults':>11}  target"
              + ("   ours/raw of each run (spread: max/min)" if runs > 1 else ""))
        for nbytes, rows in keyed.items():
            ratios = [r["ratio"] for r in rows]
            worst = max(ratios)
            want = target_of(op, nbytes, smallest)
            target = "" if want is None else f"<= {want}x " + ("ok" if worst <= want else "MISSED")
            mid = sorted(rows, key=lambda r: r["ratio"])[len(rows) // 2]
            f_ours, f_raw = mid.get("page_faults_per_call", (0, 0))
            line = (f"{human(nbytes):>9}  {mid['calls_per_side']:>6}  {fmt_time(mid['ours_s'])}  "
                    f"{fmt_time(mid['raw_s'])}  {mid['ratio']:>7.2f}x  {f_ours:>5.0f}/{f_raw:<5.0f}  {target:<13}")
            if runs > 1:
                line += "  " + " ".join(f"{v:.2f}" for v in ratios) + f"  ({max(ratios) / min(ratios):.2f})"
                fastest = min(r["raw_s"] for r in rows)  # the machine's speed in each run: raw's own time
                line += "; raw's time of each run / its fastest: " + " ".join(f"{r['raw_s'] / fastest:.1f}"
                                                                             for r in rows)
                shared = [r["run"] for r in rows if len(set(r.get("cpus", []))) < len(r.get("cpus", []))]
                if shared:
                    line += f"; ranks on one CPU after run(s) {', '.join(str(v + 1) for v in shared)}"
            print(line)
            floors = [r for r in rows if "floor_s" in r]
            if floors:
                fo = [r["floor_over_raw"] for r in floors]
                of = [r["ours_over_floor"] for r in floors]
                print(f"{'':>9}  {'floor':>6}  {fmt_time(floors[len(floors) // 2]['floor_s'])}  {'':>11}  "
                      f"{sorted(fo)[len(fo) // 2]:>7.2f}x  floor/raw: the contract's least (runs "
                      + " ".join(f"{v:.2f}" for v in fo) + "); ours/floor " + " ".join(f"{v:.2f}" for v in of))


def target_of(op: str, nbytes: int, smallest: int) -> float | None:
    """The target ratio ours/raw of a row (None: none)."""
    if op == "allreduce" and nbytes == smallest:
        return TARGET_SMALL
    if op == "mean" and nbytes in TARGET_MEAN:
        return TARGET_MEAN[nbytes]
    if nbytes >= LARGE and op != "mean" and op not in GENERAL:
        return TARGET_LARGE
    return None

if __name__ == "__main__":
    sys.exit(main())

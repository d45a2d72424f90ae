"""collectives against its peers on the same buffers, in the same job: raw mpi4py, a C MPI loop, gloo.

    python benchmarks/bench_peers.py --run -n 2             # everything below, then a summary and a JSON file
    mpiexec -n 2 python benchmarks/bench_peers.py           # one job: the in-process peers only
    mpiexec -n 2 python benchmarks/bench_peers.py --mpi-first --sizes 8B --peers collectives,mpi4py

Peers, on one float32 NumPy buffer per size (torch tensors sharing its memory for gloo):

==============  ===================================================================================
``collectives`` ``collectives.allreduce(x, op="sum"|"mean")``, ``collectives.broadcast(x, root=0)``
``mpi4py``      ``comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)`` (+ ``np.divide(x, n, out=x)`` for mean),
                ``comm.Bcast(x, root=0)``, on a duplicate of ``COMM_WORLD``
``c``           the same MPI calls in a C loop (``benchmarks/c/allreduce.c`` built as a shared library
                with the venv's ``mpicc`` and loaded with ctypes into this job); skipped with a note
                when it is not built (``--run`` builds it)
``gloo``        ``torch.distributed`` with the gloo backend (``all_reduce`` SUM, then ``div_`` for
                mean; ``broadcast``), rendezvous on 127.0.0.1 at a free port chosen by rank 0
==============  ===================================================================================

Every peer runs in *every* round, in an order that rotates from round to round; a round times, on every
rank after a barrier, a block of ``k`` back-to-back calls of one peer; a round's time per call is the
slowest rank's block time / ``k``. Reported: the median over rounds, and for each peer the median over
rounds of its time / mpi4py's time in the *same round*, so that the machine's changing speed (other
jobs, frequency) cancels out of the ratio. Only ratios mean something on a shared machine. ``k`` follows
the size (about 160 MiB per peer per size, 31 to 20000 calls in at most 61 rounds), except that a peer
whose calls are slow (gloo at small sizes) makes only about 20 ms of calls per round.

``--run`` (not under mpiexec) is the driver: it builds the C program and library when ``mpicc`` is in the
venv (or on PATH), runs the job above, runs the C program as a separate job (its figures are another
job's: compare them with care), and, with ``--thread-levels R``, alternates R times a job where mpi4py
is imported before collectives (MPI at mpi4py's default thread level, ``multiple``) with one at our
default (``serialized``), for the 8 B figures. It prints a summary and writes everything as JSON
(``--out``, default ``benchmarks/results/peers.json``) for ``benchmarks/plot.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import fmt_time, human, parse_sizes, plan

HERE = Path(__file__).resolve().parent
C_DIR = HERE / "c"
C_BUILD = C_DIR / "build"
PEERS = ("collectives", "mpi4py", "c", "gloo")
OPS = ("allreduce", "mean", "broadcast")
TARGET_LARGE = 0.67  # ours / mpi4py, allreduce sum and mean, 1 MiB .. 64 MiB
TARGET_SMALL = 1.5  # ours / mpi4py at 8 B, same thread level
ROUND_S = 0.02  # a peer whose single call is slow makes fewer calls per round: about this many seconds

def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 0


# ---------------------------------------------------------------------------------------------------------
# the job: every peer on the same buffers, rounds in rotating order

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_c_library():
    path = C_BUILD / "libbench.so"
    if not path.exists():
        return None, f"{path.relative_to(HERE.parent)} not built (run with --run, or build it: see {C_DIR.name}/allreduce.c)"
    lib = ctypes.CDLL(str(path))
    lib.bench_block.restype = ctypes.c_double
    lib.bench_block.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib, None


def job(args) -> int:
    if args.mpi_first:
        from mpi4py import MPI  # MPI starts at mpi4py's default thread level (multiple), as in most apps

        import collectives
    else:
        import collectives

        collectives.init()  # first: our default thread level (serialized)
        from mpi4py import MPI
    import mpi4py

    ours = collectives.init()
    raw = MPI.COMM_WORLD.Dup()
    rank, size = raw.Get_rank(), raw.Get_size()
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    notes = []
    lib = None
    if "c" in peers:
        lib, note = load_c_library()
        if lib is None:
            peers.remove("c")
            notes.append(f"c: skipped, {note}")
    dist = torch = None
    if "gloo" in peers:
        try:
            import torch
            import torch.distributed as dist
        except ImportError as exc:
            peers.remove("gloo")
            notes.append(f"gloo: skipped, torch is not importable ({exc})")
    if dist is not None:
        port = raw.bcast(free_port() if rank == 0 else None, root=0)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=size)
    if "mpi4py" not in peers:
        peers.insert(0, "mpi4py")  # the reference of every ratio
    levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
              MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    header = {
        "ranks": size, "local_size": ours.local_size,
        "machine": f"{_cpu()}, {_cores()} cores, {platform.system()} {platform.release()}",
        "load_average_at_start": [round(v, 2) for v in os.getloadavg()],
        "python": platform.python_version(), "numpy": np.__version__, "mpi4py": mpi4py.__version__,
        "mpi_library": " ".join(MPI.Get_library_version().split("\n")[0].split()),
        "thread_level": levels.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "mpi4py_imported_first": bool(args.mpi_first), "collectives": collectives.__version__,
        "torch": getattr(torch, "__version__", None), "peers": peers, "notes": notes,
        "shm_threshold": getattr(ours._host, "_shm_threshold", None),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }

    def blocks(op: str, x: np.ndarray) -> list:
        """For each peer, a function running ``k`` calls."""
        out = []
        n = float(size)
        for p in peers:
            if p == "collectives":
                if op == "broadcast":
                    def f(k, x=x):
                        for _ in range(k):
                            collectives.broadcast(x, root=0)
                else:
                    o = "mean" if op == "mean" else "sum"

                    def f(k, x=x, o=o):
                        for _ in range(k):
                            collectives.allreduce(x, op=o)
            elif p == "mpi4py":
                if op == "broadcast":
                    def f(k, x=x):
                        for _ in range(k):
                            raw.Bcast(x, root=0)
                elif op == "mean":
                    def f(k, x=x):
                        for _ in range(k):
                            raw.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
                            np.divide(x, n, out=x)
                else:
                    def f(k, x=x):
                        for _ in range(k):
                            raw.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
            elif p == "c":
                code = OPS.index(op)

                def f(k, x=x, code=code):
                    lib.bench_block(code, x.ctypes.data, x.size, k)
            else:  # gloo
                t = torch.from_numpy(x)
                if op == "broadcast":
                    def f(k, t=t):
                        for _ in range(k):
                            dist.broadcast(t, src=0)
                else:
                    mean = op == "mean"

                    def f(k, t=t, mean=mean):
                        for _ in range(k):
                            dist.all_reduce(t, op=dist.ReduceOp.SUM)
                            if mean:
                                t.div_(n)
            out.append(f)
        return out

    sizes = parse_sizes(args.sizes, args.factor)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    results = []
    started = time.perf_counter()
    perf = time.perf_counter
    for nbytes in sizes:
        rounds, k = plan(nbytes, args.iters)
        for op in ops:
            x = (np.zeros if op == "allreduce" else np.ones)(nbytes // 4, np.float32)  # stays finite
            fs = blocks(op, x)
            # warm-up (first calls allocate, fault pages in, make windows), and a first timing that caps
            # a slow peer's block (gloo at small sizes) at about ROUND_S; agreed, as every rank must
            # make the same number of calls
            first = np.empty(len(fs))
            w = max(2, min(k, 50))
            for i, f in enumerate(fs):
                f(w)
                blocks_s = []
                for _ in range(5):  # the median of 5 short blocks: one hiccup must not decide
                    raw.Barrier()
                    t0 = perf()
                    f(max(1, w // 5))
                    blocks_s.append((perf() - t0) / max(1, w // 5))
                first[i] = np.median(blocks_s)
            raw.Allreduce(MPI.IN_PLACE, first, MPI.MAX)
            ks = [int(max(1, min(k, ROUND_S // max(t, 1e-9)))) for t in first]
            times = np.empty((rounds, len(fs)))
            for r in range(rounds):
                for j in range(len(fs)):
                    i = (j + r) % len(fs)
                    raw.Barrier()
                    t0 = perf()
                    fs[i](ks[i])
                    times[r, i] = (perf() - t0) / ks[i]
            raw.Allreduce(MPI.IN_PLACE, times, MPI.MAX)  # the slowest rank ends the collective
            ref = peers.index("mpi4py")
            row = {"op": op, "bytes": nbytes, "calls": rounds * k, "rounds": rounds, "peers": {}}
            for i, p in enumerate(peers):
                row["peers"][p] = {"median_s": float(np.median(times[:, i])),
                                   "ratio": float(np.median(times[:, i] / times[:, ref])),
                                   "calls": rounds * ks[i], "rounds_s": times[:, i].tolist()}
            results.append(row)
            if rank == 0 and not args.quiet:
                print(f"  {op:>9} {human(nbytes):>8}: " + "  ".join(
                    f"{p} {fmt_time(row['peers'][p]['median_s']).strip()}"
                    + ("" if p == "mpi4py" else f" ({row['peers'][p]['ratio']:.2f}x)") for p in peers),
                    file=sys.stderr, flush=True)
            del x, fs
    elapsed = raw.allreduce(time.perf_counter() - started, op=MPI.MAX)
    if rank == 0:
        doc = {"header": header, "elapsed_s": elapsed, "results": results}
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=1))
        else:
            print_job(doc)
    if dist is not None:
        dist.destroy_process_group()
    raw.Free()
    return 0


def print_job(doc: dict) -> None:
    h = doc["header"]
    print(f"{h['ranks']} ranks ({h['local_size']} on this node), {h['machine']}, load {h['load_average_at_start']}")
    print(f"{h['mpi_library']}, mpi4py {h['mpi4py']} (thread level {h['thread_level']}), numpy {h['numpy']}, "
          f"torch {h['torch']}, collectives {h['collectives']} (shm threshold {h['shm_threshold']} B)")
    for note in h["notes"]:
        print(f"note: {note}")
    print("time: median over rounds of the slowest rank; (x): median over rounds of time / mpi4py's "
          "time in the same round")
    peers = h["peers"]
    for op in OPS:
        rows = [r for r in doc["results"] if r["op"] == op]
        if not rows:
            continue
        print(f"\n{op}")
        print(f"{'size':>9}  {'calls':>6}  " + "  ".join(f"{p:>20}" for p in peers) + "  target")
        for r in rows:
            cells = []
            for p in peers:
                e = r["peers"][p]
                ratio = "" if p == "mpi4py" else f" {e['ratio']:5.2f}x"
                cells.append(f"{fmt_time(e['median_s']).strip() + ratio:>20}")
            ours = r["peers"].get("collectives")
            target = ""
            if ours is not None and op in ("allreduce", "mean") and 2**20 <= r["bytes"] <= 64 * 2**20:
                target = f"<= {TARGET_LARGE}x " + ("ok" if ours["ratio"] <= TARGET_LARGE else "MISSED")
            elif ours is not None and r["bytes"] <= 8:
                target = f"<= {TARGET_SMALL}x " + ("ok" if ours["ratio"] <= TARGET_SMALL else "MISSED")
            elif ours is not None:
                target = "<= 1x " + ("ok" if ours["ratio"] <= 1.0 else "over")
            print(f"{human(r['bytes']):>9}  {r['calls']:>6}  " + "  ".join(cells) + f"  {target}")


# ---------------------------------------------------------------------------------------------------------
# the driver

def tool(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def build_c() -> tuple[Path | None, str | None]:
    """Build the C program and library with the venv's mpicc; (program, None) or (None, why not)."""
    mpicc = tool("mpicc")
    if mpicc is None:
        return None, "no mpicc in the venv or on PATH: the C peer is skipped"
    C_BUILD.mkdir(parents=True, exist_ok=True)
    src = C_DIR / "allreduce.c"
    prog, lib = C_BUILD / "allreduce", C_BUILD / "libbench.so"
    for cmd in ([mpicc, "-O3", "-o", str(prog), str(src)],
                [mpicc, "-O3", "-shared", "-fPIC", "-DBENCH_LIBRARY", "-o", str(lib), str(src)]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return None, f"{' '.join(cmd)} failed: {proc.stderr.strip()[:400]}"
    return prog, None


def run_job(n: int, extra: list[str], timeout: int) -> dict:
    mpiexec = tool("mpiexec") or "mpiexec"
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "job.json"
        cmd = [mpiexec, "-n", str(n), sys.executable, str(Path(__file__).resolve()), "--json", str(out),
               *extra]
        print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"job failed (exit {proc.returncode}): {' '.join(cmd)}")
        return json.loads(out.read_text())


def run_c_program(prog: Path, n: int, sizes: list[int], timeout: int) -> list[dict]:
    mpiexec = tool("mpiexec") or "mpiexec"
    cmd = [mpiexec, "-n", str(n), str(prog), *map(str, sizes)]
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"C program failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for r in rows:
        if "rounds" in r:
            r["median_s"] = float(np.median(r["rounds"]))
    return rows


def driver(args) -> int:
    prog, note = build_c()
    doc: dict = {"notes": [] if note is None else [note]}
    if note:
        print(f"note: {note}", file=sys.stderr)
    peers = args.peers if prog is not None else ",".join(p for p in args.peers.split(",") if p != "c")
    common = ["--sizes", args.sizes, "--factor", str(args.factor), "--ops", args.ops, "--peers", peers]
    if args.iters:
        common += ["--iters", str(args.iters)]
    doc["job"] = run_job(args.n, common, args.timeout)
    if prog is not None:
        doc["c_program"] = run_c_program(prog, args.n, parse_sizes(args.sizes, args.factor), args.timeout)
    if args.thread_levels:
        small = ["--sizes", "8B", "--ops", "allreduce,broadcast", "--peers", "collectives,mpi4py", "--quiet"]
        doc["thread_levels"] = []
        for _ in range(args.thread_levels):  # alternate, so that drifts of the machine hit both alike
            doc["thread_levels"].append({"serialized": run_job(args.n, small, args.timeout),
                                         "mpi4py_first": run_job(args.n, small + ["--mpi-first"],
                                                                 args.timeout)})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    show(doc)
    print(f"\nwrote {out}")
    return 0


def show(doc: dict) -> None:
    """Print a driver's results (also from a saved file: ``--show PATH``)."""
    for note in doc.get("notes", []):
        print(f"note: {note}")
    print_job(doc["job"])
    if "c_program" in doc:
        print_c_program(doc)
    if "thread_levels" in doc:
        print_thread_levels(doc["thread_levels"])


def print_c_program(doc: dict) -> None:
    """The C program's own job, next to mpi4py's times from the main job (two jobs: only indicative)."""
    ref = {(r["op"], r["bytes"]): r["peers"]["mpi4py"]["median_s"] for r in doc["job"]["results"]}
    print("\nC program, separate job (MPI_Init_thread serialized): median time, and / mpi4py of the main job")
    for r in doc["c_program"]:
        if "rounds" not in r:
            continue
        m = ref.get((r["op"], r["bytes"]))
        ratio = f"{r['median_s'] / m:5.2f}x" if m else ""
        print(f"  {r['op']:>9} {human(r['bytes']):>8}: {fmt_time(r['median_s']).strip():>11}  {ratio}")


def show_many(docs: list[dict]) -> None:
    """Several driver runs: per op and size, the median over runs of each peer's ratio to mpi4py."""
    jobs = [d["job"] for d in docs]
    peers = [p for p in jobs[0]["header"]["peers"] if p != "mpi4py"]
    loads = ", ".join(str(j["header"]["load_average_at_start"][0]) for j in jobs)
    print(f"{len(jobs)} runs ({jobs[0]['header']['ranks']} ranks; load average at start: {loads}); "
          f"median over runs of each run's ratio (time / mpi4py's time, same rounds), [min..max] over runs")
    for op in OPS:
        keys = sorted({r["bytes"] for r in jobs[0]["results"] if r["op"] == op})
        if not keys:
            continue
        print(f"\n{op}")
        print(f"{'size':>9}  " + "  ".join(f"{p:>24}" for p in peers))
        for b in keys:
            cells = []
            for p in peers:
                v = [r["peers"][p]["ratio"] for j in jobs for r in j["results"]
                     if r["op"] == op and r["bytes"] == b and p in r["peers"]]
                cells.append(f"{np.median(v):6.2f}x [{min(v):.2f}..{max(v):.2f}]" if v else "-")
            print(f"{human(b):>9}  " + "  ".join(f"{c:>24}" for c in cells))
    runs = [t for d in docs for t in d.get("thread_levels", [])]
    if runs:
        print_thread_levels(runs)


def summarise_thread_levels(runs: list[dict]) -> dict:
    out = {}
    for op in ("allreduce", "broadcast"):
        def med(job, peer, op=op):
            return next(r["peers"][peer]["median_s"] for r in job["results"] if r["op"] == op)

        ours_s = [med(r["serialized"], "collectives") for r in runs]
        raw_s = [med(r["serialized"], "mpi4py") for r in runs]
        ours_m = [med(r["mpi4py_first"], "collectives") for r in runs]
        raw_m = [med(r["mpi4py_first"], "mpi4py") for r in runs]
        same_s = [next(r["peers"]["collectives"]["ratio"] for r in x["serialized"]["results"] if r["op"] == op)
                  for x in runs]
        same_m = [next(r["peers"]["collectives"]["ratio"] for r in x["mpi4py_first"]["results"]
                       if r["op"] == op) for x in runs]
        out[op] = {
            "ours_serialized_s": float(np.median(ours_s)), "raw_serialized_s": float(np.median(raw_s)),
            "ours_multiple_s": float(np.median(ours_m)), "raw_multiple_s": float(np.median(raw_m)),
            "ours_over_raw_same_level_serialized": float(np.median(same_s)),
            "ours_over_raw_same_level_multiple": float(np.median(same_m)),
            "ours_serialized_over_raw_default": float(np.median(np.array(ours_s) / np.array(raw_m))),
            "jobs": len(runs),
        }
    return out


def print_thread_levels(runs: list[dict]) -> None:
    s = summarise_thread_levels(runs)
    print(f"\n8 B, {len(runs)} pairs of jobs (ours at our default 'serialized'; raw mpi4py at its default "
          f"'multiple' when it is imported first); medians over jobs")
    for op, v in s.items():
        print(f"  {op:>9}: ours {fmt_time(v['ours_serialized_s']).strip()}, raw at multiple "
              f"{fmt_time(v['raw_multiple_s']).strip()} -> {v['ours_serialized_over_raw_default']:.2f}x "
              f"(target < 1; across jobs); same job, same level: {v['ours_over_raw_same_level_serialized']:.2f}x "
              f"serialized, {v['ours_over_raw_same_level_multiple']:.2f}x multiple (target <= {TARGET_SMALL}x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8B..64MiB", help="LO..HI (HI, HI/factor, ..., LO) or a comma list")
    ap.add_argument("--factor", type=int, default=4, help="step between sizes of LO..HI (default 4)")
    ap.add_argument("--ops", default="allreduce,mean,broadcast", help="from allreduce, mean, broadcast")
    ap.add_argument("--peers", default="collectives,mpi4py,c,gloo", help=f"from {', '.join(PEERS)}")
    ap.add_argument("--iters", type=int, default=None, help="calls per peer per size (default: by size)")
    ap.add_argument("--mpi-first", action="store_true",
                    help="import mpi4py before collectives (MPI at mpi4py's default thread level)")
    ap.add_argument("--json", metavar="PATH", help="job: write the results (rank 0) as JSON here")
    ap.add_argument("--quiet", action="store_true", help="job: no per-size lines on stderr")
    ap.add_argument("--run", action="store_true", help="driver: build, run the jobs, summarise (no mpiexec)")
    ap.add_argument("-n", type=int, default=2, help="driver: ranks (default 2)")
    ap.add_argument("--thread-levels", type=int, default=0, metavar="R",
                    help="driver: R pairs of 8 B jobs at mpi4py's default thread level and at ours")
    ap.add_argument("--timeout", type=int, default=1800, help="driver: seconds per job")
    ap.add_argument("--out", default=str(HERE / "results" / "peers.json"), help="driver: JSON output")
    ap.add_argument("--show", metavar="PATH", nargs="+",
                    help="print the summary of a driver's JSON file and exit; of several: the median over "
                         "files of each ratio")
    args = ap.parse_args()
    if args.show:
        docs = [json.loads(Path(p).read_text()) for p in args.show]
        show(docs[0]) if len(docs) == 1 else show_many(docs)
        return 0
    for p in args.peers.split(","):
        if p.strip() and p.strip() not in PEERS:
            ap.error(f"--peers: unknown {p!r}; expected from {', '.join(PEERS)}")
    for o in args.ops.split(","):
        if o.strip() and o.strip() not in OPS:
            ap.error(f"--ops: unknown {o!r}; expected from {', '.join(OPS)}")
    return driver(args) if args.run else job(args)


if __name__ == "__main__":
    sys.exit(main())

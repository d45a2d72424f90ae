"""Plots of benchmark results: latency and bandwidth against size, one line per implementation.

    python benchmarks/plot.py                                    # benchmarks/results/peers.json -> docs/img/
    python benchmarks/plot.py run1.json run2.json run3.json     # several runs: medians, with spreads
    python benchmarks/plot.py results.json --out docs/img --prefix quiet-
    mpiexec -n 2 python -m collectives bench -c allreduce,broadcast --json > bench.json
    python benchmarks/plot.py bench.json                         # the bench tool's output works too

Input: the JSON of ``benchmarks/bench_peers.py --run`` (or of one ``bench_peers.py`` job), or of
``python -m collectives bench --json``. Output, into ``--out`` (default ``docs/img/``):

* ``<prefix>peers-<op>.png`` for each op: time per call (left) and bus bandwidth (right, nccl-tests
  definition: allreduce ``2(n-1)/n * bytes / time``, broadcast ``bytes / time``), log-log, one line per
  peer (the C program's separate job dashed);
* ``<prefix>peers-ratio.png``: each peer's time / raw mpi4py's time in the same rounds, with the targets
  (of several runs: the median of the runs' ratios, the smallest and largest as error bars);
* ``<prefix>bench.png`` for bench-tool input: time and busbw per (collective, op).

Each figure notes the machine, the number of ranks, the library versions and the date of the run.
Needs matplotlib (``pip install matplotlib``; it is in the ``docs`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
STYLE = {"collectives": ("C0", "o", "-"), "mpi4py": ("C1", "s", "-"), "c": ("C2", "^", "-"),
         "gloo": ("C3", "v", "-"), "c (own job)": ("C2", "", "--")}
LABEL = {"collectives": "collectives", "mpi4py": "raw mpi4py", "c": "C MPI loop (same job)",
         "gloo": "torch.distributed gloo", "c (own job)": "C MPI program (own job)"}


def _matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot.py needs matplotlib: pip install matplotlib (or the 'docs' extra)") from None
    return plt


def size_label(nbytes: float, _pos=None) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}"


def bus_factor(op: str, n: int) -> float:
    if op in ("allreduce", "mean", "allreduce_tree"):
        return 2 * (n - 1) / n if n > 1 else 0.0
    if op == "allgather":
        return (n - 1) / n
    return 1.0


def caption(h: dict) -> str:
    parts = [f"{h.get('ranks')} ranks ({h.get('local_size')} per node)", h.get("machine", "")]
    if h.get("mpi_library"):
        parts.append(f"{h['mpi_library']}, mpi4py {h.get('mpi4py')}, thread level {h.get('thread_level')}")
    versions = [f"collectives {h.get('collectives')}", f"NumPy {h.get('numpy')}"]
    if h.get("torch"):
        versions.append(f"torch {h['torch']}")
    parts.append(", ".join(versions))
    if h.get("date"):
        load = h.get("load_average_at_start")
        parts.append(f"{h['date']}" + (f", load average {load[0]} at start" if load else ""))
    return "\n".join(p for p in parts if p)


def _axes(plt, title: str):
    from matplotlib.ticker import FuncFormatter

    fig, (a_t, a_bw) = plt.subplots(1, 2, figsize=(12, 5.2))
    for ax in (a_t, a_bw):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(size_label))
        ax.set_xlabel("message size per rank (bytes)")
        ax.grid(True, which="major", alpha=0.3)
    a_t.set_ylabel("time per call (s), median")
    a_bw.set_ylabel("bus bandwidth (GB/s)")
    fig.suptitle(title)
    return fig, a_t, a_bw


def _save(plt, fig, h: dict, path: Path, rect=(0, 0.1, 1, 0.95)) -> Path:
    """Caption the figure with the machine and versions, lay it out, write it, free it."""
    fig.text(0.01, 0.01, caption(h), fontsize=7, va="bottom", ha="left", color="0.3")
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_peers(docs: list[dict], out: Path, prefix: str) -> list[Path]:
    """Several runs: times are the median over runs of each run's median; ratios the median over runs of
    each run's ratio, with the smallest and largest as error bars."""
    plt = _matplotlib()
    from matplotlib.ticker import FuncFormatter

    jobs = [d.get("job", d) for d in docs]
    h = dict(jobs[0]["header"])
    if len(jobs) > 1:
        h["date"] = f"{len(jobs)} runs, {jobs[0]['header']['date']} to {jobs[-1]['header']['date']}"
        h["load_average_at_start"] = None
    n = h["ranks"]
    written = []
    ops = [op for op in ("allreduce", "mean", "broadcast") if any(r["op"] == op for r in jobs[0]["results"])]
    names = {"allreduce": "allreduce (sum)", "mean": "allreduce (mean)", "broadcast": "broadcast"}

    def collect(op, peer, key):
        """{bytes: [value per run]} for one op and peer."""
        out: dict = {}
        for j in jobs:
            for r in j["results"]:
                if r["op"] == op and peer in r["peers"]:
                    out.setdefault(r["bytes"], []).append(r["peers"][peer][key])
        return dict(sorted(out.items()))

    runs_note = f" (median of {len(jobs)} runs)" if len(jobs) > 1 else ""
    for op in ops:
        fig, a_t, a_bw = _axes(plt, f"{names[op]}, float32, {n} ranks{runs_note}")
        series = {p: [(b, float(np.median(v))) for b, v in collect(op, p, "median_s").items()] for p in h["peers"]}
        own: dict = {}
        for d in docs:
            for r in d.get("c_program", []):
                if r.get("op") == op and "median_s" in r:
                    own.setdefault(r["bytes"], []).append(r["median_s"])
        if own:
            series["c (own job)"] = [(b, float(np.median(v))) for b, v in sorted(own.items())]
        for p, pts in series.items():
            color, marker, line = STYLE.get(p, ("C7", ".", "-"))
            xs, ts = [b for b, _ in pts], [t for _, t in pts]
            a_t.plot(xs, ts, color=color, marker=marker, linestyle=line, label=LABEL.get(p, p), ms=4)
            bw = [b / t / 1e9 * bus_factor(op, n) for b, t in pts]
            if any(v > 0 for v in bw):
                a_bw.plot(xs, bw, color=color, marker=marker, linestyle=line, label=LABEL.get(p, p), ms=4)
        a_t.legend(fontsize=8)
        written.append(_save(plt, fig, h, out / f"{prefix}peers-{op}.png"))
    # ratios to raw mpi4py, measured within rounds
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4.6), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for p in h["peers"]:
            if p == "mpi4py":
                continue
            color, marker, line = STYLE.get(p, ("C7", ".", "-"))
            per = collect(op, p, "ratio")
            xs = list(per)
            med = np.array([np.median(v) for v in per.values()])
            lo = med - np.array([min(v) for v in per.values()])
            hi = np.array([max(v) for v in per.values()]) - med
            ax.errorbar(xs, med, yerr=[lo, hi] if len(jobs) > 1 else None, color=color, marker=marker,
                        linestyle=line, label=LABEL.get(p, p), ms=4, capsize=2, lw=1.2)
        ax.axhline(1.0, color="k", lw=0.8)
        if op in ("allreduce", "mean"):
            ax.axhline(0.67, color="k", lw=0.8, ls=":", label="target from 1 MiB: 0.67")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(size_label))
        ax.set_title(names[op])
        ax.set_xlabel("message size per rank (bytes)")
        ax.set_ylabel("time / raw mpi4py time (same rounds)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if len(jobs) > 1:
        fig.suptitle(f"median over {len(jobs)} runs of each run's ratio; bars: smallest and largest", fontsize=9)
    written.append(_save(plt, fig, h, out / f"{prefix}peers-ratio.png", rect=(0, 0.12, 1, 0.96)))
    return written


def plot_bench(doc: dict, out: Path, prefix: str) -> list[Path]:
    plt = _matplotlib()
    h = doc["header"]
    fig, a_t, a_bw = _axes(plt, f"python -m collectives bench, {h.get('dtype')}, {h.get('ranks')} ranks, "
                                f"{h.get('array_library')}")
    keys = sorted({(r["collective"], r["op"]) for r in doc["results"]}, key=str)
    for i, (c, op) in enumerate(keys):
        rows = sorted((r for r in doc["results"] if (r["collective"], r["op"]) == (c, op)),
                      key=lambda r: r["bytes"])
        label = c + (f" {op}" if op else "")
        xs = [r["bytes"] for r in rows]
        a_t.plot(xs, [r["time_us"] * 1e-6 for r in rows], marker="o", ms=3, color=f"C{i % 10}", label=label)
        if any(r["busbw_GBps"] > 0 for r in rows):
            a_bw.plot(xs, [r["busbw_GBps"] for r in rows], marker="o", ms=3, color=f"C{i % 10}", label=label)
    a_t.legend(fontsize=8)
    return [_save(plt, fig, h, out / f"{prefix}bench.png")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", default=[str(ROOT / "benchmarks" / "results" / "peers.json")],
                    help="JSON files: several runs of bench_peers.py are combined (medians)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"), help="folder for the PNG files")
    ap.add_argument("--prefix", default="", help="prefix of the file names")
    args = ap.parse_args(argv)
    docs = [json.loads(Path(p).read_text()) for p in args.inputs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    is_bench = bool(docs[0].get("results")) and "collective" in docs[0]["results"][0]
    written = plot_bench(docs[0], out, args.prefix) if is_bench else plot_peers(docs, out, args.prefix)
    for p in written:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

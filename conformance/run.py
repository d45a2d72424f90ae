"""Run the conformance suite over several world sizes, backends and array libraries; write a report.

    python conformance/run.py                                  # sizes 1,2,3; every backend; every library
    python conformance/run.py --sizes 1,2,3,4 --backends mpi,mpi-nodes,self,nccl,host-staging
    python conformance/run.py --libs numpy,torch --full        # the whole matrix
    python conformance/run.py --sut myframework.collectives --report my-report.md --json my-report.json

Every (backend, world size) is one ``mpiexec -n N python -m pytest conformance`` (the ``self`` backend: one
plain ``python``, size 1 only) under a timeout. Rank 0 of each run writes every test's outcome as JSON lines
(``COLLECTIVES_CONFORMANCE_RESULTS``); this script gathers them into

- a Markdown report (default ``docs/conformance-report.md``): a table of collective x dtype against array
  library x backend, each cell ``pass`` / ``xfail`` / ``fail`` / ``n/a``, the contract tests, the expected
  failures with their reasons, and every unexpected failure;
- the same as JSON (default ``docs/conformance-report.json``): per-test outcomes at every size.

Exit status 0 only if no test failed unexpectedly and every run finished.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from conformance import _options, _xfail  # noqa: E402  (stdlib only: no array library is imported here)
from collectives._launcher import find_mpiexec, job_command  # noqa: E402  (stdlib and NumPy only)

LIB_DEVICE = {"numpy": "host", "torch": "host", "strict": "host", "jax": "host", "cupy": "cuda",
              "torch-cuda": "cuda"}
OUTCOME_ORDER = ("fail", "xfail", "pass", "skip")


def mpiexec(explicit: str | None) -> str:
    return explicit or find_mpiexec() or "mpiexec"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2,3", help="world sizes (default 1,2,3)")
    ap.add_argument("--libs", default="numpy,torch,strict,jax,cupy,torch-cuda",
                    help="array libraries; each backend runs those whose memory it serves")
    ap.add_argument("--backends", default="mpi,mpi-nodes,self,nccl,host-staging",
                    help="mpi, mpi-nodes, self, nccl, host-staging, cuda-aware-mpi (default: the first five; a "
                         "CUDA backend without a usable CUDA library here is probed once and reported n/a; "
                         "mpi-nodes: MPI with 2 ranks per simulated node, allreduce through shared memory)")
    ap.add_argument("--full", action="store_true", help="the whole matrix (COLLECTIVES_CONFORMANCE_FULL=1)")
    ap.add_argument("--seed", type=int, default=None, help="which sample of the matrix (default 0)")
    ap.add_argument("--sut", default=None, help="module under test (COLLECTIVES_CONFORMANCE_SUT)")
    ap.add_argument("--timeout", type=int, default=None, help="seconds per mpiexec run (default 900, --full 3600)")
    ap.add_argument("--test-timeout", type=int, default=240, help="seconds per test (pytest-timeout)")
    ap.add_argument("--report", default=str(ROOT / "docs" / "conformance-report.md"), help="Markdown report path")
    ap.add_argument("--json", default=str(ROOT / "docs" / "conformance-report.json"), help="JSON report path")
    ap.add_argument("--logs", default=str(ROOT / ".test-logs"), help="where each run's output goes")
    ap.add_argument("--mpiexec", default=None, help="the launcher (default: next to this Python, else PATH)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")
    return ap.parse_args(argv)


def run_one(args, backend: str, libs: list[str], size: int, results: Path, log: Path, select=()) -> dict:
    env = dict(os.environ)
    env.update({
        "COLLECTIVES_CONFORMANCE_BACKEND": backend,
        "COLLECTIVES_CONFORMANCE_LIBS": ",".join(libs),
        "COLLECTIVES_CONFORMANCE_RESULTS": str(results),
        "COLLECTIVES_CONFORMANCE_FULL": "1" if args.full else "0",
    })
    if args.seed is not None:
        env["COLLECTIVES_CONFORMANCE_SEED"] = str(args.seed)
    if args.sut:
        env["COLLECTIVES_CONFORMANCE_SUT"] = args.sut
    pytest_cmd = [sys.executable, "-m", "pytest", str(HERE), "-q", "-p", "no:cacheprovider", "--color=no",
                  "--timeout", str(args.test_timeout), *select, *args.pytest_args]
    if backend == "self":
        cmd = pytest_cmd
        for var in ("PMI_SIZE", "PMI_RANK", "PMIX_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
            env.pop(var, None)
    else:
        cmd = job_command(size, pytest_cmd, mpiexec=mpiexec(args.mpiexec))
    timeout = args.timeout or (3600 if args.full else 900)
    print(f"$ {' '.join(cmd)}   [backend {backend}, libs {','.join(libs)}, timeout {timeout}s]", flush=True)
    start = time.monotonic()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
            timed_out = False
        except subprocess.TimeoutExpired:
            rc, timed_out = 124, True
    seconds = time.monotonic() - start
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    print(f"  -> exit {rc} in {seconds:.1f}s{' (TIMEOUT)' if timed_out else ''}: {tail[0] if tail else ''}", flush=True)
    return {"backend": backend, "size": size, "libs": libs, "rc": rc, "timed_out": timed_out,
            "seconds": round(seconds, 1), "log": str(log)}


def read_results(path: Path, run: dict) -> list[dict]:
    """The run's test records; a test that started but never reported (crash, abort, timeout) is a fail."""
    records, session, end, started = [], None, None, None
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            event = r.get("event")
            if event == "session":
                session = r
            elif event == "start":
                started = r["nodeid"]
            elif event == "test":
                if r["nodeid"] == started and r["when"] in ("call", "setup"):
                    started = None
                records.append(r)
            elif event == "end":
                end = r
            elif event == "timeout":
                started = r["nodeid"]
    run["session"] = session
    run["end"] = end
    if end is None:
        why = "timed out" if run["timed_out"] else f"ended with exit status {run['rc']} before the session finished"
        run["aborted"] = why
        if started:
            records.append({"event": "test", "nodeid": started, "name": started.split("::")[-1], "outcome": "fail",
                            "when": "call", "meta": {}, "size": run["size"], "backend": run["backend"],
                            "message": f"the job {why} during this test (a crash, an abort or a hang)"})
    return records


def cell(outcomes: list[str]) -> str:
    counted = [o if o != "xpass" else "pass" for o in outcomes]
    n = len([o for o in counted if o != "skip"])
    if n == 0:
        return "n/a"
    for kind in ("fail", "xfail"):
        k = counted.count(kind)
        if k:
            return f"{kind} ({k}/{n})"
    return "pass"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def build_report(args, runs: list[dict], records: list[dict], columns: list[tuple[str, str]]) -> tuple[str, dict]:
    main_cells: dict = defaultdict(list)
    contract_cells: dict = defaultdict(list)
    for r in records:
        m = r.get("meta") or {}
        lib = m.get("lib") or "-"
        key_col = (lib, r["backend_label"])
        collective = m.get("collective") or r["nodeid"].split("::")[-1].split("[")[0]
        if m.get("dtype") and not m.get("aspect"):
            main_cells[(collective, m["dtype"])].append((key_col, r["outcome"]))
        else:
            aspect = m.get("aspect") or ("values" if m.get("dtype") else "-")
            if m.get("dtype") and m.get("aspect") == "dtype/op legality":
                main_cells[(collective, m["dtype"])].append((key_col, r["outcome"]))
                continue
            contract_cells[(collective, aspect)].append((key_col, r["outcome"]))

    def rows_of(cells, order, cols):
        rows = []
        for key in sorted(cells, key=order):
            by_col = defaultdict(list)
            for col, outcome in cells[key]:
                by_col[col].append(outcome)
            rows.append([*key, *[cell(by_col.get(c, [])) for c in cols]])
        # a column where nothing ran anywhere (library or backend not available) is left out
        keep = [i for i in range(len(cols)) if any(r[2 + i] != "n/a" for r in rows)]
        return [[*r[:2], *[r[2 + i] for i in keep]] for r in rows], [cols[i] for i in keep]

    dtype_order = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                   "bfloat16", "float32", "float64", "longdouble", "complex64", "complex128", "clongdouble"]
    coll_order = ["broadcast", "allreduce", "reduce", "allgather", "barrier"]

    def main_order(k):
        c, d = k
        return (coll_order.index(c) if c in coll_order else 99, dtype_order.index(d) if d in dtype_order else 50, d)

    def contract_order(k):
        c, a = k
        return (coll_order.index(c) if c in coll_order else 50, c, a)

    backends = list(dict.fromkeys(b for _, b in columns))
    main_rows, main_cols = rows_of(main_cells, main_order, columns)
    contract_rows, contract_cols = rows_of(contract_cells, contract_order,
                                           columns + [("-", b) for b in backends])
    main_names = [f"{lib} · {backend}" for lib, backend in main_cols]
    contract_names = [f"{'any' if lib == '-' else lib} · {backend}" for lib, backend in contract_cols]
    col_names = main_names

    failures = [r for r in records if r["outcome"] == "fail"]
    xfails = [r for r in records if r["outcome"] == "xfail"]
    reasons: dict = defaultdict(set)
    for r in xfails:
        reasons[r.get("message", "")].add((r["backend_label"], r["size"], r["nodeid"].split("::")[-1]))
    unavailable: dict = {}
    for run in runs:
        s = run.get("session") or {}
        for lib, why in (s.get("unavailable") or {}).items():
            unavailable.setdefault(f"{lib} · {run['backend']}", why)

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    versions = next((run["session"]["versions"] for run in runs if run.get("session")), {})
    cmd = "python conformance/run.py " + " ".join(a for a in sys.argv[1:])
    out = [
        "# Conformance report",
        "",
        f"Generated by `{cmd.strip()}` on {when} ({platform.machine()}, {os.cpu_count()} cores), "
        f"{'the full matrix' if args.full else 'the sampled matrix (default; `--full` runs all of it)'}, "
        f"seed {args.seed or 0}. How to read and regenerate it: [Conformance suite](conformance.md).",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) + ".",
        "",
        "A cell aggregates every test of that row and column over all world sizes, ops, layouts and roots: "
        "`pass`; `xfail (k/n)`: k of n tests are expected failures, listed with their reasons below; "
        "`fail (k/n)`: unexpected failures, listed below; `n/a`: nothing of this kind ran there (the "
        "library has no such dtype, or the library or backend is not available here; reasons below).",
        "",
        "## Runs",
        "",
        md_table(["backend", "size", "libraries", "exit", "seconds", "passed", "xfailed", "failed", "skipped"],
                 [[run["backend"], str(run["size"]), ",".join(run["libs"]),
                   ("not run" if run.get("not_run") else run.get("aborted") or str(run["rc"])), str(run["seconds"]),
                   *[str(sum(1 for r in records if r["run"] == id(run) and r["outcome"] == o))
                     for o in ("pass", "xfail", "fail", "skip")]] for run in runs]),
        "",
        "## Collectives x dtypes",
        "",
        "Values (every op, every layout, every root), the in-place rule and dtype/op legality.",
        "",
        md_table(["collective", "dtype", *main_names], main_rows) if main_rows else "No results.",
        "",
        "## Contracts",
        "",
        "Argument errors, the in-place rule's special cases, trees, optimizers and shards (`any`: tests that "
        "use NumPy or several libraries at once).",
        "",
        md_table(["function", "aspect", *contract_names], contract_rows) if contract_rows else "No results.",
        "",
        "## Expected failures",
        "",
    ]
    entries = []
    xdir = Path(os.environ.get("COLLECTIVES_CONFORMANCE_XFAIL_DIR") or HERE / "xfail")
    for path in sorted(xdir.glob("*.txt")) if xdir.is_dir() else []:
        entries += _xfail.parse(path)
    if entries:
        out.append("Each entry of `conformance/xfail/<backend>-<library>.txt`, with the results it marked:")
        out.append("")
        for e in entries:
            hits = [(b, s, n) for reason, where in reasons.items() if reason.startswith(e.where + ":")
                    for b, s, n in where]
            names = sorted({n for _, _, n in hits})
            places = sorted({f"{b} n={s}" for b, s, _ in hits})
            used = (f"{len(hits)} results ({', '.join(places)}): {', '.join(f'`{n}`' for n in names[:4])}"
                    f"{' ...' if len(names) > 4 else ''}") if hits else "matched nothing in this run"
            out.append(f"- `{e.where}` `{e.glob}`: {e.reason}. {used}.")
    else:
        out.append("None.")
    out += ["", "## Unexpected failures", ""]
    if failures:
        for r in failures:
            msg = (r.get("message") or "").strip().splitlines()
            short = next((line for line in reversed(msg) if line.strip().startswith("E ")), msg[-1] if msg else "")
            out.append(f"- `{r['nodeid']}` ({r['backend_label']}, n={r['size']}): {short.strip()[:300]}")
    else:
        out.append("None: every result is a pass or an expected failure with its reason.")
    out += ["", "## Not available here", "",
            "Columns in which nothing ran are left out of the tables above; this is why.", ""]
    if unavailable:
        out += [f"- {k}: {v}" for k, v in sorted(unavailable.items())]
    else:
        out.append("Everything requested was available.")
    skipped_backends = [run for run in runs if run.get("not_run") and not (run.get("session") or {}).get("unavailable")]
    out += [f"- backend {run['backend']}: {run['not_run']}" for run in skipped_backends]
    out.append("")

    per_test: dict = defaultdict(dict)
    for r in records:
        per_test[r["nodeid"]][f"{r['backend_label']}-n{r['size']}"] = r["outcome"]
    data = {
        "generated": when, "command": cmd.strip(), "full": args.full, "seed": args.seed or 0,
        "versions": versions,
        "runs": [{k: v for k, v in run.items() if k not in ("session", "end")} for run in runs],
        "columns": col_names,
        "collectives_x_dtypes": [dict(zip(["collective", "dtype", *main_names], row)) for row in main_rows],
        "contracts": [dict(zip(["function", "aspect", *contract_names], row)) for row in contract_rows],
        "failures": [{k: r.get(k) for k in ("nodeid", "backend_label", "size", "message")} for r in failures],
        "expected_failures": {reason: sorted(map(list, where)) for reason, where in reasons.items()},
        "unavailable": unavailable,
        "tests": per_test,
    }
    return "\n".join(out), data


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    libs = _options.parse_libs(args.libs)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in _options.BACKENDS or b == "auto":
            raise SystemExit(f"--backends: unknown backend {b!r}; expected some of "
                             f"{', '.join(k for k in _options.BACKENDS if k != 'auto')}")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="conformance-"))
    runs, records, columns = [], [], []
    for backend in backends:
        kind = _options.BACKENDS[backend][1]
        libs_b = [lib for lib in libs if LIB_DEVICE.get(lib, "host") == kind]
        columns += [(lib, backend) for lib in libs_b]
        if not libs_b:
            runs.append({"backend": backend, "size": "-", "libs": [], "rc": "-", "seconds": 0, "timed_out": False,
                         "not_run": f"no requested library lives in {kind} memory"})
            continue
        if kind == "cuda":  # probe once: without a GPU (or CuPy) there is nothing to run at any size
            probe = tmp / f"{backend}-probe.jsonl"
            info = run_one(args, backend, libs_b, 1, probe, logs / f"conformance-run-{backend}-probe.log",
                           select=("-k", "test_library_available"))
            read_results(probe, info)
            session = info.get("session") or {}
            if not session.get("usable_libs"):
                why = "; ".join((session.get("unavailable") or {}).values()) or f"the probe run failed ({info['log']})"
                runs.append({"backend": backend, "size": "-", "libs": libs_b, "rc": info["rc"],
                             "seconds": info["seconds"], "timed_out": info["timed_out"], "not_run": why,
                             "session": session})
                continue
        # self: one process by definition. mpi-nodes from 2 ranks: at 1 rank its one node holds one rank, so
        # the shared-memory path is off and the run is the mpi backend's run at 1 rank, test for test
        at = [1] if backend == "self" else [s for s in sizes if s >= 2] if backend == "mpi-nodes" else sizes
        if not at:
            print(f"backend {backend}: not run at sizes {sizes} (it needs 2 ranks or more)", flush=True)
        for size in at:
            results = tmp / f"{backend}-n{size}.jsonl"
            run = run_one(args, backend, libs_b, size, results, logs / f"conformance-run-{backend}-n{size}.log")
            got = read_results(results, run)
            label = backend  # the requested name: mpi-nodes is MPI too, but a column of its own
            for r in got:
                r["backend_label"] = label
                r["run"] = id(run)
            records += got
            runs.append(run)
    report, data = build_report(args, runs, records, columns)
    for path, text in ((args.report, report + "\n"), (args.json, json.dumps(data, indent=1, default=str) + "\n")):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
            print(f"wrote {path}")
    bad_runs = [r for r in runs if not r.get("not_run") and (r.get("aborted") or r["rc"] != 0)]
    failures = [r for r in records if r["outcome"] == "fail"]
    print(f"{len(records)} results, {len(failures)} unexpected failures, {len(bad_runs)} runs not clean")
    return 0 if not failures and not bad_runs else 1


if __name__ == "__main__":
    sys.exit(main())

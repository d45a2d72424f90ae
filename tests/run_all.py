"""Run the whole test suite: unit tests in one process, the crash suite (which launches its own
``mpiexec`` jobs), then the MPI tests and the conformance suite under ``mpiexec`` at 1, 2 and 3 ranks.
Every mpiexec runs under a timeout; a multi-rank run that collected or passed zero tests is a failure.
Exit status 0 only if everything passed.

    python tests/run_all.py               # everything
    python tests/run_all.py --sizes 2     # only the 2-rank MPI runs (plus unit tests; torch's suite at 4 too)
    python tests/run_all.py --docs        # only the code blocks of README.md and docs/ (tests/doc_snippets.py)

Then torch's own suite (tests/torch_suite) at 2, 3 and 4 ranks, and the client scripts (tests/clients: the
software that calls torch.distributed, each at 2 ranks, compared with gloo).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from collectives._launcher import job_command  # one way to start a job, whatever the launcher
from support.launch import LAUNCH_FAILED  # (tests/support: this script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / ".test-logs"
_LAST = threading.local()  # how long this thread's last run() took (the summary prints it beside each run)
WHY = LOGS / "why-failed.txt"  # a few lines per failed run, which .ci/run prints last (CI shows a tail)
_CLUES = re.compile(r"FAILED|TIMEOUT|Timeout \(|Error\b|Exception\b|^E  |^\s+File \".*tests/|rank \d+ wrote no summary")


def last_seconds() -> float:
    """How long this thread's last :func:`run` took, in seconds."""
    return getattr(_LAST, "seconds", 0.0)


def why(name: str, text: str, limit: int = 10) -> None:
    """Append to :data:`WHY` the lines of ``text`` that say why run ``name`` failed (failed tests, errors,
    timeouts, the test frames of a watchdog's stack dump), the last ``limit`` of them, each cut to 160
    characters, under the run's name and this Python's environment (MPICH's or Open MPI's venv)."""
    clues = [line.rstrip()[:160] for line in text.splitlines() if _CLUES.search(line)]
    kept = list(dict.fromkeys(clues))[-limit:] or [line.rstrip()[:160] for line in text.splitlines()[-limit:]]
    with WHY.open("a") as f:
        f.write(f"[{Path(sys.prefix).name}] {name}:\n" + "".join(f"    {line}\n" for line in kept))


def run(cmd, timeout, env=None, quiet=False, job=False):
    """Run cmd in its own process group, streaming its output (``quiet``: keeping it, for the caller to
    print); on timeout kill the whole group (mpiexec and every rank it started), so nothing outlives the run.
    ``job``: cmd is a launcher's job (mpiexec ...); one whose launcher could not start at all
    (support.launch) is started once more, saying so. (A pytest run that launches jobs itself, the crash
    suite, reruns such a test itself: tests/crash/conftest.py.)"""
    rc, out = _run_once(cmd, timeout, env, quiet)
    if job and rc != 0 and LAUNCH_FAILED.search(out):
        note = "\n(the launcher did not start: the same command once more)\n"
        if not quiet:
            print(note, end="", flush=True)
        rc, again = _run_once(cmd, timeout, env, quiet)
        out += note + again
    return rc, out


def _run_once(cmd, timeout, env, quiet):
    say = (lambda text: None) if quiet else (lambda text: print(text, end="", flush=True))
    say(f"\n$ {' '.join(map(str, cmd))}   (timeout {timeout}s)\n")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = [f"$ {' '.join(map(str, cmd))}   (timeout {timeout}s)\n"] if quiet else []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            say(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        lines.append(f"\nTIMEOUT after {timeout}s: killed the process group\n")
        say(lines[-1])
        rc = 124
    reader.join(timeout=10)
    _LAST.seconds = time.monotonic() - start
    lines.append(f"  -> exit {rc} in {_LAST.seconds:.1f}s\n")
    say(lines[-1])
    return rc, "".join(lines)


def pytest_counts(out: str) -> tuple[int, int]:
    passed = sum(int(n) for n in re.findall(r"(\d+) passed", out[-3000:]))
    failed = sum(int(n) for n in re.findall(r"(\d+) (?:failed|errors?)\b", out[-3000:]))
    return passed, failed


def mpi_run(target: str, n: int, timeout: int, extra=(), logs: Path = LOGS,
            report: list[str] | None = None) -> tuple[int, int, bool]:
    """``target`` under ``mpiexec -n n`` (tests/mpi_pytest.py), its ranks' counts and logs in ``logs``
    (another folder for a run beside another one: the counts' files are named by the size alone). With a
    ``report`` list, what it would print is appended there instead (a run in a thread: printed when joined)."""
    logs.mkdir(parents=True, exist_ok=True)
    for f in logs.glob(f"summary-n{n}-rank*.json"):
        f.unlink()
    cmd = job_command(n, [sys.executable, "tests/mpi_pytest.py", target, "-q", "-x", "--color=no", "--timeout", "240",
                          *DURATIONS, *extra])  # --color=no: PRRTE gives ranks a terminal
    env = None if logs == LOGS else {**os.environ, "COLLECTIVES_TEST_LOGS": str(logs)}
    quiet = report is not None
    rc, out = run(cmd, timeout, env=env, quiet=quiet, job=True)
    say = report.append if quiet else (lambda text: print(text, end="", flush=True))
    if quiet:  # (a run in the foreground has printed its output as it came)
        say(out)
    counts = []
    for r in range(n):
        f = logs / f"summary-n{n}-rank{r}.json"
        counts.append(json.loads(f.read_text()) if f.exists() else None)
    ok = rc == 0
    for r, c in enumerate(counts):
        if c is None:
            say(f"  rank {r} wrote no summary: it did not finish\n")
            ok = False
        elif c["passed"] == 0 or c["failed"]:
            say(f"  rank {r}: {c}: a run must pass at least one test and fail none\n")
            ok = False
    if not ok:
        tails = []
        for log in sorted(logs.glob(f"{Path(target).name}-n{n}-rank*.log")):
            tails.append(log.read_text()[-4000:])
            say(f"---- {log.name} (tail) ----\n{tails[-1]}\n")
        why(f"{target} -n {n}", out + "".join(tails))
    passed = counts[0]["passed"] if counts and counts[0] else 0
    failed = 0 if ok else max(1, counts[0]["failed"] if counts and counts[0] else 1)
    return passed, failed, ok


DURATIONS = ["--durations=12", "--durations-min=2"]  # where a suite's time goes, in CI's log (rank 0's report)
ALONE = "exited_early"  # the crash tests run one job at a time, after the others (see main)


CLIENTS = [  # (the name its PASS line gives, the script and its arguments): tests/clients/README.md
    ("pipeline", ["-W", "ignore", "tests/clients/pipeline.py"]),
    ("lightning_ddp[devices]", ["tests/clients/lightning_ddp.py"]),
    ("lightning_ddp[nodes]", ["tests/clients/lightning_ddp.py", "--nodes"]),
    ("accelerate_cpu", ["tests/clients/accelerate_cpu.py"]),
    ("dcp", ["tests/clients/dcp.py"]),
    ("accelerate_cpu", ["accelerate", "tests/clients/accelerate_cpu.py", "--backend", "collectives"]),
]


def _accelerate_launch(argv) -> list[str] | None:
    """``accelerate launch --cpu --mpirun_hostfile`` on this machine, 2 processes, where accelerate's
    mpirun command line fits the MPI (Hydra's ``-f``/``-ppn``); else None (skipped)."""
    from collectives._launcher import HYDRA, find_mpiexec, kind

    exe = find_mpiexec()
    if exe is None or kind(exe) != HYDRA:
        return None
    hostfile = LOGS / "accelerate-hostfile"
    hostfile.write_text("localhost\n")
    bindir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")  # its mpirun: the venv's
    return [os.path.join(bindir, "accelerate"), "launch", "--cpu", "--mpirun_hostfile", str(hostfile),
            "--num_processes", "2", "--num_machines", "1", *argv]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2,3", help="world sizes for the MPI runs (default 1,2,3)")
    ap.add_argument("--torch-suite-sizes", default=None,
                    help="world sizes of torch's own suite (default: those of --sizes from 2, and 4, where torch's "
                         "group tests run; 4 ranks oversubscribe 2 cores, fine for correctness)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per mpiexec run")
    ap.add_argument("--skip-unit", action="store_true",
                    help="skip the unit tests, the doctests and the docs' code blocks")
    ap.add_argument("--docs", action="store_true",
                    help="run only the code blocks of README.md and docs/*.md (exit 0 only if all pass)")
    args = ap.parse_args()
    LOGS.mkdir(exist_ok=True)
    # the flight recorder's dumps (every MismatchError and timeout the suites provoke writes one) go with
    # the logs, not into the working directory; one directory for every rank of a job
    os.environ.setdefault("COLLECTIVES_TRACE_DIR", str(LOGS / "trace"))
    # JAX's persistent compilation cache, one for every run below (every rank, both MPIs' runs of one
    # checkout): the suites jit the same programs at every size, and XLA's compile of each was most of the
    # JAX tests' time (tests/mpi/test_jax*.py at 3 ranks on 2 cores: 75 s with a cold cache, 41 s with a
    # warm one). What runs is what XLA compiled for the same program (the key is the program, the JAX
    # version and the compile options); the tracing and every call of collectives run as before.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(LOGS / "jax-cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.torch_suite_sizes is None:
        torch_sizes = sorted({s for s in sizes if s >= 2} | {4})
    else:
        torch_sizes = [int(s) for s in args.torch_suite_sizes.split(",") if s]
    if max(sizes + torch_sizes) > (os.cpu_count() or 1):
        # More ranks than cores: MPICH's busy polling then costs milliseconds per collective (5.3 ms vs
        # 25 us for an 8 B allreduce at 3 ranks on 2 cores); let it sleep when nothing progresses.
        os.environ.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
        os.environ.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT", "16")
    total_passed = total_failed = 0
    results: list[tuple[str, bool, float]] = []

    def done(name: str, ok: bool, out: str | None, took: float | None = None) -> None:
        results.append((name, ok, last_seconds() if took is None else took))
        if not ok and out is not None:
            why(name, out)

    def docs_snippets():
        # every code block of README.md and docs/*.md, run as a reader pastes it (tests/doc_snippets.py)
        rc, out = run([sys.executable, str(ROOT / "tests" / "doc_snippets.py")], 1800)
        m = re.search(r"(\d+) passed, (\d+) failed", out[-3000:])
        ok = rc == 0 and m is not None and int(m.group(1)) > 0
        if not ok:
            why("docs snippets", out)
        p = int(m.group(1)) if m else 0
        f = int(m.group(2)) if m else 0
        return p, (f if f or ok else 1), ok

    if args.docs:
        p, f, ok = docs_snippets()
        print(f"\nsummary:\n  {'ok  ' if ok else 'FAIL'} docs snippets\n{p} passed, {f} failed")
        return 0 if ok else 1

    # Two jobs at a time where pytest-xdist is installed (the test extra has it) and there are two cores: the
    # unit tests in two workers took 62 s instead of 77 s on CI's 2 cores; the crash suite, below, likewise
    two = ["-n", "2"] if importlib.util.find_spec("xdist") and (os.cpu_count() or 1) >= 2 else []
    suites = [("tests/mpi", ())]
    if (ROOT / "conformance" / "conftest.py").exists():
        suites.append(("conformance", ()))
    ran: set[tuple[str, int]] = set()  # the MPI runs made before the loop over the suites below

    def mpi_suite(target: str, n: int, extra=()) -> None:
        nonlocal total_passed, total_failed
        p, f, ok = mpi_run(target, n, args.timeout, extra)
        total_passed += p
        total_failed += f
        done(f"{target} -n {n}", ok, None)  # (mpi_run said why)
        ran.add((target, n))

    if not args.skip_unit:
        rc, out = run([sys.executable, "-m", "pytest", "tests/unit", "-q", *two], 1800)
        p, f = pytest_counts(out)
        ok = rc == 0 and p > 0
        total_passed += p
        total_failed += f if f or ok else 1
        done("unit", ok, out)

    # A 1-rank job keeps one core of two busy: on two cores, tests/mpi at 1 rank (about 90 s) runs in a thread
    # beside the single-process stages (the doctests, the conformance suite at 1 rank: 40 s together), then
    # beside the start of the docs' code blocks; its output is printed when it ends (its counts go to a
    # folder of their own). CI's 1-rank stages left a core idle for about 70 s before.
    beside = None
    if 1 in sizes and (os.cpu_count() or 1) >= 2:
        beside_report: list[str] = []

        def tests_mpi_alone():
            start = time.monotonic()
            counts = mpi_run("tests/mpi", 1, args.timeout, logs=LOGS / "beside", report=beside_report)
            return counts, time.monotonic() - start

        beside = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="beside").submit(tests_mpi_alone)
        print("\n(tests/mpi at 1 rank runs beside the stages below; its output follows when it ends)", flush=True)
    if not args.skip_unit:
        rc, out = run([sys.executable, "-m", "pytest", "-q", "--doctest-modules", "src/collectives"], 600)
        p, f = pytest_counts(out)
        ok = rc == 0 and p > 0
        total_passed += p
        total_failed += f if f or ok else 1
        done("doctests", ok, out)
    if beside is not None and ("conformance", ()) in suites:
        mpi_suite("conformance", 1)
    if not args.skip_unit:
        p, f, ok = docs_snippets()
        total_passed += p
        total_failed += f
        done("docs snippets", ok, None)
    if beside is not None:
        (p, f, ok), took = beside.result()
        print("\n" + "".join(beside_report), end="", flush=True)
        total_passed += p
        total_failed += f
        done("tests/mpi -n 1", ok, None, took)
        ran.add(("tests/mpi", 1))

    # The crash suite: one process of pytest that launches each failure scenario under mpiexec itself
    # (exception, SIGKILL, mismatch, deadline, clean exit at 2 and 3 ranks) and times how the job ends; with
    # it the job that needs a world size of its own (the reproducible training step at 4 ranks).
    # Two jobs at a time where pytest-xdist is installed (the test extra has it): a job keeps about one core
    # busy (its ranks start Python, torch, MPI) and waits for its deadlines, so two take 226-301 s on CI's 2
    # cores under MPICH instead of 346-370 s, and 284 s instead of 455 s under Open MPI; the longest file (the
    # reproducible step's job of 4 ranks) is named first so that it starts first. The early-exit jobs
    # then run alone, after the rest (ALONE): the one CI run that had Open MPI's jobs two at a time (stop 46)
    # had PRRTE end one of them 115 s after its MPI_Abort instead of at once, at 3 ranks beside another job.
    # It is the suite's only scenario where one rank has left through MPI_Finalize while the others abort;
    # alone, it has ended within seconds in every run since, on both MPIs.
    crash = ["tests/crash/test_reproducible_jobs.py", "tests/crash"]
    passes = [(two, ["-k", f"not {ALONE}"]), (["-s"], ["-k", ALONE])] if two else [(["-s"], [])]
    for workers, select in passes:
        rc, out = run([sys.executable, "-m", "pytest", *crash, "-q", *workers, *select, "--timeout", "300",
                       *DURATIONS], 1200)
        p, f = pytest_counts(out)
        ok = rc == 0 and p > 0
        total_passed += p
        total_failed += f if f or ok else 1
        done("crash" + (f" ({' '.join(select)})" if select else ""), ok, out)

    for target, extra in suites:
        for n in sizes:
            if (target, n) not in ran:
                mpi_suite(target, n, extra)

    # torch's own distributed test suite against the backend "collectives" (tests/torch_suite/run.py; about
    # half a minute per size, a minute and a half at 4 ranks): expected failures are listed, with their
    # reason, in expected_failures.txt
    for n in torch_sizes:
        suite = ROOT / "tests" / "torch_suite"
        cmd = job_command(n, [sys.executable, "-W", "ignore", str(suite / "run.py"), "--expected",
                              str(suite / "expected_failures.txt")])
        rc, out = run(cmd, 900, job=True)
        m = re.search(r"(\d+) passed, (\d+) failed", out)
        ok = rc == 0 and m is not None and int(m.group(1)) > 0
        total_passed += int(m.group(1)) if m else 0
        total_failed += (int(m.group(2)) if m else 0) or (0 if ok else 1)
        done(f"torch suite -n {n}", ok, out)

    # the software that calls torch.distributed, on the backend (tests/clients/README.md): 2 ranks each
    if 2 in sizes:
        for name, argv in CLIENTS:
            cmd = job_command(2, [sys.executable, *argv]) if argv[0] != "accelerate" else _accelerate_launch(argv[1:])
            if cmd is None:
                print(f"\nclient {name}: skipped (accelerate launch builds Hydra's mpirun command line; this MPI is not Hydra)")
                continue
            rc, out = run(cmd, 600, job=True)
            ok = rc == 0 and f"PASS {name}" in out
            total_passed += ok
            total_failed += not ok
            done(f"client {name}", ok, out)

    print("\nsummary:")
    for name, ok, seconds in results:
        print(f"  {'ok  ' if ok else 'FAIL'} {name} ({seconds:.0f} s)")
    print(f"{total_passed} passed, {total_failed} failed")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())

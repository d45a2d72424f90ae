"""Runs the conformance suite under ``mpiexec -n N`` (N = 1..4) or a plain ``python -m pytest``.

What this file does, in order:

1. reads the options (``_options``: which libraries, which backend, which system under test, full or
   sampled), sets the backend's environment, imports the system under test and calls its ``init``;
2. marks the tests listed in the expected-failure files (``_xfail``) ``xfail(strict=True)``;
3. after every test body, exchanges the ranks' verdicts over the suite's own channel (``_harness``), so a
   failure on any rank fails the test on every rank and results are compared across ranks bit for bit;
4. aborts the whole job only when a failure could not be agreed on (a rank failed outside a test body),
   so the other ranks cannot hang;
5. writes every outcome, from rank 0, as JSON lines to ``COLLECTIVES_CONFORMANCE_RESULTS`` (for
   ``conformance/run.py``), and each rank's counts to ``.test-logs/summary-n<N>-rank<r>.json`` (for
   ``tests/run_all.py``).
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import pytest

from . import _harness, _libs, _matrix, _options, _xfail

LOGS = Path(os.environ.get("COLLECTIVES_TEST_LOGS", Path(__file__).resolve().parents[1] / ".test-logs"))


class _State:
    opts: _options.Options
    sut = None
    comm = None
    channel: _harness.Channel = _harness.Channel()
    backend_name = "?"          # the backend as the report names it (auto resolved)
    xfails: dict = {}  # noqa: RUF012 - S is a namespace of session globals, never instantiated
    results = None              # open JSON-lines file (rank 0)
    counts = {"passed": 0, "failed": 0, "skipped": 0, "collected": 0}  # noqa: RUF012 - see xfails
    started = 0.0
    test_started = None         # (nodeid, time) of the test running now, for the watchdog


S = _State()


def _watchdog(limit: float) -> None:
    """One thread for the session: if a test runs longer than ``limit`` seconds (it is stuck, typically
    in a collective that another rank never entered), print every thread's stack and end the process, so
    the launcher ends the job. A pytest-timeout signal cannot interrupt a blocked MPI call; this can."""
    import faulthandler
    import threading

    def watch():
        while True:
            time.sleep(1.0)
            current = S.test_started
            if current is not None and time.monotonic() - current[1] > limit:
                sys.stderr.write(f"\n[rank {S.channel.rank}/{S.channel.size}] {current[0]} has run for more than "
                                 f"{limit:.0f} s: it is stuck; ending the job\n")
                faulthandler.dump_traceback(all_threads=True)
                sys.stderr.flush()
                _emit({"event": "timeout", "nodeid": current[0], "seconds": limit})
                os._exit(124)

    threading.Thread(target=watch, name="conformance-watchdog", daemon=True).start()


# ----------------------------------------------------------------------------------------------- options

def pytest_addoption(parser):
    g = parser.getgroup("conformance", "collectives conformance suite (each option overrides its variable)")
    g.addoption("--conformance-libs", default=None, help="COLLECTIVES_CONFORMANCE_LIBS: numpy,torch,strict,...")
    g.addoption("--conformance-backend", default=None,
                help="COLLECTIVES_CONFORMANCE_BACKEND: auto, mpi, self, nccl, host-staging, cuda-aware-mpi")
    g.addoption("--conformance-sut", default=None, help="COLLECTIVES_CONFORMANCE_SUT: package.module")
    g.addoption("--conformance-full", action="store_true", default=None,
                help="COLLECTIVES_CONFORMANCE_FULL=1: the whole matrix instead of the sample")
    g.addoption("--conformance-seed", default=None, help="COLLECTIVES_CONFORMANCE_SEED: which sample")
    g.addoption("--conformance-require", action="store_true", default=None,
                help="COLLECTIVES_CONFORMANCE_REQUIRE=1: a missing library or device fails instead of skipping")
    g.addoption("--conformance-results", default=None, help="COLLECTIVES_CONFORMANCE_RESULTS: JSON-lines path")
    g.addoption("--conformance-xfail-dir", default=None, help="COLLECTIVES_CONFORMANCE_XFAIL_DIR")


def _load_sut(name: str):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise pytest.UsageError(f"COLLECTIVES_CONFORMANCE_SUT={name!r}: cannot import it ({exc}); it must be "
                                f"an importable module exposing the names of collectives") from exc
    missing = [n for n in ("init", "broadcast", "allreduce", "reduce", "allgather", "barrier")
               if not callable(getattr(module, n, None))]
    if missing:
        raise pytest.UsageError(f"system under test {name!r} lacks {', '.join(missing)}: see conformance/sut.py "
                                f"for the names a system under test exposes")
    return module


def pytest_configure(config):
    config.addinivalue_line("markers", "conformance(**meta): what a conformance test covers (for the report)")
    # torch warns on every complex32 tensor made; the suite makes them on purpose
    config.addinivalue_line("filterwarnings", "ignore:ComplexHalf support is experimental:UserWarning")
    get = config.getoption
    try:
        S.opts = _options.read({
            "libs": get("--conformance-libs"), "backend": get("--conformance-backend"),
            "sut": get("--conformance-sut"), "full": get("--conformance-full"),
            "seed": get("--conformance-seed"), "require": get("--conformance-require"),
            "results": get("--conformance-results"), "xfail_dir": get("--conformance-xfail-dir"),
        })
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    _options.current = S.opts
    opts = S.opts
    if opts.backend == "self" and _harness.launcher_size() > 1:
        raise pytest.UsageError("backend 'self' is a single process: run it without mpiexec (or with -n 1)")
    os.environ.update(opts.backend_env)  # read by the library when a collective first meets a device
    S.sut = _load_sut(opts.sut)
    S.comm = S.sut.init(backend=opts.init_backend)
    S.channel = _harness.make_channel(single=opts.backend == "self" or _harness.launcher_size() == 1)
    if (S.comm.rank, S.comm.size) != (S.channel.rank, S.channel.size):
        raise pytest.UsageError(
            f"the system under test says rank {S.comm.rank} of {S.comm.size}, but the launcher started rank "
            f"{S.channel.rank} of {S.channel.size}: the suite needs the SUT's default communicator to be "
            f"MPI's whole world")
    if opts.device_kind == "host":
        S.backend_name = str(getattr(S.comm, "backend", opts.backend))
    else:
        S.backend_name = opts.backend
    for name in _matrix.usable_libs():
        _libs.get(name).setup(S.comm)
    S.xfails = _xfail_entries(opts)
    S.started = time.time()
    _watchdog(_per_test_timeout(config) + 30)
    LOGS.mkdir(parents=True, exist_ok=True)
    if S.channel.rank == 0 and opts.results:
        S.results = open(opts.results, "a", buffering=1)  # noqa: SIM115 - open for the session, closed at its end
        _emit({"event": "session", **session_info()})


def pytest_sessionstart(session):
    if S.channel.rank != 0 and os.path.basename(sys.argv[0]) != "mpi_pytest.py":
        _quiet_rank(session.config)


def _per_test_timeout(config) -> float:
    """pytest-timeout's limit (--timeout, else the ini value), else 300 s."""
    for get in (lambda: config.getoption("timeout"), lambda: config.getini("timeout")):
        try:
            value = get()
        except (ValueError, KeyError):
            continue
        if value:
            return float(value)
    return 300.0


def _xfail_entries(opts):
    try:
        return _xfail.load(opts.xfail_dir, S.backend_name, opts.libs)
    except _xfail.XfailFileError as exc:
        raise pytest.UsageError(str(exc)) from None


def _quiet_rank(config):
    """Ranks other than 0 write pytest's report to a log file, so the terminal shows one report."""
    tr = config.pluginmanager.getplugin("terminalreporter")
    if tr is None:
        return
    from _pytest.config import create_terminal_writer

    log = open(LOGS / f"conformance-n{S.channel.size}-rank{S.channel.rank}.log", "w")  # noqa: SIM115 - the rank's log for the whole session
    tr._tw = create_terminal_writer(config, log)


def session_info() -> dict:
    versions = {"python": platform.python_version()}
    for mod in ("numpy", "torch", "array_api_strict", "jax", "cupy", "mpi4py", "collectives"):
        m = sys.modules.get(mod)
        if m is not None:
            versions[mod] = str(getattr(m, "__version__", "?"))
    return {
        "size": S.channel.size, "backend": S.backend_name, "backend_requested": S.opts.backend,
        "libs": S.opts.libs, "usable_libs": _matrix.usable_libs(),
        "unavailable": {n: _matrix.lib_status(n) for n in S.opts.libs if _matrix.lib_status(n)},
        "sut": S.opts.sut, "full": S.opts.full, "seed": S.opts.seed, "versions": versions,
        "host": platform.node(),
    }


# -------------------------------------------------------------------------------------------- collection

def pytest_collection_modifyitems(session, config, items):
    S.counts["collected"] = len(items)
    size = S.channel.size
    for item in items:
        m = item.get_closest_marker("conformance")
        lib = m.kwargs.get("lib") if m else None
        nodeid = item.nodeid.split("conformance/", 1)[-1]
        entry = _xfail.match(S.xfails, lib, item.name, nodeid, size)
        if entry is not None:
            item.add_marker(pytest.mark.xfail(reason=f"{entry.where}: {entry.reason}", strict=True, run=entry.run))


# ---------------------------------------------------------------------------------- the verdict exchange

def _verdict(error):
    if error is None:
        return "ok", ""
    if isinstance(error, pytest.skip.Exception):
        return "skip", str(error)
    if isinstance(error, pytest.xfail.Exception):
        return "xfail", str(error)
    text = f"{type(error).__name__}: {error}"
    return "fail", text[:4000]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    item._conformance_rec = getattr(item, "_conformance_rec", None) or _harness.Recorder()
    error = None
    try:
        yield
    except (KeyboardInterrupt, SystemExit, pytest.exit.Exception):
        raise
    except BaseException as exc:  # noqa: BLE001 - held, agreed across ranks, then re-raised
        error = exc
    status, message = _verdict(error)
    everyone = S.channel.allgather((status, message, item._conformance_rec.digests))
    item._conformance_agreed = True
    statuses = [s for s, _, _ in everyone]
    failed = [(r, m) for r, (s, m, _) in enumerate(everyone) if s == "fail"]
    if failed:
        ranks = ",".join(str(r) for r, _ in failed)
        detail = "\n".join(f"  rank {r}: {m}" for r, m in failed[:4])
        summary = f"failed on rank(s) {ranks} of {len(everyone)}:\n{detail}"
        if error is not None and status == "fail":
            if hasattr(error, "add_note"):
                error.add_note(summary)
            raise error
        raise _harness.AgreedFailure(summary)
    if len(set(statuses)) > 1:
        raise _harness.AgreedFailure(f"the ranks did not agree: {statuses} ({[m for _, m, _ in everyone]})")
    if error is not None:
        raise error  # the same skip or xfail on every rank
    mismatch = _harness.compare_digests([d for _, _, d in everyone])
    if mismatch:
        raise _harness.AgreedFailure(mismatch)
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    report.conformance_agreed = call.when == "call" and getattr(item, "_conformance_agreed", False)
    m = item.get_closest_marker("conformance")
    report.conformance_meta = {k: v for k, v in (m.kwargs if m else {}).items() if v is not None}
    return report


# ---------------------------------------------------------------------------------------------- outcomes

def _outcome(report) -> str:
    if report.passed:
        return "xpass" if hasattr(report, "wasxfail") else "pass"
    if report.skipped:
        return "xfail" if hasattr(report, "wasxfail") else "skip"
    return "fail"


def _emit(record: dict) -> None:
    if S.results is not None:
        S.results.write(json.dumps(record, default=str) + "\n")


def pytest_runtest_logstart(nodeid, location):
    S.test_started = (nodeid, time.monotonic())
    _emit({"event": "start", "nodeid": nodeid})


def pytest_runtest_logfinish(nodeid, location):
    S.test_started = None


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        S.counts["passed"] += 1
    elif report.skipped:
        S.counts["skipped"] += 1
    elif report.failed:
        S.counts["failed"] += 1
    if report.when == "call" or (report.when == "setup" and not report.passed) or report.failed:
        outcome = _outcome(report)
        if outcome in ("fail", "skip"):
            message = report.longreprtext[-3000:]
        elif outcome == "xfail":
            message = str(report.wasxfail)
        else:
            message = ""
        _emit({"event": "test", "nodeid": report.nodeid, "name": report.nodeid.split("::")[-1],
               "outcome": outcome, "when": report.when, "duration": round(report.duration, 4),
               "meta": getattr(report, "conformance_meta", {}), "size": S.channel.size,
               "backend": S.backend_name, "message": message})
    if report.failed and not getattr(report, "conformance_agreed", False) and S.channel.size > 1:
        sys.stderr.write(f"\n[rank {S.channel.rank}/{S.channel.size}] FAILED {report.nodeid} ({report.when}), "
                         f"not agreed with the other ranks: aborting the job\n{report.longreprtext}\n")
        sys.stderr.flush()
        _write_counts()
        S.channel.abort(1)


def _write_counts():
    (LOGS / f"summary-n{S.channel.size}-rank{S.channel.rank}.json").write_text(json.dumps(S.counts))


def pytest_sessionfinish(session, exitstatus):
    _write_counts()
    unused = [f"{e.where}: {e.glob}" for entries in S.xfails.values() for e in entries if not e.used]
    _emit({"event": "end", "exitstatus": int(exitstatus), "seconds": round(time.time() - S.started, 2),
           "counts": S.counts, "xfail_unused": unused})
    if S.results is not None:
        S.results.close()
        S.results = None


# ---------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def sut():
    """The module under test (``COLLECTIVES_CONFORMANCE_SUT``, default ``conformance.sut``)."""
    return S.sut


@pytest.fixture(scope="session")
def comm():
    """The communicator ``sut.init`` returned (rank, size)."""
    return S.comm


@pytest.fixture(scope="session")
def opts():
    return S.opts


@pytest.fixture(scope="session")
def channel():
    """The suite's own channel between ranks (not the system under test), for a test's own exchanges."""
    return S.channel.for_tests()


@pytest.fixture
def rec(request):
    """Record results that must be identical on every rank, bit for bit."""
    request.node._conformance_rec = r = _harness.Recorder()
    return r

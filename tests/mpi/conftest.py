"""Runs under ``mpiexec -n N python -m pytest tests/mpi``: every rank runs every test.

- Tests are written in terms of ``comm.rank`` and ``comm.size``, so one file passes at any world size.
- Run through ``tests/mpi_pytest.py``, only rank 0 prints pytest's report; the others log to ``.test-logs/``.
- A failure on any rank prints that rank's traceback to stderr and aborts the whole job at once, so the
  other ranks cannot hang in a collective the failed rank will never enter.
- Each rank writes its counts to ``.test-logs/`` so the runner can refuse a run that collected nothing.
"""

import json
import os
import sys
from pathlib import Path

import pytest

import collectives as coll

LOGS = Path(os.environ.get("COLLECTIVES_TEST_LOGS", Path(__file__).resolve().parents[2] / ".test-logs"))
_counts = {"passed": 0, "failed": 0, "skipped": 0, "collected": 0}


def _world():
    return coll.init()


def pytest_configure(config):
    _world()
    LOGS.mkdir(parents=True, exist_ok=True)


def pytest_collection_modifyitems(session, config, items):
    _counts["collected"] = len(items)


def pytest_runtest_logreport(report):
    if report.passed and report.when == "call":
        _counts["passed"] += 1
    elif report.skipped:
        _counts["skipped"] += 1
    elif report.failed:
        _counts["failed"] += 1
        c = _world()
        if c.size > 1:
            sys.stderr.write(f"\n[rank {c.rank}/{c.size}] FAILED {report.nodeid} ({report.when})\n"
                             f"{report.longreprtext}\n")
            sys.stderr.flush()
            _write_counts(c)
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)


def _write_counts(c):
    (LOGS / f"summary-n{c.size}-rank{c.rank}.json").write_text(json.dumps(_counts))


def pytest_sessionfinish(session, exitstatus):
    _write_counts(_world())


@pytest.fixture(scope="session")
def comm():
    """The default communicator (MPI under mpiexec)."""
    return _world()


@pytest.fixture(params=["plain", "deadline"])
def c(request, comm):
    """The default communicator, then one whose transport has a deadline (the polled operations)."""
    if request.param == "plain":
        yield comm
        return
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend")
    from support.comms import communicator

    with communicator(COLLECTIVES_TIMEOUT=300) as d:
        yield d

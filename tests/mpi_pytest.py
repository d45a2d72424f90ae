"""pytest under mpiexec with one report: ``mpiexec -n N python tests/mpi_pytest.py tests/mpi -q -x``.

Ranks other than 0 write their pytest output to ``.test-logs/<suite>-n<size>-rank<rank>.log``; failures on
any rank are still printed to stderr (by the suite's conftest) before the job is aborted.

A test still running 90 s past its pytest-timeout limit (whose signal cannot reach a main thread blocked in an
MPI call) dumps every thread's stack to the job's stderr and ends its rank (:class:`Watchdog`), as does a rank
still in MPI_Finalize 120 s after its tests; mpiexec then ends the job. A hang costs minutes and says where
it was, instead of the runner's whole budget in silence.
"""

import faulthandler
import os
import sys
from pathlib import Path

import pytest


class Watchdog:
    """A pytest plugin: :func:`faulthandler.dump_traceback_later` (a C thread, which needs neither the GIL
    nor the main thread) armed for each test, writing to the stderr this process had before pytest's
    capture replaced file descriptor 2."""

    def __init__(self):
        self.stderr = os.fdopen(os.dup(2), "w")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        limit = item.config.getoption("timeout", None) or item.config.getini("timeout") or 300
        faulthandler.dump_traceback_later(float(limit) + 90, exit=True, file=self.stderr)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


def _rank_size():
    for r, s in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                 ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")):
        if r in os.environ:
            return int(os.environ[r]), int(os.environ.get(s, "1"))
    return 0, 1


if __name__ == "__main__":
    rank, size = _rank_size()
    if rank != 0:
        logs = Path(os.environ.get("COLLECTIVES_TEST_LOGS", Path(__file__).resolve().parents[1] / ".test-logs"))
        logs.mkdir(parents=True, exist_ok=True)
        suite = Path(sys.argv[1]).name if len(sys.argv) > 1 else "tests"
        log = open(logs / f"{suite}-n{size}-rank{rank}.log", "w")  # noqa: SIM115 - stdout of the rank until exit
        os.dup2(log.fileno(), 1)
    watchdog = Watchdog()
    rc = pytest.main(sys.argv[1:], plugins=[watchdog])
    # MPI_Finalize (mpi4py's, at exit) with the same watch: a rank stuck there says so and ends
    faulthandler.dump_traceback_later(120, exit=True, file=watchdog.stderr)
    sys.exit(rc)

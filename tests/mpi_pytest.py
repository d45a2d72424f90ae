"""pytest under mpiexec with one report: ``mpiexec -n N python tests/mpi_pytest.py tests/mpi -q -x``.

Ranks other than 0 write their pytest output to ``.test-logs/<suite>-n<size>-rank<rank>.log``; failures on
any rank are still printed to stderr (by the suite's conftest) before the job is aborted.
"""

import os
import sys
from pathlib import Path

import pytest


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
    sys.exit(pytest.main(sys.argv[1:]))

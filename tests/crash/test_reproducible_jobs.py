"""The world-size-invariant training step (issue 36) in a job of 4 ranks: ``tests/support/steps.py`` (20 steps
of an MLP with ``DistributedOptimizer(..., reproducible=True)``, torch and JAX+optax) under ``mpiexec -n 4``
in a subprocess with a timeout: the parameters' digest must be the same on every rank of the job and the
digest of the same steps at one rank (rank 0 alone, on a communicator of its own, in the same job).

Four ranks is the world size the MPI suites' runs (1, 2 and 3 ranks) do not reach; those runs make the same
steps on the world communicator of their job and on sub-communicators of every size, against one rank alone
(``tests/mpi/test_reproducible.py``, ``test_distributed_optimizer_reproducible_at_every_size``), so jobs of
1, 2 and 3 ranks here would repeat them.

    python -m pytest tests/crash/test_reproducible_jobs.py -q -s
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
from bounded import bounded  # (tests/crash/bounded.py: a job that cannot hang the suite)

from collectives._launcher import job_command, job_environment  # one way to start a job, any launcher

STEPS = Path(__file__).resolve().parents[1] / "support" / "steps.py"
RANKS = 4
RUN_LIMIT_S = 300  # a job still running then hung (4 ranks on 2 cores take about 30 s)


def _job(n: int) -> dict[str, str]:
    env = job_environment(drop=("COLLECTIVES_",))
    if n > (os.cpu_count() or 1):  # more ranks than cores: let MPICH sleep when idle (docs/troubleshooting.md)
        env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
        env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT", "16")
    start = time.time()
    rc, out, err = bounded(job_command(n, [sys.executable, "-W", "ignore", str(STEPS)]),
                           f"the training job at {n} ranks", RUN_LIMIT_S, env)
    assert rc == 0, f"exit {rc}\n{out[-3000:]}\n{err[-6000:]}"
    found = {name: (job, alone) for name, job, alone in
             re.findall(r"^(torch|jax) (\S+) same-on-every-rank one-rank (\S+)$", out, re.M)}
    print(f"\n[reproducible] -n {n}: {found} in {time.time() - start:.1f}s")
    return found


def test_the_training_step_of_a_job_of_4_ranks_gives_the_bits_of_one_rank():
    pytest.importorskip("torch")
    pytest.importorskip("optax")
    found = _job(RANKS)
    assert set(found) == {"torch", "jax"}, found  # every rank of the job got the same bits
    for name, (job, alone) in found.items():
        assert job == alone, (name, found)

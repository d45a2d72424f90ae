"""The world-size-invariant training step (issue 36) in jobs of 1, 2, 3 and 4 ranks: ``tests/support/steps.py``
(20 steps of an MLP with ``DistributedOptimizer(..., reproducible=True)``, torch and JAX+optax) under
``mpiexec -n N``, each job in a subprocess with a timeout; the parameters' digests must be the same on
every rank of a job and in every job. (``tests/mpi/test_reproducible.py`` runs the same steps on
sub-communicators of every size within one job; here every world size is a job of its own, 4 included,
which the MPI suites' 1-, 2- and 3-rank runs do not reach.)

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
SIZES = [1, 2, 3, 4]
RUN_LIMIT_S = 300  # a job still running then hung (4 ranks on 2 cores take about 25 s)


def _job(n: int) -> dict[str, str]:
    env = job_environment(drop=("COLLECTIVES_",))
    if n > (os.cpu_count() or 1):  # more ranks than cores: let MPICH sleep when idle (docs/troubleshooting.md)
        env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
        env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT", "16")
    start = time.time()
    rc, out, err = bounded(job_command(n, [sys.executable, "-W", "ignore", str(STEPS)]),
                           f"the training job at {n} ranks", RUN_LIMIT_S, env)
    assert rc == 0, f"exit {rc}\n{out[-3000:]}\n{err[-6000:]}"
    found = dict(re.findall(r"^(torch|jax) (\S+) same-on-every-rank$", out, re.M))
    print(f"\n[reproducible] -n {n}: {found} in {time.time() - start:.1f}s")
    return found


def test_the_training_step_gives_the_same_bits_in_jobs_of_1_to_4_ranks():
    pytest.importorskip("torch")
    pytest.importorskip("optax")
    digests = {n: _job(n) for n in SIZES}
    for n, found in digests.items():
        assert set(found) == {"torch", "jax"}, (n, found)  # every rank of the job got the same bits
    assert len({d["torch"] for d in digests.values()}) == 1, digests
    assert len({d["jax"] for d in digests.values()}) == 1, digests

"""One way for the crash suite to run a job (``mpiexec``, torchrun) in a subprocess that cannot hang it: in a
session of its own, so that a job still running at its limit is killed whole (the launcher and every
rank), and the test fails saying the job HUNG, with the end of what it wrote."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest


def bounded(cmd: list[str], what: str, limit_s: float, env: dict[str, str]) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of ``cmd`` run with ``env``; past ``limit_s`` seconds its process
    group is killed and the test fails: ``<what> HUNG``.

    Example (in a test)::

        rc, out, err = bounded(["mpiexec", "-n", "2", "python", "job.py"], "job.py at 2 ranks", 120, env)
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what} HUNG: still running after {limit_s}s\n{out[-3000:]}\n{err[-3000:]}")
    return proc.returncode, out, err

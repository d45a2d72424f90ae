"""torchrun and the torch backend (docs/torchrun.md): torchrun starts its workers without MPI and MPI
cannot join them afterwards, so ``init_process_group("collectives")`` in a torchrun job of more than one
process (torch's rendezvous, or ours: ``init_method="collectives://"``) is a ValueError, the same on every
worker, that names torchrun, the ``mpiexec`` command to run instead and
the page, promptly (no hang); a torchrun job of one process works (a group of one). Each job runs
``python -m torch.distributed.run`` (torchrun's module) in a subprocess with a timeout, its process group
killed whole if it hangs.

    python -m pytest tests/crash/test_torchrun.py -q
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collectives._launcher import job_environment  # without the variables of a launcher around pytest

pytest.importorskip("torch")

WORKER = Path(__file__).resolve().parent / "torchrun_worker.py"
RUN_LIMIT_S = 120  # reaching it means the job hung


def torchrun(nproc: int, *worker_args: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(WORKER), *worker_args]
    env = job_environment(drop=("COLLECTIVES_",), OMP_NUM_THREADS=1)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun --nproc_per_node {nproc} HUNG: still running after {RUN_LIMIT_S}s\n{out[-3000:]}\n"
                    f"{err[-3000:]}")
    wall = time.monotonic() - start
    print(f"\n[torchrun] --nproc_per_node {nproc}: exit {proc.returncode}, {wall:.1f}s wall")
    return proc.returncode, out, err


@pytest.mark.parametrize(("nproc", "init_method"), [(2, None), (3, None), (2, "collectives://")])
def test_torchrun_of_several_processes_is_refused_on_every_worker_naming_what_to_run(nproc, init_method):
    rc, out, err = torchrun(nproc, *([init_method] if init_method else []))
    assert rc != 0, (out, err)
    assert "DONE" not in out, (out, err)
    refusals = re.findall(r"ValueError: init_process_group\('collectives'\) under torchrun: torch has rank (\d+) "
                          rf"of {nproc}, but this process is not in an MPI job", err)
    # torchrun stops the other workers once one fails: at least one worker reports it, each one once
    assert refusals and len(set(refusals)) == len(refusals), err[-6000:]
    command = shlex.join([str(WORKER), *([init_method] if init_method else [])])  # the script and its arguments
    assert f"`mpiexec -n {nproc} python {command}`" in err, err[-6000:]
    assert "docs/torchrun.md" in err, err[-6000:]


def test_torchrun_of_one_process_is_a_group_of_one():
    rc, out, err = torchrun(1)
    assert rc == 0, (out, err[-6000:])
    assert re.findall(r"^DONE (\d+) (\d+)$", out, re.M) == [("0", "1")], (out, err[-6000:])

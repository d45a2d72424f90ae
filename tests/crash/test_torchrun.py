"""torchrun and the torch backend (docs/torchrun.md). Under torchrun, ``init_process_group("collectives")``
makes the workers one MPI job by serving them PMI-1, the protocol of MPICH's launcher, through torch's
store: on MPICH (and the MPIs built on it) a torchrun job of 2 and 3 processes runs its collectives and
gets torch's ranks. Where that cannot work it is a ValueError, the same on every worker, that names
torchrun, the reason, the ``mpiexec`` command to run instead and the page, promptly (no hang): an MPI
that does not speak PMI-1 (Open MPI), ``init_method="collectives://"``, MPI started before
``init_process_group``. A torchrun job of one process works everywhere. Each job runs
``python -m torch.distributed.run`` (torchrun's module) in a subprocess with a timeout, its process group
killed whole if it hangs.

    python -m pytest tests/crash/test_torchrun.py -q
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bounded import bounded  # (tests/crash/bounded.py: a job that cannot hang the suite)

from collectives._launcher import implementation, job_environment  # one way to make a job's environment

pytest.importorskip("torch")

WORKER = Path(__file__).resolve().parent / "torchrun_worker.py"
RUN_LIMIT_S = 120  # reaching it means the job hung
PMI1 = ("MPICH", "Intel MPI", "MVAPICH")  # the MPIs whose processes speak PMI-1 to their launcher


@functools.cache
def mpi_implementation() -> str:
    """The MPI that mpi4py loads, asked in a process of its own (this one stays without MPI)."""
    out = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
                         capture_output=True, text=True, timeout=120, env=job_environment())
    return implementation(out.stdout)


def torchrun(nproc: int, *worker_args: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(WORKER), *worker_args]
    env = job_environment(drop=("COLLECTIVES_",), OMP_NUM_THREADS=1)
    start = time.monotonic()
    rc, out, err = bounded(cmd, f"torchrun --nproc_per_node {nproc}", RUN_LIMIT_S, env)
    wall = time.monotonic() - start
    print(f"\n[torchrun] --nproc_per_node {nproc} {' '.join(worker_args)}: exit {rc}, {wall:.1f}s wall")
    return rc, out, err


def assert_refused(nproc, worker_args, rc, out, err, reason):
    assert rc != 0, (out, err)
    assert "DONE" not in out, (out, err)
    # (no "ValueError: " before it: the workers share one stderr, and a traceback's last line is written in
    # pieces that interleave, "ValueErrorValueError: : init_process_group(...)", the messages each whole)
    refusals = re.findall(r"init_process_group\('collectives'\) under torchrun: torch has rank (\d+) "
                          rf"of {nproc}, but this process is not in an MPI job of {nproc} \(MPI sees 1 process\): "
                          rf"{reason}", err)
    # torchrun stops the other workers once one fails: at least one worker reports it, each one once
    assert refusals and len(set(refusals)) == len(refusals), err[-6000:]
    command = shlex.join([str(WORKER), *worker_args])  # the script and its arguments
    assert f"`mpiexec -n {nproc} python {command}`" in err, err[-6000:]
    assert "docs/torchrun.md" in err, err[-6000:]


@pytest.mark.parametrize("nproc", [2, 3])
def test_torchrun_joins_its_workers_into_one_mpi_job_or_says_why_not(nproc):
    if mpi_implementation() not in PMI1 and nproc > 2:
        pytest.skip("refused at any size: 2 workers show it (each torchrun job costs CI seconds)")
    rc, out, err = torchrun(nproc)
    if mpi_implementation() in PMI1:
        assert rc == 0, (out, err[-6000:])
        assert sorted(re.findall(r"DONE (\d+) (\d+)\b", out)) == [(str(r), str(nproc)) for r in range(nproc)], \
            (out, err[-6000:])
    else:
        assert_refused(nproc, [], rc, out, err, "torchrun's workers join one MPI job through the PMI protocol of "
                                                 "MPICH")


@pytest.mark.parametrize(("args", "reason"), [
    (["collectives://"], "the collectives backend joins torchrun's workers into one MPI job only through torch's "
                         "own rendezvous"),
    (["--mpi-first"], "MPI was already running in this process"),
])
def test_torchrun_refuses_what_cannot_join(args, reason):
    if mpi_implementation() not in PMI1:
        pytest.skip(f"{mpi_implementation()}: every torchrun job of several workers is refused (the test above)")
    rc, out, err = torchrun(2, *args)
    assert_refused(2, args, rc, out, err, re.escape(reason))


def test_an_uncaught_exception_in_a_torchrun_worker_ends_the_job():
    """The failing worker's MPI_Abort reaches the PMI server, which ends every worker of the job (as mpiexec
    would): none is left waiting in its all_reduce."""
    if mpi_implementation() not in PMI1:
        pytest.skip(f"{mpi_implementation()}: a torchrun job of several processes is refused")
    rc, out, err = torchrun(2, "--raise")
    assert rc != 0 and "SURVIVED" not in out, (out, err[-6000:])
    assert "collectives: rank 1 of 2 failed with ValueError: boom from rank 1" in err, err[-6000:]
    assert "aborting all 2 ranks" in err, err[-6000:]


def test_torchrun_of_one_process_is_a_group_of_one():
    rc, out, err = torchrun(1)
    assert rc == 0, (out, err[-6000:])
    assert re.findall(r"DONE (\d+) (\d+)\b", out) == [("0", "1")], (out, err[-6000:])

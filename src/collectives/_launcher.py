"""MPI launchers: which one started this process, and how to start a job the same way under any of them.

Three launchers start our users' jobs, and they differ where a harness (our test runner, the crash suite,
the conformance runner) must care:

============  =================================  ==================================================
launcher      comes with                         differences that matter here
============  =================================  ==================================================
Hydra         MPICH (the ``mpich`` wheel),       oversubscribes freely; runs as root; passes the
              Intel MPI, MVAPICH                 whole environment to every rank
PRRTE         Open MPI 5 (``mpiexec``,           refuses more ranks than cores (``--map-by
              ``mpirun``, ``prterun``)           :OVERSUBSCRIBE``) and root (``--allow-run-as-root``
                                                 or ``OMPI_ALLOW_RUN_AS_ROOT=1`` with
                                                 ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``); ``-x NAME``
                                                 forwards a variable to remote nodes
Slurm         ``srun`` on a cluster              the allocation decides; nothing to add
============  =================================  ==================================================

:func:`job_command` and :func:`job_environment` are the one place our harnesses build an ``mpiexec``
command line and its environment; :func:`started_by` and :func:`implementation` feed
``python -m collectives info``. Nothing here imports mpi4py.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

HYDRA, PRRTE, SLURM = "Hydra", "PRRTE", "Slurm"

# Variables a launcher sets in each rank it starts (a harness running inside a rank must not pass them
# on: the nested mpiexec would think it is part of the outer job) ...
_JOB_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "PRTE_", "OPAL_", "MPI_LOCAL", "HYDRA_", "HYDI_", "SLURM_",
                 "MV2_", "PALS_")
# ... except the settings a user gives Open MPI and PRRTE: running as root, MCA parameters.
_KEEP = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
_KEEP_INFIXES = ("_MCA_",)
_PER_JOB_MCA = ("OMPI_MCA_num_procs", "OMPI_MCA_initial_wdir", "OMPI_MCA_cpu_type", "OMPI_MCA_PREFIXES")


def find_mpiexec() -> str | None:
    """The ``mpiexec`` next to this Python (a virtualenv's MPI wheel), else the first on ``PATH``."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


@functools.lru_cache(maxsize=8)
def kind(mpiexec: str) -> str | None:
    """Which launcher ``mpiexec`` is (:data:`HYDRA`, :data:`PRRTE` or :data:`SLURM`), from its
    ``--version``; None if it cannot tell (then no launcher-specific flag is added)."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (out.stdout + out.stderr).lower()
    if "hydra" in text:
        return HYDRA
    if "open mpi" in text or "prrte" in text or "prterun" in text:
        return PRRTE
    if "slurm" in text:
        return SLURM
    return None


def job_command(n: int, argv, *, mpiexec: str | None = None, forward=()) -> list[str]:
    """The command that starts ``argv`` on ``n`` ranks of this machine with ``mpiexec`` (default
    :func:`find_mpiexec`), whatever launcher it is: under PRRTE, oversubscription when ``n`` exceeds the
    cores, ``--allow-run-as-root`` as root, and ``-x NAME`` for every name in ``forward``.

    Example:
        >>> cmd = job_command(2, ["python", "-c", "pass"], mpiexec="/nonexistent/mpiexec")
        >>> cmd[1:]
        ['-n', '2', 'python', '-c', 'pass']
    """
    exe = mpiexec or find_mpiexec() or "mpiexec"
    cmd = [exe, "-n", str(n)]
    if kind(exe) == PRRTE:
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if n > (os.cpu_count() or 1):
            cmd += ["--map-by", ":OVERSUBSCRIBE"]
        for name in forward:
            cmd += ["-x", name]
    return cmd + [str(a) for a in argv]


def job_environment(base=None, *, drop=(), **extra) -> dict:
    """``base`` (default ``os.environ``) for a new job: without the variables a launcher set in this
    process (so a harness that runs inside a rank starts a job of its own), keeping the user's launcher
    settings (``OMPI_ALLOW_RUN_AS_ROOT*``, ``OMPI_MCA_*``, ``PRTE_MCA_*``, ``PMIX_MCA_*``); without
    variables starting with a prefix in ``drop``; then ``extra`` added (values as strings).

    Example:
        >>> env = job_environment({"PMI_RANK": "1", "OMPI_MCA_op": "^avx", "COLLECTIVES_CHECK": "1",
        ...                        "HOME": "/root"}, drop=("COLLECTIVES_",), COLLECTIVES_TIMEOUT=3)
        >>> sorted(env.items())
        [('COLLECTIVES_TIMEOUT', '3'), ('HOME', '/root'), ('OMPI_MCA_op', '^avx')]
    """
    env = {}
    for k, v in (os.environ if base is None else base).items():
        if k.startswith(tuple(drop)):
            continue
        if k.startswith(_JOB_PREFIXES) and not (
                k in _KEEP or (any(i in k for i in _KEEP_INFIXES) and k not in _PER_JOB_MCA)):
            continue
        env[k] = v
    env.update({k: str(v) for k, v in extra.items()})
    return env


def started_by(environ=None) -> str | None:
    """The launcher that started this process (:data:`HYDRA`, :data:`PRRTE`, :data:`SLURM`), from the
    variables it sets in each rank; None for a plain ``python``."""
    env = os.environ if environ is None else environ
    if "HYDI_CONTROL_FD" in env or ("PMI_RANK" in env and "PMI_FD" in env):
        return HYDRA
    if "PRTE_LAUNCHED" in env or "OMPI_COMM_WORLD_SIZE" in env or env.get("PMIX_NAMESPACE", "").startswith("prterun"):
        return PRRTE
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return SLURM
    return None


def implementation(library_version: str) -> str:
    """The MPI implementation's name from ``MPI_Get_library_version``'s text.

    Example:
        >>> implementation("Open MPI v5.0.11, package: Open MPI user@localhost Distribution")
        'Open MPI'
        >>> implementation("MPICH Version:      5.0.2")
        'MPICH'
    """
    text = library_version.lower()
    for needle, name in (("open mpi", "Open MPI"), ("intel", "Intel MPI"), ("mvapich", "MVAPICH"),
                         ("microsoft", "Microsoft MPI"), ("mpich", "MPICH")):
        if needle in text:
            return name
    return library_version.strip().splitlines()[0] if library_version.strip() else "unknown"

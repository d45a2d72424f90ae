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

from . import _config

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
    """``base`` (default: this process's environment) for a new job: without the variables a launcher set
    in this process (so a harness that runs inside a rank starts a job of its own), keeping the user's launcher
    settings (``OMPI_ALLOW_RUN_AS_ROOT*``, ``OMPI_MCA_*``, ``PRTE_MCA_*``, ``PMIX_MCA_*``); without
    variables starting with a prefix in ``drop``; then ``extra`` added (values as strings).

    Example:
        >>> env = job_environment({"PMI_RANK": "1", "OMPI_MCA_op": "^avx", "COLLECTIVES_CHECK": "1",
        ...                        "HOME": "/root"}, drop=("COLLECTIVES_",), COLLECTIVES_TIMEOUT=3)
        >>> sorted(env.items())
        [('COLLECTIVES_TIMEOUT', '3'), ('HOME', '/root'), ('OMPI_MCA_op', '^avx')]
    """
    env = {}
    for k, v in (_config.environment() if base is None else base).items():
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
    env = _config.environment() if environ is None else environ
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


# ---- a PMI-1 server: torchrun's workers as one MPI job (MPICH and the MPIs built on it) ---------------------
# MPICH's processes learn their rank and size and exchange their addresses through PMI, the protocol its
# launcher (Hydra) serves. torchrun serves none, so each of its workers would be an MPI job of one process
# (docs/torchrun.md). A worker given ``PMI_FD`` (a connected socket), ``PMI_RANK`` and ``PMI_SIZE`` before MPI
# starts speaks PMI-1 ("simple PMI") over that socket instead: the server below answers for one job of
# ``size`` processes on one node (the key-value space, its barrier, the process mapping), and exits when every
# process has finalized or gone. Open MPI speaks PMIx and ignores these variables.

def pmi_server(size: int, kvsname: str, ready=None, parent: int | None = None) -> None:
    """Serve the PMI-1 wire protocol to ``size`` processes on one node, on a TCP port of the loopback
    interface whose number is written (one line) to ``ready`` (default stdout); return once every process has
    finalized or closed its connection, or 10 s after the process ``parent`` has gone.

    Example:
        >>> import socket, threading, io, time
        >>> out = io.StringIO()
        >>> t = threading.Thread(target=pmi_server, args=(1, "job"), kwargs={"ready": out}); t.start()
        >>> while not out.getvalue(): time.sleep(0.01)
        >>> s = socket.create_connection(("127.0.0.1", int(out.getvalue())))
        >>> _ = s.sendall(b"cmd=init pmi_version=1 pmi_subversion=1\\ncmd=get_my_kvsname\\ncmd=finalize\\n")
        >>> f = s.makefile(); [f.readline().split()[0] for _ in range(3)]
        ['cmd=response_to_init', 'cmd=my_kvsname', 'cmd=finalize_ack']
        >>> t.join(5); s.close(); t.is_alive()
        False
    """
    import contextlib
    import signal
    import socket
    import threading
    import time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(size)
    print(listener.getsockname()[1], file=ready or sys.stdout, flush=True)
    kvs: dict[str, str] = {}
    pids: list[int] = []
    state = threading.Condition()
    arrived, generation, finished = [0], [0], [0]
    mapping = f"(vector,(0,1,{size}))"  # one node, every process on it

    def reply(out, text: str) -> None:
        out.write(text + "\n")
        out.flush()

    def serve(conn) -> None:
        try:
            lines, out = conn.makefile("r"), conn.makefile("w")
            for line in lines:
                words = dict(w.split("=", 1) for w in line.split() if "=" in w)
                cmd = words.get("cmd")
                if cmd == "init":
                    reply(out, "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1")
                elif cmd == "get_maxes":
                    reply(out, "cmd=maxes rc=0 kvsname_max=256 keylen_max=256 vallen_max=1024")
                elif cmd == "get_universe_size":
                    reply(out, f"cmd=universe_size rc=0 size={size}")
                elif cmd == "get_appnum":
                    reply(out, "cmd=appnum rc=0 appnum=0")
                elif cmd == "get_my_kvsname":
                    reply(out, f"cmd=my_kvsname rc=0 kvsname={kvsname}")
                elif cmd == "put":
                    with state:
                        kvs[words.get("key", "")] = words.get("value", "")
                    reply(out, "cmd=put_result rc=0")
                elif cmd == "get":
                    key = words.get("key", "")
                    with state:
                        value = mapping if key == "PMI_process_mapping" else kvs.get(key)
                    reply(out, "cmd=get_result rc=-1 msg=key_not_found" if value is None else
                          f"cmd=get_result rc=0 value={value}")
                elif cmd == "barrier_in":
                    with state:
                        mine = generation[0]
                        arrived[0] += 1
                        if arrived[0] == size:
                            arrived[0], generation[0] = 0, mine + 1
                            state.notify_all()
                        while generation[0] == mine:
                            state.wait()
                    reply(out, "cmd=barrier_out rc=0")
                elif cmd == "finalize":
                    reply(out, "cmd=finalize_ack rc=0")
                    break
                elif cmd == "abort":  # MPI_Abort ends the whole job, as a launcher ends it: every process
                    for pid in pids:
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGKILL)
                    break
                elif cmd == "pid":  # our own first line (pmi_connect): which process is at this end
                    pids.append(int(words.get("pid", "0")))
                elif cmd:
                    reply(out, f"cmd={cmd} rc=-1 msg=unsupported")
        except OSError:
            pass  # the process went away
        finally:
            conn.close()
            with state:
                finished[0] += 1
                state.notify_all()

    listener.settimeout(1.0)
    accepted, gone_since = 0, None
    while True:
        if parent is not None and gone_since is None and not _alive(parent):
            gone_since = time.monotonic()
        if gone_since is not None and time.monotonic() - gone_since > 10:
            return
        if accepted < size:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            accepted += 1
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
            continue
        with state:
            if finished[0] == size:
                return
            state.wait(1.0)


def pmi_connect(port: int, timeout: float) -> int:
    """A socket connected to :func:`pmi_server` on this machine, introduced with this process's id (so that
    an ``MPI_Abort`` can end every process of the job); its descriptor, for ``PMI_FD``."""
    import socket

    connection = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    connection.settimeout(None)
    connection.sendall(f"cmd=pid pid={os.getpid()}\n".encode())
    return connection.detach()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

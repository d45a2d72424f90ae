"""The rendezvous of the torch backend: rank and size from MPI, a store without a server (``_store``),
``env://`` wrapped to take MPI's ranks where torch would need ``MASTER_ADDR`` (``_wrap_env``), and the
joining of torchrun's workers into one MPI job (``_join_torchrun_workers``). The precedence is written in
the package's docstring."""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import sys
import tempfile
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

import collectives as _coll

from .. import _agree, _config, _launcher

SCHEME = "collectives"  # init_method="collectives://": MPI's ranks, the store below


class _UnsharedStore(dist.Store):
    """The store of a job on several nodes: nothing the backend needs, refused clearly on use."""

    def set_timeout(self, timeout):
        pass

    def _refuse(self, *args, **kwargs):
        raise RuntimeError("the collectives backend's store is not shared across nodes (it needs no store itself): "
                           "something asked it for a key (TORCH_DIST_INIT_BARRIER=1, or a gloo/NCCL group on the "
                           "same job). Pass init_method='tcp://...' or 'file://<shared path>' to init_process_group "
                           "for a store shared by every node")

    set = get = add = compare_set = wait = check = delete_key = num_keys = multi_get = multi_set = _refuse


_OPEN: list = []  # rank 0's descriptors of its store files, held to the end of the process


def _store(comm, timeout):
    if comm.size == 1:
        return dist.HashStore()
    if comm.local_size == comm.size:  # one node: a FileStore rank 0 makes, named over MPI
        path = _store_file(comm)
        store = dist.FileStore(path, comm.size)
        store.set_timeout(timeout)
        return store
    return _UnsharedStore()


def _store_file(comm) -> str:
    """The path of the job's FileStore, one no crash leaves behind: rank 0 makes a file in the temporary
    directory, keeps it open and removes its name once every rank can reach it as
    ``/proc/<rank 0's pid>/fd/<n>``; the kernel frees it when rank 0's process ends, however it ends
    (exit, ``MPI_Abort``, SIGKILL). Where the other ranks cannot see rank 0's ``/proc`` (another pid
    namespace, no procfs), the named file is used, removed at exit (not after a kill)."""
    names = None
    if comm.rank == 0:
        fd, name = tempfile.mkstemp(prefix="collectives-torch-store-")
        _OPEN.append(fd)
        names = (name, f"/proc/{os.getpid()}/fd/{fd}")
    name, proc = comm.broadcast_object(names, root=0)
    if all(_agree.gather(comm, os.access(proc, os.R_OK | os.W_OK))):  # every rank takes the same branch
        if comm.rank == 0:
            _unlink(name)  # every rank reaches the file through rank 0's descriptor: no name left
        return proc
    if comm.rank == 0:
        atexit.register(_unlink, name)
    return name


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _query(url: str) -> dict:
    return dict(p.split("=", 1) for p in urlparse(url).query.split("&") if "=" in p)


def _mpi_job(url: str):
    """The world communicator, after checking that a rank or size given to torch (``rank=``/``world_size=``
    in the URL, or ``WORLD_SIZE`` in the environment) is MPI's."""
    comm = _coll.init()
    query = _query(url)
    launch = _config.torch_launch()
    given = {"rank": query.get("rank"), "world_size": query.get("world_size", launch.get("WORLD_SIZE"))}
    if comm.size == 1 and _config.torchrun_run_id() is not None and int(given["world_size"] or 1) > 1:
        raise ValueError(_torchrun_refusal(int(given["rank"] or launch.get("RANK") or 0),
                                           int(given["world_size"] or 1), "mpi"))
    for key, ours in (("rank", comm.rank), ("world_size", comm.size)):
        text = given[key]
        value = int(text) if text else -1
        if value not in (-1, ours):
            raise ValueError(f"init_process_group: {key}={value} was given (argument or environment variable "
                             f"{key.upper()}), but MPI says {ours}: the collectives backend takes ranks from the "
                             f"MPI job; drop {key}= (and {key.upper()}) or launch with mpiexec/srun")
    return comm


def _mpi_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
    """A torch rendezvous handler: ``(store, rank, size)`` from MPI (see the module)."""
    comm = _mpi_job(url)
    yield _store(comm, timeout), comm.rank, comm.size
    raise RuntimeError("the collectives rendezvous cannot re-rendezvous (the MPI job is fixed)")


def _with_mpi_ranks(url: str) -> str:
    """``url`` with MPI's rank and size in its query, for torch's ``env://`` handler (which then reads
    only ``MASTER_ADDR``/``MASTER_PORT`` from the environment)."""
    comm = _mpi_job(url)
    parts = urlparse(url)
    query = {**_query(url), "rank": str(comm.rank), "world_size": str(comm.size)}
    return parts._replace(query="&".join(f"{k}={v}" for k, v in query.items())).geturl()


def _rendezvous_kind(url: str) -> str:
    """Which rendezvous ``env://`` takes (the precedence in the module's docstring): ``"torch"`` (torch's
    own, unchanged), ``"mpi+tcp"`` (MPI's ranks, torch's TCPStore at MASTER_ADDR) or ``"mpi"``."""
    launch = _config.torch_launch()
    master = "MASTER_ADDR" in launch and "MASTER_PORT" in launch
    rank_known = "rank" in _query(url) or "RANK" in launch
    if master and rank_known:
        return "torch"  # torchrun's form: torch's env:// (a TCPStore), as without this module
    if master:  # MASTER_ADDR without RANK: ranks from the MPI launcher that started us, if one did
        return "mpi+tcp" if _launcher.started_by() is not None else "torch"
    return "mpi"


def _wrap_env(original):
    def env_or_mpi(url: str, **kwargs):
        kind = _rendezvous_kind(url)
        if kind == "torch":
            return original(url, **kwargs)
        if kind == "mpi+tcp":  # e.g. accelerate launch --mpirun_hostfile: MASTER_ADDR/PORT but no RANK
            return original(_with_mpi_ranks(url), **kwargs)
        return _mpi_rendezvous(url, **kwargs)

    # a marker on the function c10d's handler table holds (installing twice must not wrap twice); mypy
    # knows no attributes of a function
    env_or_mpi._collectives_wraps = original  # type: ignore[attr-defined]
    return env_or_mpi



_PMI_SERVERS: list = []  # the PMI server this process started (rank 0 of a torchrun job), kept until exit


def _join_torchrun_workers(options) -> str | None:
    """Under torchrun, before MPI starts: make its workers one MPI job by serving them PMI-1 (the protocol
    of MPICH's launcher; ``_launcher.pmi_server``), rank 0 starting the server and every worker finding it
    through torch's store. Returns None where this does not apply (not torchrun, one process, an MPI
    launcher), ``"pmi"`` once the workers' PMI variables are set, or why it cannot be done: ``"nodes"``
    (workers on several machines), ``"initialized"`` (MPI already runs in this process)."""
    rank, size = options.group_rank, options.group_size
    if size == 1 or _config.torchrun_run_id() is None or _launcher.started_by() is not None:
        return None
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        return "initialized"
    import socket
    import subprocess

    store, timeout = options.store, options.timeout.total_seconds()
    store.set(f"collectives/pmi/host/{rank}", socket.gethostname())
    if len({store.get(f"collectives/pmi/host/{r}").decode() for r in range(size)}) > 1:
        return "nodes"
    if rank == 0:
        code = ("import sys; from collectives._launcher import pmi_server; "
                "pmi_server(int(sys.argv[1]), sys.argv[2], parent=int(sys.argv[3]))")
        server = subprocess.Popen([sys.executable, "-c", code, str(size), f"torchrun-{os.getpid()}",
                                   str(os.getpid())], stdout=subprocess.PIPE, text=True)
        _PMI_SERVERS.append(server)
        port = server.stdout.readline().strip() if server.stdout else ""
        if not port.isdigit():
            raise RuntimeError(f"init_process_group('collectives') under torchrun: the PMI server did not start "
                               f"(exit status {server.poll()}); launch with mpiexec instead (docs/torchrun.md)")
        store.set("collectives/pmi/port", port)
    fd = _launcher.pmi_connect(int(store.get("collectives/pmi/port")), timeout)
    _config.set_pmi_client(fd, rank, size)  # the descriptor now belongs to MPI
    return "pmi"


def _torchrun_refusal(rank: int, size: int, why: str = "mpi") -> str:
    """The error of a torchrun worker that is not in an MPI job of torch's size (docs/torchrun.md)."""
    script = shlex.join(sys.argv) if sys.argv and sys.argv[0] else "script.py"  # the command line torchrun ran
    reason = {
        "pmi": "torchrun's workers join one MPI job through the PMI protocol of MPICH (and of the MPIs built on "
               "it), which this MPI does not speak (Open MPI speaks PMIx: it needs its own launcher)",
        "nodes": "the collectives backend joins torchrun's workers into one MPI job on one machine only, and "
                 "these run on several",
        "initialized": "MPI was already running in this process (collectives.init() or `from mpi4py import MPI` "
                       "before init_process_group), as a job of one process; under torchrun call "
                       "init_process_group first",
        "mpi": "the collectives backend joins torchrun's workers into one MPI job only through torch's own "
               "rendezvous (leave init_method unset)",
    }[why]
    return (f"init_process_group('collectives') under torchrun: torch has rank {rank} of {size}, but this process "
            f"is not in an MPI job of {size} (MPI sees 1 process): {reason}. Start the same script with MPI's "
            f"launcher instead, `mpiexec -n {size} python {script}` (no RANK, WORLD_SIZE or MASTER_ADDR needed; "
            f"on several nodes add a hostfile, or use srun). docs/torchrun.md gives the mpiexec form of each "
            f"torchrun flag")


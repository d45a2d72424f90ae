"""Making transports: the one place that knows every transport class.

:func:`host_transport` makes a communicator's host transport (``init``); :func:`device_transport` the
transport of one CUDA device, chosen by every rank together from what each rank knows (the rules are in
``cuda``: ``local_facts``, ``decide``). Transports themselves import only their base classes and the
bottom layer (errors, config, dtypes, the agreement protocol), never each other.
"""

from __future__ import annotations

from .. import _agree, _config
from .._errors import BackendUnavailableError
from .base import HostTransport
from . import cuda
from .cuda import (CUDA_AWARE_MPI, NCCL, CudaAwareMPITransport, HostStagingTransport, decide,
                   local_facts, staging_warning_due, warn_staging)
from .device import DeviceTransport
from .self import SelfTransport


def _mpi_transport(comm):
    """The MPI transport: with a deadline on every call where ``COLLECTIVES_TIMEOUT`` is set (read once,
    here), so that the plain transport's calls stay plain."""
    from .mpi import DeadlineMPITransport, MPITransport  # imports mpi4py: only when MPI is asked for

    try:
        timeout = _config.timeout()
    except ValueError:  # malformed: refused on every rank as the transport is made, once the ranks can agree
        timeout = None
    return MPITransport(comm) if timeout is None else DeadlineMPITransport(comm, timeout)


def host_transport(backend: str, comm) -> HostTransport:
    """The host transport for ``init(backend, comm=comm)``: MPI (``mpi``), one process (``self``), or
    MPI when it works and one process when it does not (``auto``, refused under a multi-process launcher)."""
    if backend == "self":
        if comm is not None:
            raise ValueError("backend='self' is a single process and takes no comm=; use backend='mpi'")
        return SelfTransport()
    if backend == "mpi":
        return _mpi_transport(comm)
    # auto
    try:
        transport = _mpi_transport(comm)
    except BackendUnavailableError as exc:
        if comm is not None:
            raise
        launched = _config.launcher_size()
        if launched is not None:
            name, n = launched
            raise BackendUnavailableError(
                f"this process was started by a launcher for {n} processes ({name}={n}), but MPI cannot be "
                f"used ({exc}); refusing to run {n} independent single-process copies. Install mpi4py "
                f"for the launcher's MPI (pip install 'collectives-py[mpi]', or build mpi4py against your "
                f"cluster's MPI), or set COLLECTIVES_BACKEND=self to really run alone"
            ) from exc
        return SelfTransport()
    launched = _config.launcher_size()
    if comm is None and transport.size == 1 and launched is not None:
        name, n = launched
        transport.close()
        raise BackendUnavailableError(
            f"this process was started by a launcher for {n} processes ({name}={n}), but MPI's world has "
            f"1 process: mpi4py's MPI library is not the launcher's. Launch with the mpiexec that belongs to "
            f"mpi4py's MPI (python -m collectives info shows it), or rebuild mpi4py against the launcher's"
        )
    return transport



def device_transport(engine, device) -> DeviceTransport:
    """The device transport for CUDA ``device`` on the communicator of ``engine`` (its
    :class:`~collectives._comm.Engine`; collective: every rank calls it, once)."""
    index = int(device[1])
    facts, failure = local_facts(engine, index)
    everyone = _agree.gather(engine.host, facts)  # then every rank decides alike, from the same list
    try:
        name = decide(everyone, mpi=engine.host.name == "mpi", device=f"cuda:{index}")
    except BackendUnavailableError as exc:
        if failure is not None:
            raise exc from failure
        raise
    if name == NCCL:
        from . import _libnccl
        from .nccl import NCCLTransport

        return NCCLTransport(engine, index, _libnccl.get(), cuda.device_api(), timeout=everyone[engine.rank]["timeout"])
    if staging_warning_due(False, everyone[engine.rank].get("cuda_aware"), mpi=engine.host.name == "mpi"):
        why = next((f["nccl_why"] for f in everyone if f["nccl_why"]), "not loadable")
        warn_staging(why.splitlines()[0])
    if name == CUDA_AWARE_MPI:
        return CudaAwareMPITransport(engine, index)
    return HostStagingTransport(engine, index)

"""The MPI transport (mpi4py), for host memory.

The library never talks on the user's communicator: it works on its own duplicate. MPI is initialised
here only if nobody did it before, at the thread level chosen in ``COLLECTIVES_MPI_THREAD_LEVEL``.

With ``COLLECTIVES_TIMEOUT`` set (read once, when the transport is made), the factory
(``factory.host_transport``) makes a :class:`DeadlineMPITransport` instead: the same operations through
MPI's non-blocking collectives, polled until they complete or the deadline passes (then
:class:`CollectiveTimeoutError`). Without it the plain blocking calls run and nothing is added per call.

The modules, by job: ``ops`` (the table: one row per MPI operation, from which every call of it is
made), ``transport`` (:class:`MPITransport`), ``deadline`` (:class:`DeadlineMPITransport`), the
transport's parts ``fast`` (the hot path's closures), ``shared`` (the node-shared-memory allreduce),
``lanes`` (a communicator per kind of collective, and the fingerprints), ``requests`` (the non-blocking
calls' requests), ``p2p`` (send and receive) and ``pipeline`` (``broadcast_many``), and ``library``
(importing MPI, its datatypes and ops, the probe of faulty ops, the settings every rank agrees on).
"""

from __future__ import annotations

from .deadline import DeadlineMPITransport
from .library import (DEFAULT_MAX_COUNT, PROBE_COUNT, PROBED_OPS, _agreed_settings, _tables, _warned, faulty_ops,
                      import_mpi)
from .ops import OPERATIONS, Operation
from .pipeline import _overlapping
from .transport import MPITransport

__all__ = ["DEFAULT_MAX_COUNT", "OPERATIONS", "PROBED_OPS", "PROBE_COUNT", "DeadlineMPITransport", "MPITransport",
           "Operation", "_agreed_settings", "_overlapping", "_tables", "_warned", "faulty_ops", "import_mpi"]

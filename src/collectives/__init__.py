"""collectives: collective communication for data-parallel training, on any array-API array.

>>> import numpy as np, collectives as coll
>>> comm = coll.init()                          # MPI under mpiexec, else a single process
>>> x = np.ones(3) * comm.rank
>>> _ = coll.allreduce(x, op="mean")            # in place on NumPy and torch arrays

Host arrays travel over MPI (mpi4py); the transport is chosen from the array's device.
"""

from ._comm import (
    Communicator,
    allgather,
    allgather_object,
    allreduce,
    allreduce_tree,
    allreduce_units,
    alltoall,
    barrier,
    broadcast,
    broadcast_object,
    finalize,
    gather,
    init,
    recv,
    reduce,
    reduce_scatter,
    send,
    synchronize,
    world,
)
from ._errors import (
    BackendUnavailableError,
    CollectiveError,
    CollectiveTimeoutError,
    MismatchError,
    NcclError,
    NonFiniteError,
)
from ._handles import Handle
from ._optim import DistributedOptimizer
from ._shard import shard
from ._trace import dump_trace
from ._version import __version__

__all__ = [
    "BackendUnavailableError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "Communicator",
    "DistributedOptimizer",
    "Handle",
    "MismatchError",
    "NcclError",
    "NonFiniteError",
    "__version__",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_tree",
    "allreduce_units",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "dump_trace",
    "finalize",
    "gather",
    "init",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
    "shard",
    "synchronize",
    "world",
]

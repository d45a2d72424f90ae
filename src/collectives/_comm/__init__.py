"""The call engine: communicators and the array collectives.

A :class:`Communicator` is a group of processes that call collectives together. :func:`init` makes one
(over MPI when it works, else the single-process ``"self"`` backend); :func:`world` returns the default
one. Every collective is both a method (``comm.allreduce(x)``) and a function (``allreduce(x, comm=comm)``).

How a call runs:

1. validate everything (kind of array, op, dtype/op pair, root) before any communication (``validate``);
2. choose the transport from the array's device (``Communicator._transport_for``, the only place: ``call``);
3. take a NumPy view of the array's memory (``_arrays``), make it contiguous if it is not (``steps``);
4. move or reduce the bytes, widening dtypes the transport cannot reduce (float16, bfloat16: ``rules``);
5. write the result back into the caller's array when it is writable, else return a new array.

The modules, from the bottom: ``steps`` (a collective's steps, the blocking driver), ``record`` (the
flight recorder's side), ``validate``, ``rules`` (reductions under the host rules), ``summing``
(reproducible sums), ``call`` (the drivers, the transport choice, the hot path's tables, ``close``), one
module per kind of collective (``reductions``, ``movement``, ``p2p``, ``objects``, ``split``, ``trees``),
``engine`` (what the layers above may use), ``communicator``, and ``functions`` (``init``/``world``/
``finalize`` and the collectives as functions).
"""

from .communicator import Communicator
from .engine import Engine, engine_of
from .functions import (
    allgather,
    allgather_object,
    allreduce,
    allreduce_tree,
    allreduce_units,
    alltoall,
    barrier,
    broadcast,
    broadcast_object,
    gather,
    recv,
    reduce,
    reduce_scatter,
    send,
    synchronize,
)
from .functions import BACKENDS, finalize, init, world
from .functions import _resolve as _resolve  # (for the layers above: the communicator of a call)

__all__ = [
    "BACKENDS",
    "Communicator",
    "Engine",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_tree",
    "allreduce_units",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "engine_of",
    "finalize",
    "gather",
    "init",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
    "synchronize",
    "world",
]

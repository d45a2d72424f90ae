"""The collectives that move data unchanged: ``broadcast``, ``allgather``, ``gather``, ``alltoall``, each as its
steps (validation, one step per transfer, the result), and ``Communicator.barrier``.

As in ``reductions``: the Communicator's methods run the steps, blocking or in a Handle; the hot-path
entries of ``broadcast``, ``allgather`` and ``alltoall`` are in their methods themselves.
"""

from __future__ import annotations

import numpy as np

from .. import _agree, _arrays
from .._threads import collective
from . import call, validate
from .record import traced
from .steps import BARRIER, Step, contiguous, placing, writing


def broadcast(comm, x, root, asynchronous: bool):
    a, transport, view, info, _, root = validate.prepare(comm, "broadcast", x, root=root, asynchronous=asynchronous)
    if transport.array_level:
        return a.written(x, (yield Step(transport, "broadcast", (x, a, root), device=True)))
    buf, place = placing(x, a, view, info)
    run = None if asynchronous else (transport.fast_call("broadcast", view.dtype, comm._size)
                                     or transport.broadcast)
    used = yield Step(transport, "broadcast", (buf, root), run)
    if used is not None:
        comm._fast_path("broadcast", x, a, view, info, used)
    return place()


def allgather(comm, x, asynchronous: bool, out=None):
    a, transport, view, info, _, _ = validate.prepare(comm, "allgather", x, asynchronous=asynchronous, out=out)
    if transport.array_level:
        got = yield Step(transport, "allgather", (x, a), device=True)
        return got if out is None else a.assign(out, got)
    size = comm._size
    send = contiguous(view)
    if out is None:
        buf = np.empty((size,) + view.shape, dtype=view.dtype)
    else:
        buf, place = writing(out, a)
        if np.may_share_memory(send, buf):  # x inside out (FSDP's x = out[rank]): MPI takes no overlap
            send = send.copy()
    run = None if asynchronous else (transport.fast_blocks("allgather", None, view.dtype, size)
                                     or allgather_blocks(transport, size))
    used = yield Step(transport, "allgather", (send, buf.reshape(size, -1)), run)
    if used is not None:
        comm._fast_path(("allgather", view.dtype), x, a, view, info, used, comm._fast_blocks)
    elif asynchronous:  # completed: its transfer for the asynchronous hot path (call.cache_start)
        comm._fast_path(("allgather", view.dtype), x, a, view, info, None, starts=transport)
    return a.wrap(buf, info, x) if out is None else place()


def allgather_blocks(transport, size: int):
    """``transport.allgather`` on ``(send, out)`` of any shape (it takes ``out`` as ``(size, n)``)."""
    return lambda send, out: transport.allgather(send, out.reshape(size, -1))


def gather(comm, x, root, asynchronous: bool):
    a, transport, view, info, _, root = validate.prepare(comm, "gather", x, root=root, asynchronous=asynchronous)
    if transport.array_level:
        return (yield Step(transport, "gather", (x, a, root), device=True))
    out = np.empty((comm.size,) + view.shape, dtype=view.dtype) if comm.rank == root else None
    yield Step(transport, "gather", (contiguous(view), None if out is None else out.reshape(comm.size, -1),
                                     root))
    return None if out is None else a.wrap(out, info, x)


def alltoall(comm, x, asynchronous: bool):
    a, transport, view, info, _, _ = validate.prepare(comm, "alltoall", x, blocks=True, asynchronous=asynchronous)
    if transport.array_level:
        return (yield Step(transport, "alltoall", (x, a), device=True))
    size = comm._size
    out = np.empty(view.shape, dtype=view.dtype)
    run = None if asynchronous else (transport.fast_blocks("alltoall", None, view.dtype, size)
                                     or alltoall_blocks(comm, transport))
    used = yield Step(transport, "alltoall", (contiguous(view).reshape(size, -1), out.reshape(size, -1)), run)
    if used is not None:
        comm._fast_path(("alltoall", view.dtype), x, a, view, info, used, comm._fast_blocks)
    return a.wrap(out, info, x)


def alltoall_blocks(comm, transport):
    """``transport.alltoall`` on ``(send, out)`` of any shape (it takes ``(size, n)`` layouts)."""
    size = comm._size
    return lambda send, out: transport.alltoall(send.reshape(size, -1), out.reshape(size, -1))


@collective("barrier")
@traced("barrier")
def barrier(comm) -> None:
    """Block until every rank has called it. See :func:`collectives.barrier`. (``Communicator.barrier``,
    bound from here.)"""
    transport = comm._transport_for(_arrays.HOST)
    if comm._outstanding:
        call.sweep(comm)
    if comm.check:
        _agree.agree(transport, "barrier")
    transport.caller = BARRIER
    try:
        transport.barrier()
    finally:
        transport.caller = None

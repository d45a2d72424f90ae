"""The reductions: ``allreduce``, ``allreduce_units``, ``reduce``, ``reduce_scatter``, each as its steps.

Each generator validates (``validate.prepare``: ``ValueError``/``TypeError`` before any communication),
yields one step per transfer (a device transport's own call; a reduction under the host rules,
``rules.reduction``; a reproducible sum, ``summing.summing``), and returns the result. The Communicator's
methods run them: blocking (``Communicator._blocking``) or in a Handle (``_async``). The hot-path
entries of ``allreduce`` and ``reduce_scatter`` are in their methods themselves (no extra Python frame);
the steps hand the call they used to ``Communicator._fast_path`` for it (an asynchronous allreduce, once
completed, its transport: ``call.cache_start``).
"""

from __future__ import annotations

import numpy as np

from .. import _reduction
from . import rules, summing, validate
from .steps import Step, contiguous, placing, writing


def on_device(comm, transport, operation: str, x, a, op: str, *rest) -> Step:
    """The step of a reduction of ``x`` by a device transport: its ``operation``, or, for a reproducible sum
    (``comm._repro``, set by the validation), its ``reproducible`` (the host path's sum of a host copy)."""
    if comm._repro:
        return Step(transport, "reproducible", (x, a, operation, op, *rest), device=True)
    return Step(transport, operation, (x, a, op, *rest), device=True)


def allreduce(comm, x, op, reproducible, asynchronous: bool):
    a, transport, view, info, op, _ = validate.prepare(comm, "allreduce", x, op=op, asynchronous=asynchronous,
                                                       reproducible=reproducible)
    if transport.array_level:
        return a.written(x, (yield on_device(comm, transport, "allreduce", x, a, op)))
    buf, place = placing(x, a, view, info)
    if comm._repro:
        yield from summing.summing(comm, transport, "allreduce", buf.reshape(1, -1), info, op, asynchronous, out=buf,
                                   one_each=True)
        return place()
    used = yield rules.reduction(comm, transport, "allreduce", buf, info, op, asynchronous)
    if rules.cacheable(comm, info, op):
        if used is not None:
            comm._fast_path(op, x, a, view, info, used)
        elif asynchronous:  # completed: its steps for the asynchronous hot path (call.cache_start)
            comm._fast_path(op, x, a, view, info, None, starts=transport)
    return place()


def allreduce_units(comm, units, op, asynchronous: bool):
    a, transport, view, info, op, _ = validate.prepare(comm, "allreduce", units, op=op, asynchronous=asynchronous,
                                                       reproducible=True, units=True)
    if transport.array_level:
        return (yield Step(transport, "reproducible", (units, a, "allreduce_units", op), device=True))
    out = np.empty(view.shape[1:], dtype=view.dtype)
    stack = contiguous(view).reshape(view.shape[0], out.size)
    yield from summing.summing(comm, transport, "allreduce", stack, info, op, asynchronous, out=out)
    return a.wrap(out, info, units)


def reduce(comm, x, op, root, reproducible, asynchronous: bool):
    a, transport, view, info, op, root = validate.prepare(comm, "reduce", x, op=op, root=root, asynchronous=asynchronous,
                                                          reproducible=reproducible)
    if transport.array_level:
        out = yield on_device(comm, transport, "reduce", x, a, op, root)
        return a.written(x, out) if comm.rank == root else x
    receives = comm.rank == root  # the others contribute x and get it back unchanged
    buf, place = placing(x, a, view, info) if receives else (contiguous(view), None)
    if comm._repro:
        yield from summing.summing(comm, transport, "reduce", buf.reshape(1, -1), info, op, asynchronous, (root,),
                                   receives=receives, out=buf)
    else:
        used = yield rules.reduction(comm, transport, "reduce", buf, info, op, asynchronous, (root,),
                                     receives=receives)
        if used is not None and rules.cacheable(comm, info, op):  # (one call for every rank and every root)
            comm._fast_path(("reduce", op, view.dtype), x, a, view, info, used, comm._fast_blocks)
    return place() if receives else x  # type: ignore[misc]


def reduce_scatter(comm, x, op, reproducible, asynchronous: bool, into=None):
    a, transport, view, info, op, _ = validate.prepare(comm, "reduce_scatter", x, op=op, blocks=True,
                                                       asynchronous=asynchronous, reproducible=reproducible,
                                                       out=into)
    if transport.array_level:
        got = yield on_device(comm, transport, "reduce_scatter", x, a, op)
        return got if into is None else a.assign(into, got)
    size = comm._size
    send = contiguous(view)
    if into is None:
        out = np.empty((view.shape[0] // size,) + view.shape[1:], dtype=view.dtype)
        place = lambda: a.wrap(out, info, x)  # (the one result of every branch below)
    else:
        out, place = writing(into, a)
        if np.may_share_memory(send, out):  # out inside x: MPI takes no overlapping buffers
            send = send.copy()
    if comm._repro:
        yield from summing.summing(comm, transport, "reduce_scatter", send.reshape(1, -1), info, op,
                                   asynchronous, out=out)
        return place()
    if not _reduction.scatters(info, op):  # longdouble min/max: the block of an allreduce, same bits
        buf = np.array(view, order="C")
        yield rules.reduction(comm, transport, "allreduce", buf, info, op, asynchronous)
        out.reshape(-1)[...] = buf.reshape(size, -1)[comm.rank]
        return place()
    used = yield rules.reduction(comm, transport, "reduce_scatter", send, info, op, asynchronous, out=out)
    if rules.cacheable(comm, info, op):
        if used is not None:
            comm._fast_path(("reduce_scatter", op, view.dtype), x, a, view, info, used, comm._fast_blocks)
        elif asynchronous:  # completed: its transfer for the asynchronous hot path (call.cache_start)
            comm._fast_path(("reduce_scatter", op, view.dtype), x, a, view, info, None, starts=transport)
    return place()

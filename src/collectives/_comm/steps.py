"""A collective's steps: the vocabulary every collective is written in, and the blocking driver.

Each collective is one generator of :class:`Step` (validation, then one ``yield`` per transfer, then the
result): :func:`now` runs it to completion (the blocking call), ``call.requests`` in a Handle
(``async_op=True``). The small buffer helpers the steps share are here too (:func:`placing`,
:func:`contiguous`, :func:`block_for`), and :func:`described`, the hot path's cached call with its
description beside it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .. import _call


class Step(NamedTuple):
    """One transfer of a collective's steps: ``operation`` of ``transport`` on ``args`` (host buffers; for
    a device transport, ``device``: ``(x, adapter, *arguments)``). ``run``: the blocking call to make
    instead of ``transport.<operation>(*args)`` (the one the hot path caches); ``rules``: a reduction under
    the host rules, ``(info, op, extra, receives, out)``, which the asynchronous driver runs in steps."""

    transport: Any  # a HostTransport or a DeviceTransport
    operation: str
    args: tuple
    run: object = None
    rules: tuple | None = None
    device: bool = False


def now(steps, comm):
    """The blocking driver of a collective's steps: each transfer run to completion (``run``, or the
    transport's operation), the call used (or a device transport's result) sent back; the result.
    ``comm._current`` is left holding this call's record (made by the first step's validation), whatever
    calls the transfers made in between (a device transport staged through the host path)."""
    rec = None
    try:
        comm._calling = None
        try:
            step = next(steps)
        finally:
            rec = comm._current
        calling = comm._calling  # the call as the user made it (_call), described by the validation
        while True:
            if step.device:
                got = getattr(step.transport, step.operation)(*step.args)
            else:
                transport = step.transport
                transport.caller = calling  # for a transport that checks its calls beside them (deadline)
                try:
                    if step.run is not None:
                        step.run(*step.args)
                        got = step.run
                    else:
                        getattr(transport, step.operation)(*step.args)
                        got = None
                finally:
                    transport.caller = None
            step = steps.send(got)
    except StopIteration as stop:
        return stop.value
    finally:
        comm._current = rec


def nothing() -> None:
    return None


BARRIER = _call.describe("barrier", None, None, 0)
PLAIN = _call.naming_now()  # no front end's naming


def described(transport, run, collective: str, op: str | None, info):
    """A hot-path call: ``run`` itself, or, on a transport that checks even its blocking calls beside them
    (the deadline transport's fingerprint), ``run`` with the description of each call (``_call``: the
    collective, op, dtype, root and the array's count) set around it, as the general path sets it. The
    description is the plain call's, cached, unless the call is made inside a :func:`_call.naming` (a
    gradient bucket names its layout): then that call's own."""
    if not transport.checks_beside:
        return run
    with _call.naming():  # the entry serves calls of any naming: cache the plain head
        plain = _call.head(collective, op, info)
    now = _call.naming_now

    if collective in ("broadcast", "reduce"):

        def described_rooted(x, root):
            head = plain if now() is PLAIN else _call.head(collective, op, info)
            transport.caller = head[:-1] + (root, x.size)  # the root is the call's
            try:
                run(x, root)
            finally:
                transport.caller = None

        return described_rooted
    if collective in ("reduce_scatter", "alltoall", "allgather"):

        def described_blocks(x, out):
            transport.caller = (plain if now() is PLAIN else _call.head(collective, op, info)) + (x.size,)
            try:
                run(x, out)
            finally:
                transport.caller = None

        return described_blocks

    def described(x):
        transport.caller = (plain if now() is PLAIN else _call.head(collective, op, info)) + (x.size,)
        try:
            run(x)
        finally:
            transport.caller = None

    return described


def started(transport, calling, operation: str, args: tuple):
    """``transport.start(operation, *args)`` with ``calling`` (the caller's call, ``_call``) beside it."""
    transport.caller = calling
    try:
        return transport.start(operation, *args)
    finally:
        transport.caller = None


def contiguous(view: np.ndarray) -> np.ndarray:
    """``view`` itself when C-contiguous, else a contiguous copy (for buffers that are only read)."""
    return view if view.flags.c_contiguous else np.array(view, order="C")


def block_for(wire: np.ndarray, out: np.ndarray, size: int) -> np.ndarray:
    """Where a reduce-scatter of ``wire`` receives this rank's block: ``out``'s own memory when the wire
    dtype has out's item size (the values travel as they are, or as ordered integers, decoded in place),
    else a new array of the wire dtype (widened values, rounded back into ``out`` afterwards)."""
    if wire.dtype.itemsize == out.dtype.itemsize:
        return out.reshape(-1).view(wire.dtype)
    return np.empty(wire.size // size, dtype=wire.dtype)


def placing(x, a, view, info):
    """``(buf, place)``: a contiguous writable buffer holding x's elements (x's own memory where it
    can be), and ``place()``, which puts the result where it belongs (x, written back into x, or a new
    array) and returns it. The caller's array is untouched until ``place()`` when it is a copy."""
    can_write = a.writable(x, view)
    if can_write and view.flags.writeable and view.flags.c_contiguous:
        return view, lambda: a.written(x, x)  # torch: autograd's version counter, as for a write under no_grad
    buf = np.array(view, order="C")

    def place():
        if can_write:
            a.write_back(x, view, buf)
            return a.written(x, x)
        return a.wrap(buf, info, x)

    return buf, place


def writing(out, a):
    """``(buf, place)`` for a result written into ``out`` (validated, ``validate.check_out``): out's own
    host memory where it can be written as it is, else a new buffer that ``place()`` copies into out; and
    ``place()``, which returns ``out`` (torch: with a new version, as for a write under no_grad). Nothing
    of out's old values is read."""
    view, _ = a.host_view(out)
    if view.flags.writeable and view.flags.c_contiguous:
        return view, lambda: a.written(out, out)
    buf = np.empty(view.shape, dtype=view.dtype)

    def place():
        a.write_back(out, view, buf)
        return a.written(out, out)

    return buf, place

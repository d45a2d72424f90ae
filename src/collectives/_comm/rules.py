"""Reductions under the host rules (``_reduction``, ``_dtypes.wire``) as a collective's steps.

The blocking form is a runner: the call the general path chose for a (transport, dtype, op), made once
and kept on the communicator (``comm._runners``), which the hot path caches in turn (:func:`runner`,
:func:`scatter_runner`); the asynchronous form is :func:`reducing`, the same rules in transfers started
with ``transport.start``. :func:`reduction` makes the step of either for a collective's generator.
"""

from __future__ import annotations

import functools

from .. import _call, _reduction, _reproducible
from . import steps


def reduction(comm, transport, operation: str, buf, info, op: str, asynchronous: bool, extra: tuple = (), *,
              receives: bool = True, out=None) -> steps.Step:
    """The step of a reduction of ``buf`` under the host rules (``_reduction``): ``operation`` "allreduce",
    "reduce_scatter" or "reduce" (``extra``: its root). Blocking: the call the general path chose
    (:func:`runner`, :func:`scatter_runner`, :func:`reduce_runner`: a transport's direct call where the
    values travel as they are, else ``reduce_buffer``), which the hot path caches. Asynchronous: the same
    rules in steps (:func:`reducing`)."""
    rules = (info, op, extra, receives, out)
    args = (buf,) if out is None else (buf, out)
    if asynchronous:
        return steps.Step(transport, operation, args, rules=rules)
    if operation == "allreduce":
        run = runner(comm, transport, info, op)
    elif operation == "reduce_scatter":
        run = scatter_runner(comm, transport, info, op)
    else:  # "reduce": run(buf, root), the root the call's (extra); the runner serves any root
        run, args = reduce_runner(comm, transport, info, op), (buf, *extra)
    return steps.Step(transport, operation, args, run)


def cacheable(comm, info, op) -> bool:
    """Whether the hot path may keep the ordinary call of (dtype, op): not where the communicator's
    default makes that pair reproducible (the hot path would run the ordinary call)."""
    return not (comm._reproducible and _reproducible.applies(info, op))


def runner(comm, transport, info, op: str):
    """The call that allreduces a contiguous buffer of ``info``'s dtype with ``op`` in place
    (:func:`collectives._reduction.runner`), made once per (transport, dtype, op) and kept in ``comm._runners``."""
    key = (op, info)
    hit = comm._runners.get(key)
    if hit is None or hit[0] is not transport:
        hit = comm._runners[key] = (transport, _reduction.runner(transport, info, op, comm._size))
    return hit[1]


def reduce_runner(comm, transport, info, op: str):
    """The call that reduces a contiguous buffer of ``info``'s dtype with ``op`` onto a root, ``run(buf,
    root)`` (:func:`collectives._reduction.reduce_runner`), made once per (transport, dtype, op)."""
    key = ("reduce", op, info)
    hit = comm._runners.get(key)
    if hit is None or hit[0] is not transport:
        hit = comm._runners[key] = (transport, _reduction.reduce_runner(transport, info, op, comm._size,
                                                                        comm.rank))
    return hit[1]


def scatter_runner(comm, transport, info, op: str):
    """The call that reduce-scatters ``(send, out)`` of ``info``'s dtype with ``op`` under the host
    rules (:func:`collectives._reduction.scatter_runner`), made once per (transport, dtype, op)."""
    key = ("reduce_scatter", op, info)
    hit = comm._runners.get(key)
    if hit is None or hit[0] is not transport:
        general = functools.partial(reduce_scatter_into, comm, transport, info=info, op=op)
        hit = comm._runners[key] = (transport, _reduction.scatter_runner(transport, info, op, comm._size,
                                                                         general))
    return hit[1]


def reduce_scatter_into(comm, transport, send, out, info, op) -> None:
    """Reduce-scatter the contiguous host buffer ``send`` into ``out`` (this rank's block) under the
    host rules; ``send`` is left as it was."""
    size = comm._size

    def collective(wire, o):
        block = steps.block_for(wire, out, size)
        transport.reduce_scatter(wire, block, o)
        return block

    _reduction.reduce_buffer(send, info, op, size, collective, transport.reduces, out=out)


def reducing(comm, transport, operation, buf, info, op, extra, finish, *, receives=True, out=None,
             calling=None):
    """The steps of a reduction under the host rules (``_reduction.steps``), each transfer started
    with ``transport.start`` beside ``calling`` (the call as the user made it, ``_call``; None: this
    reduction of ``buf`` itself, for the tree and bucket layers); returns ``finish()``.

    Every transfer starts at the call. The one pair that needs two transfers, one after the other
    (float min/max wider than 64 bits: values, then NaN and zero-sign flags), runs blocking at the call
    instead: a second transfer started later, by ``done()`` on one rank and by ``wait()`` on another,
    could meet the ranks' other collectives in a different order."""
    if calling is None:
        calling = _call.describe(operation, op, info, buf.size, extra[0] if extra else -1)
    if not _reduction.scatters(info, op):
        call = getattr(transport, operation)
        transport.caller = calling
        try:
            _reduction.reduce_buffer(buf, info, op, comm._size, lambda wire, o: call(wire, o, *extra),
                                     transport.reduces, receives=receives, out=out)
        finally:
            transport.caller = None
        return finish()
    run, quiet = _reduction.steps(buf, info, op, comm._size, transport.reduces, receives=receives, out=out)
    result = None
    while (step := _reduction.advance(run, result, quiet)) is not None:
        wire, wire_op = step
        if operation == "reduce_scatter":
            result = steps.block_for(wire, out, comm._size)
            yield steps.started(transport, calling, operation, (wire, result, wire_op))
        else:
            result = None
            yield steps.started(transport, calling, operation, (wire, wire_op, *extra))
    return finish()

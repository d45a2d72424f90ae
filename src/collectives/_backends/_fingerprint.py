"""The fingerprint of an MPI call, and the words for a call in messages.

A call's fingerprint (:data:`FIELDS`) is the caller's call as the engine described it (``_call.FIELDS``),
then the MPI call itself (:data:`WIRE_FIELDS`); :class:`~collectives._backends.mpi.MPITransport` reduces it
beside each non-blocking call. Here: those fields, the lanes they name (a lane's making travels as a call
whose collective is ``LANE_CODE`` plus the lane's index), and the text of a request, a mismatch or a lane's
making for :class:`MismatchError` and :class:`CollectiveTimeoutError` messages. No MPI is imported here.
"""

from __future__ import annotations

from .. import _call
from .._dtypes import from_numpy

# The lanes: one MPI communicator per kind of collective (see mpi._Lanes), one for the fingerprints the
# non-blocking paths reduce beside each call (MPITransport._fingerprint), and "groups", the parent of the
# communicators that only their members make (create_group).
LANES = ("allreduce", "reduce", "broadcast", "allgather", "gather", "reduce_scatter", "alltoall", "barrier", "objects",
         "fingerprint", "p2p", "p2p_data", "groups", "lanes")  # p2p: the headers of send/recv; p2p_data: their data
# Made with the transport: the fingerprint lane (the first use of every other lane is agreed on it), the
# point-to-point lanes (two ranks take part in a message: there is no point where every rank is), and
# "lanes", the communicator every other lane is duplicated from, one at a time (MPITransport._advance). The others
# are made at their first use (mpi._Lanes).
EAGER_LANES = ("fingerprint", "p2p", "p2p_data", "lanes")
LANE_CODE = 1000  # the wire "collective" field of a lane's making: this plus the lane's index in LANES
# A call's fingerprint: the caller's call as the engine described it (_call.FIELDS: collective, op as named,
# exact dtype, structure, root, count; all -1 where no engine call is behind it), then the MPI call itself
# (WIRE_FIELDS: which MPI collective, how many elements of which wire dtype, wire op, root).
WIRE_FIELDS = ("collective", "count", "dtype", "op", "root")
FIELDS = _call.FIELDS + WIRE_FIELDS
NO_CALLER = (-1,) * len(_call.FIELDS)


def wire_fields(operation: str, args: tuple) -> tuple[int, ...]:
    """The fingerprint fields of one MPI call of ``operation`` with ``args`` (:data:`WIRE_FIELDS`)."""
    kind = _call.COLLECTIVES.index(operation)
    if not args:
        return (kind, 0, 0, -1, -1)
    buf = args[0]
    op = root = -1
    rest = args[1:]
    if operation in ("allreduce", "reduce", "reduce_scatter"):
        op = _call.OPS.index(rest[-1] if operation == "reduce_scatter" else rest[0])
    if operation == "reduce":
        root = rest[1]
    elif operation == "broadcast":
        root = rest[0]
    elif operation == "gather":
        root = rest[-1]
    return (kind, buf.size, _call.dtype_code(from_numpy(buf.dtype)), op, root)


def describe(operation: str, args: tuple):
    """What a request is, for messages: ``(name, buffer or None, detail or None)``; the detail names the
    op and the root of the call, as its arguments (:meth:`MPITransport._begin`) give them."""
    if operation in ("allreduce", "reduce_scatter"):
        detail = f"op={args[-1]}"
    elif operation == "reduce":
        detail = f"op={args[1]}, root={args[2]}"
    elif operation in ("broadcast", "gather"):
        detail = f"root={args[-1]}"
    else:
        detail = None
    return (operation, args[0] if args else None, detail)


def fingerprint_message(what, mine, high, low, rank: int, size: int) -> str:
    """The message of the MismatchError every rank raises for a fingerprint whose fields differ (``mine``:
    this rank's fields; ``high``, ``low``: every field's largest and smallest value over the ranks). It
    names the caller's call where the engine described it (the op as named, the caller's dtype), else the
    MPI call's."""
    name, buf = what[0], what[1]
    n = len(_call.FIELDS)
    described = mine[0] >= 0  # the engine described this rank's call
    this = mine_text(mine) if described else f"{name}{f' of {buf.size} x {buf.dtype}' if buf is not None else ''}"
    collective = 0 if high[0] != low[0] else n if high[n] != low[n] else None
    if collective is not None:
        called = " and ".join(dict.fromkeys(collective_text(int(v)) for v in (low[collective], high[collective])))
        head = f"ranks called different collectives at the same point: {called} (this rank, {rank} of {size}: {this})"
        s = _call.FIELDS.index("structure")
        if high[s] != low[s]:  # a front end's own calls (a bucket's layout, a meeting): named, as they were
            head += (f"; structure: {_call.render('structure', int(low[s]))} on some ranks, "
                     f"{_call.render('structure', int(high[s]))} on others")
    else:
        fields = [(f, i) for i, f in enumerate(_call.FIELDS) if i] + [(f, n + i) for i, f in enumerate(WIRE_FIELDS) if i]
        differ = [(f, i) for f, i in fields if high[i] != low[i]]
        caller = [(f, i) for f, i in differ if i < n]
        if caller:
            differ = caller  # the wire differs as a consequence: name what the callers did
        else:
            differ = [(f"{f} on the wire", i) for f, i in differ]
        parts = [f"{f}: {_call.render(f.split()[0], int(low[i]))} on some ranks, "
                 f"{_call.render(f.split()[0], int(high[i]))} on others" for f, i in differ]
        head = (f"ranks disagree about {_call.render('collective', int(mine[0])) if described else name}: "
                + "; ".join(parts) + f" across the ranks (this rank, {rank} of {size}: {this})")
    return (f"{head}. Every rank must make the same calls in the same order, with the same arguments. Detected "
            f"beside the call, after it was started: the communicator cannot be used further (run with "
            f"COLLECTIVES_CHECK=1 to have such calls refused before anything moves, the communicator usable)")


def collective_text(code: int) -> str:
    """A fingerprint's collective field, for messages."""
    if code < 0:
        return "a call of the library's own"
    if LANE_CODE <= code < LANE_CODE + len(LANES):
        return f"the first {LANES[code - LANE_CODE]} call (its lane's making)"
    return _call.render("collective", code)  # (a value no rank sends: shown as the number)


def making_what(name: str, caller) -> tuple:
    """What the making of the lane ``name`` is, for a timeout's message (:meth:`MPITransport._expire`): the
    caller's call whose first use of the lane it is, as the engine described it (``caller``: its
    :data:`_call.FIELDS`), else the lane's first call."""
    if caller is None:
        return (f"the first {name} call (its lane's making)", None, None)
    collective, op, dtype, _, root, count = (int(v) for v in caller)
    text = _call.render("collective", collective)
    if dtype:
        text += f" of {count} x {_call.render('dtype', dtype)}"
    detail = ", ".join(([f"op={_call.render('op', op)}"] if op >= 0 else []) + ([f"root={root}"] if root >= 0 else []))
    return (text, None, detail or None)


def mine_text(fields) -> str:
    """This rank's call as the engine described it: ``allreduce op=mean of 4 x float32``."""
    collective, op, dtype, _, root, count = (int(v) for v in fields[:len(_call.FIELDS)])
    text = _call.render("collective", collective)
    if op >= 0:
        text += f" op={_call.render('op', op)}"
    if root >= 0:
        text += f" root={root}"
    return text + (f" of {count} x {_call.render('dtype', dtype)}" if dtype else "")

"""Point-to-point messages: ``send`` and ``recv`` as their steps, and their validation.

Only the two ranks concerned call them: no agreement step, no fingerprint; the flight recorder keeps
them in a ring of their own (``record.begin_p2p``). A message is its header (``_p2p``) and then its data,
both on the transport.
"""

from __future__ import annotations

import numpy as np

from .. import _arrays, _records
from . import record, validate
from .steps import Step, contiguous, placing


def prepare(comm, what: str, x, peer, tag, asynchronous: bool):
    """Validate a send or recv before anything is sent: the array, the peer (``recv``: None is any
    rank), the tag, a writable receive buffer; ``(adapter, transport, view, info, peer, tag)``. No
    agreement step, checked mode or not: only two ranks take part. A device transport's host copy
    (``comm._staging``, :func:`call.staged`) begins no record: the device call has one."""
    side = "dst" if what == "send" else "src"
    rec = None
    if not comm._staging:
        comm._current = rec = record.begin_p2p(comm, what, x, asynchronous)
    a = _arrays.adapter(x)
    device = a.device(x)
    if isinstance(tag, (bool, np.bool_)) or not isinstance(tag, (int, np.integer)):
        raise TypeError(f"{what}: tag must be an integer, got {type(tag).__name__} {tag!r}")
    if peer is not None or what != "recv":  # (recv: None is any rank)
        peer = validate.check_root(comm, peer, side, what, " or None (any rank)" if what == "recv" else "")
    transport = comm._transport_for(device)
    tag = int(tag)
    if not 0 <= tag <= transport.max_tag:
        raise ValueError(f"{what}: tag={tag} is out of range (valid: 0..{transport.max_tag}, this MPI's "
                         f"MPI_TAG_UB)")
    if what == "send" and peer == comm.rank and not asynchronous:
        raise ValueError(f"send: dst={peer} is this rank: a blocking send to itself cannot complete before "
                         f"its receive is posted; use send(..., async_op=True) and then recv")
    view = info = None
    if not transport.array_level:
        view, info = a.host_view(x)
        if what == "recv" and not a.writable(x, view):
            raise ValueError(f"recv needs a writable array to receive into, got a read-only "
                             f"{type(x).__module__}.{type(x).__qualname__}; pass a writable NumPy array or "
                             f"torch tensor")
    if rec is not None:
        _records.set_path(rec, f"{_records.path(rec)}, {transport.name}, {side}={'any' if peer is None else peer}, "
                               f"tag={tag}")
    return a, transport, view, info, peer, tag


def send(comm, x, dst, tag, asynchronous: bool):
    a, transport, view, info, dst, tag = prepare(comm, "send", x, dst, tag, asynchronous)
    if transport.array_level:
        yield Step(transport, "send", (x, a, dst, tag), device=True)
        return None
    yield Step(transport, "send", (contiguous(view), info.name, dst, tag))
    return None


def recv(comm, x, src, tag, asynchronous: bool):
    a, transport, view, info, src, tag = prepare(comm, "recv", x, src, tag, asynchronous)
    box: list = [None]  # the sender's rank, written by the transport
    if transport.array_level:
        yield Step(transport, "recv", (x, a, src, tag, box), device=True)
        return box[0]
    buf, place = placing(x, a, view, info)
    yield Step(transport, "recv", (buf, info.name, src, tag, box))
    place()
    return box[0]

"""Python objects: ``broadcast_object`` and ``allgather_object``, pickled once, with every rank told alike
when an object cannot be pickled or unpickled (each rank then raises the same ``TypeError``). The two
methods of the Communicator are bound from here."""

from __future__ import annotations

import pickle

from .. import _agree, _arrays
from .._threads import collective
from . import validate
from .record import traced


@collective("broadcast_object")
@traced("broadcast_object", root_at=1)
def broadcast_object(comm, obj, root: int = 0):
    """Root's picklable ``obj`` on every rank. See :func:`collectives.broadcast_object`."""
    host = comm._transport_for(_arrays.HOST)
    try:
        root = validate.check_root(comm, root)
    except Exception as exc:
        if comm.check:
            _agree.agree(host, "broadcast_object", (), None, exc)
        raise
    if comm.check:
        _agree.agree(host, "broadcast_object", (("root", root),))
    blob = None
    if comm.rank == root:  # (whether it pickled, the bytes or the message): every rank raises alike
        data, failure = _pickled(obj, "broadcast_object", "root's obj")
        blob = (failure, data)
    failure, data = host.objects_broadcast(blob, root)
    if failure:
        raise TypeError(data.decode())
    result = obj if comm.rank == root else _unpickled(data, "broadcast_object", f"root {root}'s obj", comm.rank)
    _agree_unpickled(host, result)
    return obj if comm.rank == root else result


@collective("allgather_object")
@traced("allgather_object")
def allgather_object(comm, obj) -> list:
    """Every rank's picklable ``obj``, in rank order. See :func:`collectives.allgather_object`."""
    host = comm._transport_for(_arrays.HOST)
    if comm.check:
        _agree.agree(host, "allgather_object")
    data, failure = _pickled(obj, "allgather_object", f"rank {comm.rank}'s obj")
    blobs = host.objects_allgather((failure, data))  # bytes travel as they are (pickled once)
    notes = [d.decode() for f, d in blobs if f]
    if notes:  # every rank learns who failed, then every rank raises the same TypeError
        raise TypeError("; ".join(notes))
    values = [obj if r == comm.rank else _unpickled(d, "allgather_object", f"rank {r}'s obj", comm.rank)
              for r, (_, d) in enumerate(blobs)]
    _agree_unpickled(host, *values)
    return values


def _pickled(obj, collective: str, whose: str) -> tuple[bytes, bool]:
    """``(its pickle, False)``, or ``(the error message, True)`` when ``obj`` cannot be pickled."""
    try:
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - any pickling failure (PicklingError, TypeError, AttributeError) is reported on every rank
        text = (f"{collective}: {whose} of type {type(obj).__module__}.{type(obj).__qualname__} cannot be "
                f"pickled ({type(exc).__name__}: {exc}); send a picklable object (plain data, or an object "
                f"whose class is importable at module level on every rank); nothing was sent")
        return text.encode(), True
    return data, False


class _Unpickled:
    """What a receiver holds where an object could not be unpickled: the message, told to every rank."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _unpickled(data: bytes, collective: str, whose: str, rank: int):
    """``pickle.loads(data)``, or an :class:`_Unpickled` saying why it failed on this rank."""
    try:
        return pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure (AttributeError for a class missing here, ImportError, ...) is reported on every rank
        return _Unpickled(f"{collective}: {whose} cannot be unpickled on rank {rank} ({type(exc).__name__}: {exc}); "
                          f"send plain data, or an object whose class is importable at module level on every "
                          f"rank")


def _agree_unpickled(host, *values) -> None:
    """Every rank learns whether every receiver could unpickle what it got; if some could not, every rank
    (the sender included) raises the same TypeError naming them."""
    if host.size == 1:
        return
    note = next((v.message for v in values if isinstance(v, _Unpickled)), None)
    notes = [n for n in host.objects_allgather(note) if n is not None]
    if notes:
        raise TypeError("; ".join(notes))

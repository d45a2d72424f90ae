"""``Communicator.split`` (bound from here): sub-communicators, their arguments validated and agreed by
every rank before MPI splits."""

from __future__ import annotations

import numpy as np

from .. import _agree, _arrays
from .record import traced


def split(comm, color, key=0, *, timeout: float | None = None):
    """Split this communicator into groups of ranks with equal ``color`` (``MPI_Comm_split``).

    Collective: every rank of this communicator calls it. Ranks with the same ``color`` form one new
    communicator, ranked by ``(key, rank here)``; a rank with ``color=None`` joins none and gets None.
    The new communicator has this one's settings (checked mode, ``COLLECTIVES_TIMEOUT``,
    ``COLLECTIVES_CHECK_NAN``), its own MPI communicator and, on first use of CUDA arrays, its own
    device transport (its own NCCL communicator). ``close()`` releases it (collective over its
    ranks); closing this communicator closes it too.

    Args:
        color: a non-negative integer, or None.
        key: an integer ordering the ranks within a group (ties: by rank here).
        timeout: seconds; every wait of the new communicator for the other ranks is bounded by it (by
            ``COLLECTIVES_TIMEOUT`` where that is smaller), as ``COLLECTIVES_TIMEOUT`` bounds a whole
            job's: a call that exceeds it raises :class:`CollectiveTimeoutError` and the communicator
            stays failed (docs/semantics.md). None (default): this communicator's bound, if any.

    Returns:
        The new :class:`Communicator`, or None where ``color`` is None.

    Raises:
        TypeError, ValueError: this rank's ``color`` or ``key`` is invalid (raised there; every other
            rank raises :class:`MismatchError` naming it, and no communicator is made).

    Example:
        >>> import collectives as coll
        >>> comm = coll.world()
        >>> sub = comm.split(color=comm.rank % 2, key=comm.rank)     # even and odd ranks
        >>> sub.size == len(range(comm.rank % 2, comm.size, 2)) and sub.rank == comm.rank // 2
        True
        >>> sub.close()
        >>> bounded = comm.split(color=0, timeout=600)   # every wait of its calls: 10 minutes at most
        >>> import numpy as np
        >>> bounded.allreduce(np.ones(2)).tolist() == [float(comm.size)] * 2
        True
        >>> bounded.close()
    """
    return _split(comm, color, key, timeout)


@traced("split")
def _split(comm, color, key, timeout=None):
    """:func:`split`'s work, in the flight recorder: the arguments validated, agreed by every rank (a rank's
    invalid arguments are every rank's refusal), then the host transport's split and the new
    Communicator with this one's settings."""
    host = comm._transport_for(_arrays.HOST)
    error = None
    try:
        color, key = check_split(color, key)
        timeout = check_timeout(timeout)
    except (TypeError, ValueError) as exc:
        error = exc
    # Every rank learns whether every other rank's arguments are valid before MPI splits (a rank that
    # raised alone would leave the others in MPI_Comm_split): the refusal branch of _agree.
    _agree.agree(host, "split", (), (), error, checked=comm.check)
    sub = host.split(color, key, timeout)
    comm._splits += 1
    if sub is None:
        return None
    child = type(comm)(sub, check=comm.check)  # (the Communicator class: this module is below it)
    child._reproducible = comm._reproducible
    child._name = f"{comm._name}.{comm._splits}"  # the same on every rank of the child (split is collective)
    comm._subs = [s for s in comm._subs if not s.closed]  # a closed one is released (not kept to the end)
    comm._subs.append(child)
    return child


def check_timeout(timeout) -> float | None:
    """Validated ``timeout=`` of :meth:`Communicator.split`: None, or positive finite seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"split: timeout must be a number of seconds or None, got {type(timeout).__name__} "
                        f"{timeout!r}")
    if not 0 < float(timeout) < float("inf"):
        raise ValueError(f"split: timeout must be a positive, finite number of seconds (or None), got {timeout}")
    return float(timeout)


def check_split(color, key) -> tuple[int | None, int]:
    """Validated ``(color, key)`` for :meth:`Communicator.split`."""
    if color is not None:
        if isinstance(color, (bool, np.bool_)) or not isinstance(color, (int, np.integer)):
            raise TypeError(f"split: color must be a non-negative integer or None, got {type(color).__name__} "
                            f"{color!r}")
        color = int(color)
        if not 0 <= color < 2**31:
            raise ValueError(f"split: color must be a non-negative integer below 2**31 (or None: not a member), "
                             f"got {color}")
    if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)):
        raise TypeError(f"split: key must be an integer (it orders the ranks of a group), got "
                        f"{type(key).__name__} {key!r}")
    key = int(key)
    if not -2**31 <= key < 2**31:
        raise ValueError(f"split: key must fit a C int (-2**31 to 2**31-1), got {key}")
    return color, key

"""This rank's part of a data set, such that every rank gets the same number of items.

Contiguous blocks: with ``n`` items on ``size`` ranks each rank gets ``per = ceil(n / size)`` items, rank
r the positions ``[r * per, (r + 1) * per)`` of the sequence ``0, 1, ..., n-1, 0, 1, ...`` (the tail is
padded by wrapping around to the start, as torch's ``DistributedSampler`` pads); with
``drop_remainder=True`` ``per = n // size`` and the last ``n % size`` items are used by nobody.
Contiguous blocks keep an array shard a view (no copy) unless it wraps around.

The index arithmetic is :func:`shard_bounds` / :func:`shard_indices`, pure functions of
``(n, rank, size)`` usable without a communicator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from . import _agree
from ._comm import _resolve, engine_of
from ._tree import is_array


def shard_bounds(n: int, rank: int, size: int, *, drop_remainder: bool = False) -> tuple[int, int]:
    """Rank's block ``[start, stop)`` of positions; position ``p`` is item ``p % n``.

    Example:
        >>> from collectives._shard import shard_bounds
        >>> [shard_bounds(10, r, 4) for r in range(4)]
        [(0, 3), (3, 6), (6, 9), (9, 12)]
        >>> [shard_bounds(10, r, 4, drop_remainder=True) for r in range(4)]
        [(0, 2), (2, 4), (4, 6), (6, 8)]
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank={rank} is out of range for size={size}")
    if n <= 0:
        raise ValueError("cannot shard an empty data set (0 items): every rank needs at least one item")
    if drop_remainder:
        per = n // size
        if per == 0:
            raise ValueError(
                f"cannot shard {n} items over {size} ranks with drop_remainder=True: every rank would get "
                f"0 items; use fewer ranks, more data, or drop_remainder=False (which repeats items)"
            )
    else:
        per = -(-n // size)
    return rank * per, (rank + 1) * per


def shard_segments(n: int, rank: int, size: int, *, drop_remainder: bool = False) -> list[tuple[int, int]]:
    """Rank's items as at most two contiguous ranges ``[(start, stop), ...]`` of item indices.

    Example:
        >>> from collectives._shard import shard_segments
        >>> shard_segments(10, 3, 4)        # items 9, then 0 and 1 again (padding)
        [(9, 10), (0, 2)]
    """
    start, stop = shard_bounds(n, rank, size, drop_remainder=drop_remainder)
    per = stop - start
    s = start % n
    if s + per <= n:
        return [(s, s + per)]
    return [(s, n), (0, s + per - n)]  # per <= n, so a block wraps at most once


def shard_indices(n: int, rank: int, size: int, *, drop_remainder: bool = False) -> list[int]:
    """Rank's item indices.

    Example:
        >>> from collectives._shard import shard_indices
        >>> [shard_indices(9, r, 4) for r in range(4)]
        [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]]
    """
    return [i for s, e in shard_segments(n, rank, size, drop_remainder=drop_remainder) for i in range(s, e)]


class ShardView(Sequence):
    """A lightweight, read-only sequence of some items of ``data`` (no copy).

    Usable as a map-style torch ``Dataset`` (it has ``__len__`` and ``__getitem__``).

    Attributes:
        data: the whole sequence.
        indices: the indices into ``data`` of this view's items.
    """

    def __init__(self, data, segments: list[tuple[int, int]]):
        self.data = data
        self._segments = segments
        self._len = sum(e - s for s, e in segments)

    @property
    def indices(self) -> list[int]:
        return [i for s, e in self._segments for i in range(s, e)]

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"indices must be integers or slices, not {type(i).__name__}")
        j = int(i) + self._len if i < 0 else int(i)
        if not 0 <= j < self._len:
            raise IndexError(f"index {i} out of range for a shard of {self._len} items")
        for s, e in self._segments:
            if j < e - s:
                return self.data[s + j]
            j -= e - s
        raise AssertionError("unreachable")

    def __repr__(self) -> str:
        return f"ShardView({len(self)} of {len(self.data)} items, indices {self._segments})"


def shard(data, *, drop_remainder: bool = False, comm=None):
    """This rank's part of ``data``; every rank gets the same number of items.

    Contiguous blocks of ``ceil(n / size)`` items: rank r gets items ``r*per ... (r+1)*per - 1``, the
    tail padded by wrapping around to the first items (so 10 items on 4 ranks give 3, 3, 3, 3: the last
    rank gets items 9, 0, 1). With ``drop_remainder=True`` each rank gets ``n // size`` items and the last
    ``n % size`` are left out. Every rank therefore runs the same number of steps.

    No communication: every rank must pass data of the same length and the same ``drop_remainder``
    (when ``comm.check`` is on, i.e. ``COLLECTIVES_CHECK=1``, both are compared and a difference raises
    :class:`MismatchError` on every rank; data that cannot be sharded on one rank raises its TypeError
    there and MismatchError naming it on the others).

    Args:
        data: an array of any library (sharded along axis 0 by slicing), a list or tuple, or any
            sequence with ``__len__`` and ``__getitem__`` (``range``, a torch ``Dataset``, ...).
        drop_remainder: drop the tail instead of padding it.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).

    Returns:
        An array of the same library (a view when the block does not wrap around), a list for a list, a
        tuple for a tuple, else a :class:`ShardView` over ``data``.

    Raises:
        ValueError: ``data`` is empty, or has fewer items than ranks with ``drop_remainder=True``.
        TypeError: ``data`` is a 0-d array, a mapping, or has no length.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> x = np.arange(10)
        >>> part = coll.shard(x)
        >>> len(part) == -(-10 // comm.size)
        True
        >>> coll.shard(list(range(10)), drop_remainder=True) == list(range(10))[
        ...     comm.rank * (10 // comm.size):(comm.rank + 1) * (10 // comm.size)]
        True
    """
    c = _resolve(comm)
    n, error = None, None
    try:
        n = _length(data)
    except TypeError as exc:  # in checked mode held until the ranks have compared their calls
        error = exc
    if c.check and c.size > 1:
        _agree_on(c, n, bool(drop_remainder), error)
    if error is not None:
        raise error
    assert n is not None  # _length returned: it raised no error
    segments = shard_segments(n, c.rank, c.size, drop_remainder=drop_remainder)
    if is_array(data):
        parts = [data[s:e, ...] for s, e in segments]  # the trailing ... is what the array API requires
        if len(parts) == 1:
            return parts[0]
        if isinstance(data, np.ma.MaskedArray):  # the namespace's concat would drop the mask
            return np.ma.concatenate(parts, axis=0)
        from array_api_compat import array_namespace

        return array_namespace(data).concat(parts, axis=0)
    if isinstance(data, (list, tuple)):
        items = [x for s, e in segments for x in data[s:e]]
        return tuple(items) if isinstance(data, tuple) else items
    return ShardView(data, segments)


def _length(data) -> int:
    """The number of items of ``data`` along axis 0, or TypeError for what cannot be sharded."""
    if is_array(data):
        shape = getattr(data, "shape", None)
        if shape is None or len(shape) == 0:
            raise TypeError("cannot shard a 0-d array: it has no axis 0; pass an array with at least one axis")
        if shape[0] is None:
            raise TypeError("cannot shard an array whose length along axis 0 is unknown")
        return int(shape[0])
    if isinstance(data, Mapping):
        raise TypeError("cannot shard a mapping: shard its values, e.g. shard(list(d.items()))")
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return len(data)
    raise TypeError(f"cannot shard a {type(data).__name__}: expected an array or a sequence with __len__ "
                    f"and __getitem__ (a list, range, torch Dataset, ...)")


def _agree_on(c, n: int | None, drop_remainder: bool, error: BaseException | None) -> None:
    """Checked mode: the ranks agree on (length, drop_remainder) with the one agreement protocol
    (:func:`collectives._agree.agree`): on any difference every rank raises MismatchError; a rank whose data
    was invalid raises its own TypeError, the others a MismatchError naming it; nothing is sharded."""
    header = (("length", n), ("drop_remainder", bool(drop_remainder)))
    _agree.agree(engine_of(c).host, "shard", header, () if error is None else None, error)  # None: undescribed

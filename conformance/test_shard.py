"""``shard`` (its docstring in collectives is the contract): this rank's part of a data set.

Every rank gets the same number of items, ``ceil(n / size)`` (or ``n // size`` with
``drop_remainder=True``); rank r gets positions ``[r*per, (r+1)*per)`` of ``0, 1, ..., n-1, 0, 1, ...``;
together the ranks cover every item (all but the last ``n % size`` when dropping). The result is an array of
the same library for an array, a list for a list, a tuple for a tuple, else a sequence. Equal lengths and
coverage are checked across ranks over the suite's own channel. Skipped when ``shard`` is not exposed.
"""

from __future__ import annotations

import collections.abc

import numpy as np
import pytest

from . import _dtypes, _libs, _matrix

NS = (1, 2, 3, 4, 5, 7, 10, 12, 13)


def _need(sut):
    if not callable(getattr(sut, "shard", None)):
        pytest.skip("the system under test does not expose shard")


class Items(collections.abc.Sequence):
    """A user sequence (a data set with __len__ and __getitem__), neither list, tuple nor array."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return 10 * (i % self.n)


def _kinds():
    kinds = [(f"array-{n}", n) for n in _matrix.usable_libs()] + [("list", None), ("tuple", None),
                                                                   ("range", None), ("sequence", None)]
    return kinds


def _data(kind, lib_name, n):
    if kind.startswith("array-"):
        lib = _libs.get(lib_name)
        return lib.from_bits((10 * np.arange(n)).astype(np.int64), _dtypes.ALL["int64"])
    if kind == "list":
        return [10 * i for i in range(n)]
    if kind == "tuple":
        return tuple(10 * i for i in range(n))
    if kind == "range":
        return range(0, 10 * n, 10)
    return Items(n)


def _items(part, kind, lib_name):
    if kind.startswith("array-"):
        return [int(v) for v in _libs.get(lib_name).to_bits(part, _dtypes.ALL["int64"]).reshape(-1)]
    return [int(part[i]) for i in range(len(part))]


def _cases():
    out = []
    for kind, lib_name in _kinds():
        for drop in (False, True):
            out.append(pytest.param(kind, lib_name, drop, id=f"{kind}-{'drop' if drop else 'pad'}",
                                    marks=_matrix.meta(collective="shard", lib=lib_name,
                                                       aspect="drop_remainder" if drop else "padding")))
    return out


@pytest.mark.parametrize("kind,lib_name,drop", _cases())
def test_shard_equal_lengths_and_coverage(sut, comm, channel, kind, lib_name, drop):
    _need(sut)
    size, rank = comm.size, comm.rank
    mine = {}
    for n in NS:  # compute everything first, so that every rank reaches the exchange below
        data = _data(kind, lib_name, n)
        try:
            part = sut.shard(data, drop_remainder=drop)
        except Exception as exc:  # noqa: BLE001 - judged below, on every rank
            mine[n] = ("raised", f"{type(exc).__name__}: {exc}", None, None)
            continue
        try:
            if kind.startswith("array-"):
                native = _libs.get(lib_name).is_native(part, data)
                length = int(part.shape[0])  # array-API arrays need not have len()
            else:
                native = type(part) is type(data) if kind in ("list", "tuple") else (
                    hasattr(part, "__len__") and hasattr(part, "__getitem__"))
                length = len(part)
            mine[n] = ("ok", length, _items(part, kind, lib_name), native)
        except Exception as exc:  # noqa: BLE001
            mine[n] = ("bad result", f"{type(exc).__name__}: {exc}", None, None)
    everyone = channel.allgather(mine)
    for n in NS:
        what = f"shard({kind} of {n} items, drop_remainder={drop}) on rank {rank} of {size}"
        if drop and n < size:
            assert mine[n][0] == "raised" and mine[n][1].startswith("ValueError"), (
                f"{what}: fewer items than ranks is a ValueError; got {mine[n][:2]}")
            continue
        status, length, got, native = mine[n]
        assert status == "ok", f"{what}: {status}: {length}"
        per = n // size if drop else -(-n // size)
        assert length == per, f"{what}: {length} items, expected {per}"
        assert native, f"{what}: an array gives an array of its library, a list a list, a tuple a tuple"
        want = [10 * (p % n) for p in range(rank * per, (rank + 1) * per)]
        assert got == want, f"{what}: items {got}, expected positions {rank * per}..{(rank + 1) * per - 1}: {want}"
        lengths = [e[n][1] if e[n][0] == "ok" else e[n][0] for e in everyone]
        assert len(set(lengths)) == 1, f"{what}: ranks got different numbers of items: {lengths}"
        covered = {v for e in everyone if e[n][0] == "ok" for v in e[n][2]}
        expected = {10 * i for i in range(n if not drop else per * size)}
        assert covered == expected, f"{what}: the ranks together cover {sorted(covered)}, expected {sorted(expected)}"


@pytest.mark.parametrize("case", [pytest.param(c, marks=_matrix.meta(collective="shard", aspect="argument errors"))
                                  for c in ("empty-list", "empty-array", "0d-array", "mapping", "no-length")])
def test_shard_refuses(sut, comm, case):
    _need(sut)
    if case == "empty-list":
        with pytest.raises(ValueError):
            sut.shard([])
    elif case == "empty-array":
        with pytest.raises(ValueError):
            sut.shard(np.arange(0))
    elif case == "0d-array":
        with pytest.raises(TypeError):
            sut.shard(np.asarray(5))
    elif case == "mapping":
        with pytest.raises(TypeError):
            sut.shard({"a": 1, "b": 2})
    else:
        with pytest.raises(TypeError):
            sut.shard(iter([1, 2, 3]))

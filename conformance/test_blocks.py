"""reduce_scatter, alltoall and gather (every library, dtype and op), broadcast_object and allgather_object.

docs/semantics.md: the leading dimension of x is split into ``size`` equal blocks. ``reduce_scatter``
returns this rank's block of the element-wise reduction (every rule of allreduce), a new array of shape
``(x.shape[0] // size, *x.shape[1:])``; ``alltoall`` returns a new array whose block i is rank i's block
``rank``, bit for bit; both leave x unchanged and raise ValueError when the leading dimension does not
divide. ``gather(x, root)`` returns, on root, a new ``(size, *x.shape)`` array whose row r is rank r's x bit
for bit, and None on every other rank; x is left unchanged. Optional names of the system under test: their tests are skipped when it lacks them.
"""

from __future__ import annotations

import numpy as np
import pytest

from . import _checks, _dtypes, _libs, _matrix
from ._dtypes import seed_of

ROWS = 2  # rows per block


def _cases(reduction: bool) -> list:
    out = []
    for name in _matrix.usable_libs():
        for spec in _libs.get(name).dtypes():
            for op in ([op for op in _dtypes.OPS if _dtypes.legal(op, spec.kind)] if reduction else [None]):
                pid = "-".join(p for p in (name, spec.name, op) if p)
                out.append(pytest.param(name, spec.name, op, id=pid))
    return out


def _need(sut, name):
    if not hasattr(sut, name):
        pytest.skip(f"the system under test has no {name}")


@pytest.mark.parametrize("lib_name,dtype,op", _cases(True))
def test_reduce_scatter(sut, comm, rec, lib_name, dtype, op):
    _need(sut, "reduce_scatter")
    lib, spec = _libs.get(lib_name), _dtypes.ALL[dtype]
    shape = (ROWS * comm.size, 3)
    seed = seed_of("reduce_scatter", lib_name, dtype, op)
    values = [_dtypes.exact_values(spec, shape, op, seed_of(seed, r)) for r in range(comm.size)]
    want_all = _dtypes.reference(spec, op, np.stack(values))
    what = f"reduce_scatter(x, op={op!r}) on rank {comm.rank} of {comm.size}"
    x = lib.from_bits(spec.from_values(values[comm.rank]), spec)
    before = lib.to_bits(x, spec)
    y = sut.reduce_scatter(x, op=op)
    _checks.check_common(lib, spec, x, y, (ROWS, 3), what)
    assert _checks.same_bits(lib.to_bits(x, spec), before), f"{what}: x must be left unchanged"
    got = spec.to_values(lib.to_bits(y, spec))
    want = want_all[ROWS * comm.rank:ROWS * (comm.rank + 1)]
    tol = _dtypes.tolerance(spec, op)
    if tol == 0 and not np.array_equal(got, want):
        others = [r for r in range(comm.size) if r != comm.rank
                  and np.array_equal(got, want_all[ROWS * r:ROWS * (r + 1)])]
        raise AssertionError(f"{what}: not this rank's block of the reduction"
                             + (f" (it is block {others[0]})" if others else "")
                             + f": {_checks.first_difference(got.astype(want.dtype), want)}")
    _checks.check_reduced(spec, op, got, want, what)
    _checks.check_out(sut, "reduce_scatter", lib, spec, x, (ROWS, 3), lib.to_bits(y, spec), what, op=op)


@pytest.mark.parametrize("lib_name,dtype,op", _cases(False))
def test_alltoall(sut, comm, rec, lib_name, dtype, op):
    _need(sut, "alltoall")
    lib, spec = _libs.get(lib_name), _dtypes.ALL[dtype]
    n = comm.size
    shape = (ROWS * n, 3)
    seed = seed_of("alltoall", lib_name, dtype)
    sent = [_dtypes.random_bits(spec, shape, seed_of(seed, r)) for r in range(n)]  # rank r's x
    what = f"alltoall(x) on rank {comm.rank} of {n}"
    x = lib.from_bits(sent[comm.rank], spec)
    before = lib.to_bits(x, spec)
    y = sut.alltoall(x)
    _checks.check_common(lib, spec, x, y, shape, what)
    assert y is not x, f"{what}: alltoall returns a new array, got x itself"
    assert _checks.same_bits(lib.to_bits(x, spec), before), f"{what}: x must be left unchanged"
    got = lib.to_bits(y, spec)
    for i in range(n):
        block = got[ROWS * i:ROWS * (i + 1)]
        want = sent[i][ROWS * comm.rank:ROWS * (comm.rank + 1)]
        if not _checks.same_bits(block, want):
            whose = [(r, j) for r in range(n) for j in range(n)
                     if _checks.same_bits(block, sent[r][ROWS * j:ROWS * (j + 1)])]
            raise AssertionError(f"{what}: block {i} of the result is not rank {i}'s block {comm.rank}"
                                 + (f" (it is rank {whose[0][0]}'s block {whose[0][1]})" if whose else "")
                                 + f": {_checks.first_difference(block, want)}")


@pytest.mark.parametrize("lib_name,dtype,op", _cases(False))
def test_gather(sut, comm, rec, lib_name, dtype, op):
    _need(sut, "gather")
    lib, spec = _libs.get(lib_name), _dtypes.ALL[dtype]
    n = comm.size
    shape = (ROWS, 3)
    seed = seed_of("gather", lib_name, dtype)
    sent = [_dtypes.random_bits(spec, shape, seed_of(seed, r)) for r in range(n)]  # rank r's x
    root = n - 1
    what = f"gather(x, root={root}) on rank {comm.rank} of {n}"
    x = lib.from_bits(sent[comm.rank], spec)
    before = lib.to_bits(x, spec)
    y = sut.gather(x, root=root)
    assert _checks.same_bits(lib.to_bits(x, spec), before), f"{what}: x must be left unchanged"
    if comm.rank != root:
        assert y is None, f"{what}: a rank other than root gets None, got {type(y).__name__}"
        return
    _checks.check_common(lib, spec, x, y, (n,) + shape, what)
    got = lib.to_bits(y, spec)
    for r in range(n):
        if not _checks.same_bits(got[r], sent[r]):
            raise AssertionError(f"{what}: row {r} is not rank {r}'s x: {_checks.first_difference(got[r], sent[r])}")


@pytest.mark.parametrize("collective", ["reduce_scatter", "alltoall"])
def test_leading_dimension_must_divide(sut, comm, collective):
    _need(sut, collective)
    x = np.arange(comm.size + 1, dtype=np.float64) if comm.size > 1 else np.array(1.0)  # 0-d: no blocks
    before = x.copy()
    with pytest.raises(ValueError):
        getattr(sut, collective)(x)
    assert np.array_equal(x, before), f"{collective}: x must be left unchanged by a refused call"


def test_broadcast_object_and_allgather_object(sut, comm):
    _need(sut, "broadcast_object")
    _need(sut, "allgather_object")
    for root in range(comm.size):
        got = sut.broadcast_object({"from": comm.rank, "data": list(range(comm.rank))}, root=root)
        assert got == {"from": root, "data": list(range(root))}, f"broadcast_object(root={root}): got {got!r}"
    got = sut.allgather_object(("rank", comm.rank))
    assert got == [("rank", r) for r in range(comm.size)], f"allgather_object: got {got!r}"


def test_unpicklable_object_raises_type_error_on_every_rank(sut, comm):
    _need(sut, "broadcast_object")
    obj = (lambda: None) if comm.rank == 0 else 0
    with pytest.raises(TypeError):
        sut.broadcast_object(obj, root=0)
    assert sut.broadcast_object("after", root=0) == "after", "the ranks stay in step after the error"

"""Errors before communication (docs/semantics.md, "Validation and errors before communication").

Every call validates its arguments before any communication, in this order: that x is an array, its
device, op, root, the dtype, the dtype/op pair. Identical arguments give the identical error on every rank
(the suite's verdict exchange checks "every rank"); the input is untouched and the communicator is usable
afterwards (each test ends with a collective that must give the right answer).
"""

from __future__ import annotations

import numpy as np
import pytest

from . import _checks, _dtypes, _libs, _matrix, _options
from ._dtypes import seed_of


def _still_usable(sut, comm, what):
    """The communicator works after the error: an allreduce gives the right answer on every rank."""
    y = sut.allreduce(np.full(3, 2, dtype=np.int64), op="sum")
    assert np.asarray(y).tolist() == [2 * comm.size] * 3, (
        f"after {what}, the next allreduce gave {np.asarray(y).tolist()}, expected {[2 * comm.size] * 3}: "
        f"the communicator must stay usable after an argument error")


def _sample_illegal():
    cases = _matrix.illegal_cases()
    if _options.get().full:
        return cases
    # sampled: each (lib, dtype, op) once, alternating the collective
    kept, seen = [], set()
    for p in cases:
        name, collective, dtype, op = p.values
        key = (name, dtype, op)
        if key in seen:
            continue
        pick = _matrix.REDUCTIONS[(seed_of(name, dtype, op) + _options.get().seed) % 2]
        if collective == pick:
            kept.append(p)
            seen.add(key)
    return kept


def _call(sut, collective, x, op="sum", root=0):
    if collective == "allreduce":
        return sut.allreduce(x, op=op)
    if collective == "reduce":
        return sut.reduce(x, op=op, root=root)
    if collective == "broadcast":
        return sut.broadcast(x, root=root)
    if collective == "allgather":
        return sut.allgather(x)
    raise ValueError(collective)


def _made(lib_name, dtype="float64", layout="1d", seed=0, rank=0, op="sum"):
    lib = _libs.get(lib_name)
    spec = _dtypes.ALL[dtype]
    shape = _libs.LAYOUTS[layout].shape
    bits = (spec.from_values(_dtypes.exact_values(spec, shape, op, seed_of(seed, rank))) if spec.kind != "x"
            else _dtypes.random_bits(spec, shape, seed_of(seed, rank)))
    made = lib.make(spec, layout, bits, _checks.filler(spec, seed, rank))
    return lib, spec, made


@pytest.mark.parametrize("lib_name,collective,dtype,op", _sample_illegal())
def test_illegal_dtype_op(sut, comm, lib_name, collective, dtype, op):
    """A pair the table calls TypeError: raised on every rank, input untouched, communicator usable."""
    lib, spec, made = _made(lib_name, dtype, "1d", seed_of("illegal", dtype, op), comm.rank)
    before = _checks.Before(lib, spec, made)
    what = f"{collective}(x of dtype {dtype}, op={op!r})"
    with pytest.raises(TypeError):
        _call(sut, collective, made.x, op=op, root=comm.size - 1)
    _checks.check_untouched(lib, spec, made, before, what)
    _still_usable(sut, comm, what)


@pytest.mark.parametrize("lib_name,collective", _matrix.lib_cases("unknown op", ("allreduce", "reduce")))
def test_unknown_op(sut, comm, lib_name, collective):
    """An unknown op is a ValueError; an op that is not a string is a TypeError."""
    lib, spec, made = _made(lib_name, seed=7, rank=comm.rank)
    before = _checks.Before(lib, spec, made)
    for op in ("avg", "SUM", "", "mean ", "std"):
        with pytest.raises(ValueError):
            _call(sut, collective, made.x, op=op)
    for op in (None, 1, b"sum", ["sum"]):
        with pytest.raises(TypeError):
            _call(sut, collective, made.x, op=op)
    _checks.check_untouched(lib, spec, made, before, f"{collective} with a bad op")
    _still_usable(sut, comm, f"{collective} with a bad op")


@pytest.mark.parametrize("lib_name,collective", _matrix.lib_cases("bad root", ("broadcast", "reduce")))
def test_bad_root(sut, comm, lib_name, collective):
    """root outside 0..size-1 is a ValueError; a root that is not an integer (a bool too) a TypeError;
    a NumPy integer is an integer."""
    lib, spec, made = _made(lib_name, seed=11, rank=comm.rank)
    before = _checks.Before(lib, spec, made)
    for root in (comm.size, -1, comm.size + 3, -comm.size - 1):
        with pytest.raises(ValueError):
            _call(sut, collective, made.x, root=root)
    for root in (0.0, 1.5, "0", None, True, False, [0]):
        with pytest.raises(TypeError):
            _call(sut, collective, made.x, root=root)
    _checks.check_untouched(lib, spec, made, before, f"{collective} with a bad root")
    last = comm.size - 1
    y = _call(sut, collective, np.arange(3.0) + comm.rank, root=np.int64(last))
    if collective == "broadcast":
        want = np.arange(3.0) + last
    elif comm.rank == last:
        want = comm.size * np.arange(3.0) + sum(range(comm.size))
    else:
        want = np.arange(3.0) + comm.rank
    assert np.array_equal(np.asarray(y), want), f"{collective}(x, root=np.int64({last})) gave {y}, expected {want}"
    _still_usable(sut, comm, f"{collective} with a bad root")


NOT_ARRAYS = {
    "list": [1.0, 2.0],
    "tuple": (1, 2),
    "float": 1.5,
    "int": 3,
    "none": None,
    "str": "abc",
    "dict": {"a": np.ones(2)},
    "numpy-scalar": np.float64(1.0),
}


@pytest.mark.parametrize("collective", [pytest.param(c, marks=_matrix.meta(collective=c, aspect="not an array"))
                                        for c in _matrix.COLLECTIVES])
def test_not_an_array(sut, comm, collective):
    """Anything that is not an array (a NumPy scalar too) is a TypeError; so is an object-dtype array."""
    for value in NOT_ARRAYS.values():
        with pytest.raises(TypeError):
            _call(sut, collective, value)
    objects = np.array([object(), None], dtype=object)
    with pytest.raises(TypeError):
        _call(sut, collective, objects)
    _still_usable(sut, comm, f"{collective} on a non-array")


@pytest.mark.parametrize("lib_name", _matrix.libs_param("validation order", "reduce"))
def test_validation_order(sut, comm, lib_name):
    """The documented order: array, device, op, root, dtype, dtype/op pair."""
    _lib, _spec, made = _made(lib_name, "float64", seed=13, rank=comm.rank)
    _, _ispec, imade = _made(lib_name, "int32", seed=13, rank=comm.rank)
    with pytest.raises(TypeError):          # not an array, before an unknown op
        sut.allreduce([1.0, 2.0], op="avg")
    with pytest.raises(TypeError):          # op not a string, before root out of range
        sut.reduce(made.x, op=1, root=comm.size)
    with pytest.raises(ValueError):         # unknown op, before a root that is not an integer
        sut.reduce(made.x, op="avg", root=1.5)
    with pytest.raises(ValueError):         # root out of range, before the illegal pair int/mean
        sut.reduce(imade.x, op="mean", root=comm.size)
    with pytest.raises(ValueError):         # root out of range, before the object dtype
        sut.reduce(np.array([object()], dtype=object), op="sum", root=comm.size)
    _still_usable(sut, comm, "the validation-order calls")

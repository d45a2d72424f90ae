"""Every collective x every op x every dtype x every layout x every root: the values, and the in-place rule.

docs/semantics.md: broadcast and allgather move every dtype bit for bit; allreduce and reduce compute the
element-wise reduction (bool: max = any, min = all; mean = sum / size); reduce's non-root ranks get x back
unchanged; allgather returns a new array of shape (size, *x.shape); writable NumPy arrays and torch tensors
are written in place (views: only their elements), the others get a new array of their own library.
"""

from __future__ import annotations

import numpy as np
import pytest

from . import _checks, _dtypes, _libs, _matrix
from ._dtypes import seed_of


def _setup(name, dtype, layout):
    lib = _libs.get(name)
    return lib, _dtypes.ALL[dtype], _libs.LAYOUTS[layout].shape


@pytest.mark.parametrize("lib_name,dtype,op,layout", _matrix.value_cases("broadcast"))
def test_broadcast(sut, comm, rec, lib_name, dtype, op, layout):
    lib, spec, shape = _setup(lib_name, dtype, layout)
    seed = seed_of("broadcast", lib_name, dtype, layout)
    steps = _checks.Steps()
    for root in _checks.roots(layout, comm.size, seed):
        with steps.step():
            what = f"broadcast(x, root={root}) on rank {comm.rank}"
            mine = _dtypes.random_bits(spec, shape, seed_of(seed, comm.rank))
            made = lib.make(spec, layout, mine, _checks.filler(spec, seed, comm.rank))
            before = _checks.Before(lib, spec, made)
            y = sut.broadcast(made.x, root=root)
            _checks.check_common(lib, spec, made.x, y, shape, what)
            want = _dtypes.random_bits(spec, shape, seed_of(seed, root))
            got = lib.to_bits(y, spec)
            if not _checks.same_bits(got, want):
                whose = [r for r in range(comm.size)
                         if _checks.same_bits(got, _dtypes.random_bits(spec, shape, seed_of(seed, r)))]
                raise AssertionError(
                    f"{what}: the result is not root {root}'s x, bit for bit"
                    + (f"; it is rank {whose[0]}'s" if whose else "")
                    + f": {_checks.first_difference(got, want)}")
            _checks.check_in_place(lib, spec, made, y, before, layout, what)
            rec.same_on_every_rank(f"root {root}", got.tobytes())
    steps.done()


@pytest.mark.parametrize("lib_name,dtype,op,layout", _matrix.value_cases("allgather"))
def test_allgather(sut, comm, rec, lib_name, dtype, op, layout):
    lib, spec, shape = _setup(lib_name, dtype, layout)
    seed = seed_of("allgather", lib_name, dtype, layout)
    what = f"allgather(x) on rank {comm.rank}"
    mine = _dtypes.random_bits(spec, shape, seed_of(seed, comm.rank))
    made = lib.make(spec, layout, mine, _checks.filler(spec, seed, comm.rank))
    before = _checks.Before(lib, spec, made)
    y = sut.allgather(made.x)
    _checks.check_common(lib, spec, made.x, y, (comm.size, *shape), what)
    assert y is not made.x, f"{what}: allgather returns a new array, got x itself"
    _checks.check_untouched(lib, spec, made, before, what)
    if lib.name.startswith("torch"):
        assert not y.requires_grad, f"{what}: a torch allgather result does not require grad"
    got = lib.to_bits(y, spec)
    for r in range(comm.size):
        want = _dtypes.random_bits(spec, shape, seed_of(seed, r))
        row = got[r, ...]  # an array, also for 0-d x (got[r] would be a NumPy scalar: bytes not kept)
        assert _checks.same_bits(row, want), (
            f"{what}: result[{r}] is not rank {r}'s x, bit for bit: {_checks.first_difference(row, want)}")
    rec.same_on_every_rank("result", got.tobytes())
    _checks.check_out(sut, "allgather", lib, spec, made.x, (comm.size, *shape), got, what)


def _reduction_data(spec, shape, op, seed, size):
    values = [_dtypes.exact_values(spec, shape, op, seed_of(seed, r)) for r in range(size)]
    want = _dtypes.reference(spec, op, np.stack(values) if values else np.empty((0, *shape), spec.value))
    return values, want


@pytest.mark.parametrize("lib_name,dtype,op,layout", _matrix.value_cases("allreduce"))
def test_allreduce(sut, comm, rec, lib_name, dtype, op, layout):
    lib, spec, shape = _setup(lib_name, dtype, layout)
    seed = seed_of("allreduce", lib_name, dtype, op, layout)
    what = f"allreduce(x, op={op!r}) on rank {comm.rank}"
    values, want = _reduction_data(spec, shape, op, seed, comm.size)
    made = lib.make(spec, layout, spec.from_values(values[comm.rank]), _checks.filler(spec, seed, comm.rank))
    before = _checks.Before(lib, spec, made)
    y = sut.allreduce(made.x, op=op)
    _checks.check_common(lib, spec, made.x, y, shape, what)
    _checks.check_in_place(lib, spec, made, y, before, layout, what)
    bits = lib.to_bits(y, spec)
    _checks.check_reduced(spec, op, spec.to_values(bits), want, what)
    rec.same_on_every_rank("result", _dtypes.canonical_bytes(spec, bits))


@pytest.mark.parametrize("lib_name,dtype,op,layout", _matrix.value_cases("reduce"))
def test_reduce(sut, comm, rec, lib_name, dtype, op, layout):
    lib, spec, shape = _setup(lib_name, dtype, layout)
    seed = seed_of("reduce", lib_name, dtype, op, layout)
    values, want = _reduction_data(spec, shape, op, seed, comm.size)
    steps = _checks.Steps()
    every = op == _matrix.every_root_op(lib_name, spec)
    for root in _checks.roots(layout, comm.size, seed, every):
        with steps.step():
            what = f"reduce(x, op={op!r}, root={root}) on rank {comm.rank}"
            made = lib.make(spec, layout, spec.from_values(values[comm.rank]), _checks.filler(spec, seed, comm.rank))
            before = _checks.Before(lib, spec, made)
            y = sut.reduce(made.x, op=op, root=root)
            if comm.rank != root:
                assert y is made.x, f"{what}: a non-root rank gets x itself back; got another object"
                _checks.check_untouched(lib, spec, made, before, what + " (non-root: x must be unchanged)")
                continue
            _checks.check_common(lib, spec, made.x, y, shape, what)
            _checks.check_in_place(lib, spec, made, y, before, layout, what)
            _checks.check_reduced(spec, op, spec.to_values(lib.to_bits(y, spec)), want, what)
    steps.done()

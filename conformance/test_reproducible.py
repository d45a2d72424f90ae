"""Reproducible sums (``reproducible=True``): a row per collective and dtype, every library and backend.

docs/semantics.md, "Reproducible sums": ``allreduce`` and ``reduce`` with ``reproducible=True`` compute
``sum`` and ``mean`` of float16, bfloat16, float32, float64, complex64 and complex128 with the ordinary
call's contract (shape, dtype, library, in place, non-root ranks get x back) and values (exact where the
exact sum is representable); the bits are the same on every rank and the same as one rank's reproducible
sum of every rank's values (``allreduce_units`` on a communicator of its own: the result does not depend
on the number of ranks). Arrays in CUDA memory (the CUDA backends) too: the same bits as host arrays of
the same values, whatever the transport (NCCL's own sum is not reproducible).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from . import _checks, _dtypes, _libs, _matrix
from ._dtypes import seed_of

DTYPES = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128")
OPS = ("sum", "mean")


def cases(collective: str) -> list:
    out = []
    for name in _matrix.usable_libs():
        lib = _libs.get(name)
        index = 0
        for spec in lib.dtypes():
            if spec.name not in DTYPES:
                continue
            for op in OPS:
                for layout in _matrix.layouts_for(lib, f"{collective}-reproducible-{name}", index):
                    out.append(pytest.param(name, spec.name, op, layout, id="-".join((name, spec.name, op, layout)),
                                            marks=_matrix.meta(collective=f"{collective} (reproducible)", lib=name,
                                                               dtype=spec.name, op=op, layout=layout)))
                index += 1
    return out


def _supported(sut, collective: str) -> None:
    if "reproducible" not in inspect.signature(getattr(sut, collective)).parameters:
        pytest.skip(f"the system under test's {collective} has no reproducible= keyword")


def _solo_bits(sut, comm, spec, values, op):
    """This rank's reproducible sum of every rank's values (``allreduce_units`` alone), as storage bits; None
    where that cannot be asked (no allreduce_units or split, or bfloat16, which NumPy has no type for)."""
    if spec.name == "bfloat16" or not hasattr(sut, "allreduce_units") or not hasattr(comm, "split"):
        return None
    alone = comm.split(color=comm.rank)
    try:
        stack = np.stack([spec.from_values(v) for v in values])
        return np.asarray(sut.allreduce_units(stack, op, comm=alone))
    finally:
        alone.close()


def _data(spec, shape, op, seed, size, exact: bool):
    if exact:
        values = [_dtypes.exact_values(spec, shape, op, seed_of(seed, r)) for r in range(size)]
        return values, _dtypes.reference(spec, op, np.stack(values) if values else np.empty((0, *shape), spec.value))
    rng = np.random.default_rng(seed)
    scale = 2.0 ** rng.integers(-8, 9, (size, *shape))
    v = rng.standard_normal((size, *shape)) * scale
    if spec.kind == "c":
        v = v + 1j * rng.standard_normal((size, *shape))
    return [v[r].astype(spec.value) for r in range(size)], None


@pytest.mark.parametrize("lib_name,dtype,op,layout", cases("allreduce"))
def test_reproducible_allreduce(sut, comm, rec, lib_name, dtype, op, layout):
    _supported(sut, "allreduce")
    lib, spec, shape = _libs.get(lib_name), _dtypes.ALL[dtype], _libs.LAYOUTS[layout].shape
    seed = seed_of("allreduce-reproducible", lib_name, dtype, op, layout)
    for exact in (True, False):
        what = f"allreduce(x, op={op!r}, reproducible=True) on rank {comm.rank} ({'exact' if exact else 'random'} values)"
        values, want = _data(spec, shape, op, seed + exact, comm.size, exact)
        made = lib.make(spec, layout, spec.from_values(values[comm.rank]), _checks.filler(spec, seed, comm.rank))
        before = _checks.Before(lib, spec, made)
        y = sut.allreduce(made.x, op=op, reproducible=True)
        _checks.check_common(lib, spec, made.x, y, shape, what)
        _checks.check_in_place(lib, spec, made, y, before, layout, what)
        bits = lib.to_bits(y, spec)
        if exact:
            _checks.check_reduced(spec, op, spec.to_values(bits), want, what)
        solo = _solo_bits(sut, comm, spec, values, op)
        if solo is not None:
            assert _checks.same_bits(np.asarray(bits).reshape(-1), solo.reshape(-1).view(spec.storage)), (
                f"{what}: not the bits of one rank's reproducible sum of every rank's values: "
                f"{_checks.first_difference(np.asarray(bits).reshape(-1), solo.reshape(-1).view(spec.storage))}")
        rec.same_on_every_rank(f"result ({'exact' if exact else 'random'})", _dtypes.canonical_bytes(spec, bits))


@pytest.mark.parametrize("lib_name,dtype,op,layout", cases("reduce"))
def test_reproducible_reduce(sut, comm, rec, lib_name, dtype, op, layout):
    _supported(sut, "reduce")
    lib, spec, shape = _libs.get(lib_name), _dtypes.ALL[dtype], _libs.LAYOUTS[layout].shape
    seed = seed_of("reduce-reproducible", lib_name, dtype, op, layout)
    root = comm.size - 1
    what = f"reduce(x, op={op!r}, root={root}, reproducible=True) on rank {comm.rank}"
    values, _ = _data(spec, shape, op, seed, comm.size, exact=False)
    made = lib.make(spec, layout, spec.from_values(values[comm.rank]), _checks.filler(spec, seed, comm.rank))
    solo = _solo_bits(sut, comm, spec, values, op)  # (collective: every rank)
    before = _checks.Before(lib, spec, made)
    y = sut.reduce(made.x, op=op, root=root, reproducible=True)
    if comm.rank != root:
        assert y is made.x, f"{what}: a non-root rank gets x itself back; got another object"
        _checks.check_untouched(lib, spec, made, before, what + " (non-root: x must be unchanged)")
        return
    _checks.check_common(lib, spec, made.x, y, shape, what)
    _checks.check_in_place(lib, spec, made, y, before, layout, what)
    bits = lib.to_bits(y, spec)
    if solo is not None:  # the allreduce's bits (one rank's sum of every rank's values: see above)
        assert _checks.same_bits(np.asarray(bits).reshape(-1), solo.reshape(-1).view(spec.storage)), (
                f"{what}: not the bits of the reproducible allreduce: "
                f"{_checks.first_difference(np.asarray(bits).reshape(-1), solo.reshape(-1).view(spec.storage))}")

"""Checks shared by the tests: the documented in-place rule, values, bits. Every message says what the
documentation expects and what the system under test did."""

from __future__ import annotations

import numpy as np

from . import _dtypes, _libs, _options
from ._dtypes import Spec
from ._libs import Lib, Made


class Before:
    """An input's bits (and its base's) before the call, to prove what changed and what did not."""

    def __init__(self, lib: Lib, spec: Spec, made: Made):
        self.x = lib.to_bits(made.x, spec)
        self.base = None if made.base is None else lib.to_bits(made.base, spec)
        self.layout = lib.layout_state(made.x)


def roots(layout: str, size: int, seed: int, every: bool = True) -> list[int]:
    """Every root in the full suite; sampled: every root on the canonical layout (when ``every``), else one,
    rotating with the seed."""
    if _options.get().full or (every and layout == _libs.CANONICAL):
        return list(range(size))
    return [(seed + _options.get().seed) % size]


def filler(spec: Spec, seed: int, rank: int) -> np.ndarray:
    """Bits for the part of a view's base outside the view (rank-specific: a stray write shows)."""
    return _dtypes.random_bits(spec, (30,), _dtypes.seed_of(seed, "filler", rank))


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def first_difference(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    g = np.ascontiguousarray(got).reshape(-1)
    w = np.ascontiguousarray(want).reshape(-1)
    if g.dtype.kind == "V" or g.dtype.kind in "MmU":
        bad = [i for i in range(g.size) if g[i:i + 1].tobytes() != w[i:i + 1].tobytes()]
    else:
        gb = g.view(np.uint8).reshape(g.size, -1)
        wb = w.view(np.uint8).reshape(w.size, -1)
        bad = np.flatnonzero((gb != wb).any(axis=1)).tolist()
    if not bad:
        return "no difference"
    i = bad[0]
    return f"{len(bad)} of {g.size} elements differ; first at flat index {i}: got {g[i]!r}, expected {w[i]!r}"


def check_common(lib: Lib, spec: Spec, x, y, shape: tuple, what: str) -> None:
    """Type, dtype, shape and device of a result."""
    assert y is not None, f"{what}: returned None; the docs say results are always returned"
    assert lib.is_native(y, x), (f"{what}: returned a {type(y).__module__}.{type(y).__name__}; expected an "
                                 f"array of x's library ({lib.name}) on x's device")
    assert lib.dtype_name(y) == lib.dtype_name(x), (
        f"{what}: result dtype {lib.dtype_name(y)}, expected x's dtype {lib.dtype_name(x)}")
    assert lib.shape(y) == tuple(shape), f"{what}: result shape {lib.shape(y)}, expected {tuple(shape)}"
    assert lib.same_device(y, x), f"{what}: the result is on another device than x"


def check_in_place(lib: Lib, spec: Spec, made: Made, y, before: Before, layout: str, what: str,
                   want_bits: np.ndarray | None = None) -> None:
    """The documented in-place rule for broadcast, allreduce and reduce on root."""
    x = made.x
    if lib.writable(layout):
        assert y is x, (f"{what}: x is a writable {lib.name} array ({layout}): the docs say the result is "
                        f"written into x and x itself is returned; got a different object")
        assert lib.layout_state(x) == before.layout, f"{what}: x's memory layout (strides/storage) changed"
        if made.base is not None:
            base = lib.to_bits(made.base, spec)
            inside = np.zeros(before.base.shape, dtype=bool)
            inside[made.inside] = True
            assert same_bits(base[~inside], before.base[~inside]), (
                f"{what}: elements of the base array outside the view changed: only the view's elements may "
                f"change ({first_difference(base[~inside], before.base[~inside])})")
            assert same_bits(base[made.inside], lib.to_bits(y, spec)), (
                f"{what}: the view's elements in the base array do not hold the result (the result must be "
                f"written into x's memory)")
    else:
        assert y is not x, (f"{what}: x cannot be written ({lib.name}, {layout}): the docs say a new array is "
                            f"returned, but x itself came back")
        now = lib.to_bits(x, spec)
        assert same_bits(now, before.x), f"{what}: the input was modified: {first_difference(now, before.x)}"
    if want_bits is not None:
        got = lib.to_bits(y, spec)
        assert same_bits(got, want_bits), f"{what}: wrong bits: {first_difference(got, want_bits)}"


def check_untouched(lib: Lib, spec: Spec, made: Made, before: Before, what: str) -> None:
    now = lib.to_bits(made.x, spec)
    assert same_bits(now, before.x), f"{what}: the input was modified: {first_difference(now, before.x)}"
    if made.base is not None:
        base = lib.to_bits(made.base, spec)
        assert same_bits(base, before.base), f"{what}: the view's base array was modified"
    assert lib.layout_state(made.x) == before.layout, f"{what}: x's memory layout changed"


def check_reduced(spec: Spec, op: str, got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Values of a reduction: exact, except where the docs allow rounding (see _dtypes.tolerance)."""
    tol = _dtypes.tolerance(spec, op)
    if tol == 0:
        ok = got.shape == want.shape and np.array_equal(got, want)
        assert ok, f"{what}: wrong values: {first_difference(got.astype(want.dtype), want)}"
        return
    wide = np.longdouble if spec.value.itemsize > 8 and spec.kind == "f" else (
        np.clongdouble if spec.value.itemsize > 16 else (np.complex128 if spec.kind == "c" else np.float64))
    g = got.astype(wide)
    w = want.astype(wide)
    assert g.shape == w.shape, f"{what}: shape {g.shape}, expected {w.shape}"
    err = np.abs(g - w)
    bad = np.flatnonzero(err > tol * np.abs(w))
    assert bad.size == 0, (f"{what}: {bad.size} of {w.size} values off by more than rtol={tol:g}; first at "
                           f"flat index {bad[0]}: got {g.reshape(-1)[bad[0]]!r}, expected {w.reshape(-1)[bad[0]]!r}")


class Steps:
    """Run every step of a loop (e.g. every root) on every rank even when one step fails on some rank, so
    that all ranks make the same sequence of collective calls; the first failure is raised at the end."""

    def __init__(self):
        self.first: BaseException | None = None

    def step(self):
        return _Step(self)

    def done(self) -> None:
        if self.first is not None:
            raise self.first


class _Step:
    def __init__(self, steps: Steps):
        self.steps = steps

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or not isinstance(exc, Exception):
            return False
        if self.steps.first is None:
            self.steps.first = exc
        return True


def check_out(sut, collective: str, lib: Lib, spec: Spec, x, shape: tuple, got: np.ndarray, what: str,
              **kwargs) -> None:
    """``collective(x, out=out, **kwargs)``, where the system under test takes ``out=``: for a library whose
    arrays are written in place (NumPy, torch, CuPy), ``out`` itself is returned, holding ``got`` (the bits
    of the same call's new array) bit for bit; for the others (array-api-strict, JAX) a ``TypeError``."""
    import inspect

    call = getattr(sut, collective)
    if "out" not in inspect.signature(call).parameters:
        return
    out = lib.from_bits(np.zeros(shape, spec.storage), spec)
    what = what.replace("(x", "(x, out=out", 1)
    if not lib.writable("1d"):
        try:
            call(x, out=out, **kwargs)
        except TypeError:
            return
        raise AssertionError(f"{what}: a {lib.name} array is not written in place, so out= must be a TypeError")
    y = call(x, out=out, **kwargs)
    assert y is out, f"{what}: returns out itself, got {type(y).__name__}"
    assert same_bits(lib.to_bits(out, spec), got), (
        f"{what}: out does not hold the bits of the same call without out: "
        f"{first_difference(lib.to_bits(out, spec), got)}")

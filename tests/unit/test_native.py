"""The compiled pass of the node-shared window's float sums and means (``_native.adder``, ``_kernels.c``):
the bits of NumPy's add, term by term in rank order, then its divide, on data whose sums round (random
magnitudes over many binades), with NaN, infinities, signed zeros and subnormals, for 2 to 6 terms, and
with the result written over one of the terms (a rank's own data)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from collectives import _native


def adder_or_skip(dtype):
    add = _native.adder(np.dtype(dtype))
    if add is None:
        if os.environ.get("COLLECTIVES_TEST_REQUIRE_KERNELS") == "1":  # CI builds them: a missing build fails
            pytest.fail("the compiled passes (collectives/_kernels*.so) did not load")
        pytest.skip("collectives was built without its compiled passes (no C compiler)")
    return add


def numpy_bits(terms, divisor):
    res = np.empty_like(terms[0])
    np.add(terms[0], terms[1], out=res)
    for t in terms[2:]:
        np.add(res, t, out=res)
    with np.errstate(all="ignore"):
        return res, (res.copy() if divisor is None else np.divide(res, divisor))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("k", [2, 3, 4, 6])
@pytest.mark.parametrize("mean", [False, True])
def test_the_compiled_pass_gives_numpys_bits(dtype, k, mean):
    add = adder_or_skip(dtype)
    rng = np.random.default_rng([k, mean])
    n = 5000 + 17  # several blocks of the pass, and a partial one
    tiny = np.finfo(dtype).smallest_subnormal
    with np.errstate(all="ignore"):
        terms = [(rng.standard_normal(n) * np.exp2(rng.integers(-80, 80, n))).astype(dtype) for _ in range(k)]
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, tiny, -tiny, np.finfo(dtype).max], dtype=dtype)
    for t in terms:
        at = rng.integers(0, n, 300)
        t[at] = rng.choice(specials, at.size)
    divisor = float(k) if mean else None
    want_res, want = numpy_bits(terms, divisor)
    res, out = np.empty(n, dtype), np.empty(n, dtype)
    add(terms, res, out, divisor)
    assert res.tobytes() == want_res.tobytes() and out.tobytes() == want.tobytes()
    own = terms[k - 1].copy()  # the result written over the rank's own term
    add([*terms[:k - 1], own], res, own, divisor)
    assert own.tobytes() == want.tobytes()


def test_no_adder_for_other_dtypes():
    for dtype in ("float16", "int64", "complex64", ">f8"):
        assert _native.adder(np.dtype(dtype)) is None

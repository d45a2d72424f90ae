"""The conversions of reproducible sums (``collectives._reproducible``), in one process.

What the collectives build on, checked for any values hypothesis finds: the words of any grouping of the
units (each group's words summed as a rank's, the groups' sums added in any order, as a transport would)
decode to the same bits; the result is within the documented bound of the exact sum (``Fraction``), and
correctly rounded where the fixed point is exact; NaN, inf and the sign of zero are IEEE addition's; every
partial sum of words is an integer below 2**52 (so float64 adds them exactly). These are private functions:
the public calls can only show their effect through MPI (tests/mpi/test_reproducible.py); here every
grouping and order can be tried in one process.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
import os
from fractions import Fraction

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectives import _dtypes
from collectives import _reproducible as rp

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
REALS = {"float16": np.float16, "float32": np.float32, "float64": np.float64}


def info_of(name: str):
    return _dtypes.bfloat16() if name == "bfloat16" else _dtypes.from_numpy(np.dtype(name))


def storage(values: np.ndarray, name: str) -> np.ndarray:
    """float64 values exact in ``name`` as its storage array (bfloat16: its uint16 bits)."""
    if name == "bfloat16":
        bits = values.astype(np.float32).view(np.uint32)
        assert not (bits & 0xFFFF).any()
        return (bits >> 16).astype(np.uint16)
    return values.astype(REALS[name])


def as_float64(out: np.ndarray, name: str) -> np.ndarray:
    if name == "bfloat16":
        return _dtypes.bf16_to_f32(out).astype(np.float64)
    return out.astype(np.float64)


def floats_of(name: str):
    width = {"float16": 16, "bfloat16": 32, "float32": 32, "float64": 64}[name]
    strategy = st.floats(width=width, allow_nan=True, allow_infinity=True)
    if name == "bfloat16":  # float32 values with bfloat16's 8 bits
        strategy = strategy.map(_bfloat16)
    return strategy


def _bfloat16(v: float) -> float:
    """``v`` (a float32) cut to bfloat16's bits."""
    bits = np.array([v], dtype=np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return float(bits.view(np.float32)[0])


@st.composite
def stacks(draw, name: str):
    k = draw(st.integers(1, 6))
    n = draw(st.integers(1, 9))
    values = draw(st.lists(floats_of(name), min_size=k * n, max_size=k * n))
    with np.errstate(all="ignore"):
        return np.array(values, dtype=np.float64).reshape(k, n)


def summed(values: np.ndarray, name: str, op: str, groups: list[list[int]], order: list[int]) -> np.ndarray:
    """The reproducible ``op`` of the rows of ``values``, the rows shared among ``groups`` (ranks), each
    group's words made by ``encode`` of its rows, the words added group by group in ``order``."""
    info = info_of(name)
    units = storage(values, name)
    codes = functools.reduce(np.maximum, [rp.codes(units[g], info) for g in groups])  # the max allreduce
    words = [rp.encode(units[g], info, codes) for g in groups]
    total = words[order[0]].copy()
    for i in order[1:]:
        total += words[i]  # what any transport's sum does: float64 additions of integers
        assert (np.abs(total) < 2.0 ** 52).all() and (total == np.trunc(total)).all()
    out = np.empty(values.shape[1], dtype=info.storage)
    rp.decode(total, info, codes, op, out)
    return out


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "mean"])
@given(data=st.data())
@SETTINGS
def test_any_grouping_and_order_gives_the_same_bits_within_the_bound(name, op, data):
    values = data.draw(stacks(name))
    k = values.shape[0]
    one = summed(values, name, op, [list(range(k))], [0])
    perm = data.draw(st.permutations(range(k)))
    cuts = sorted(data.draw(st.lists(st.integers(0, k), max_size=3)))
    bounds = [0, *cuts, k]
    groups = [list(perm[a:b]) for a, b in itertools.pairwise(bounds)]
    order = data.draw(st.permutations(range(len(groups))))
    assert summed(values, name, op, groups, list(order)).tobytes() == one.tobytes()
    check_against_exact(as_float64(one, name), values, name, op)
    # the node-shared window's kernel: every rank's terms at once, in any order, the same bits
    info, units = info_of(name), storage(values, name)
    out = np.empty(values.shape[1], dtype=info.storage)
    rp.sum_terms([units[i].copy() for i in perm], info, op, out)
    assert out.tobytes() == one.tobytes()


def check_against_exact(result: np.ndarray, values: np.ndarray, name: str, op: str) -> None:
    k = values.shape[0]
    fmt = rp.format_of(info_of(name))
    real = np.float16 if name == "float16" else np.float32 if name in ("float32", "bfloat16") else np.float64
    for j, r in enumerate(result.tolist()):
        col = values[:, j].tolist()
        if not all(map(math.isfinite, col)) or all(v == 0 for v in col):
            ieee = functools.reduce(operator.add, col)
            if op == "mean":
                ieee /= k
            assert (math.isnan(r) and math.isnan(ieee)) or (r == ieee and math.copysign(1, r) == math.copysign(1, ieee))
            continue
        exact = sum(map(Fraction, col), Fraction(0)) / (k if op == "mean" else 1)
        if math.isinf(r):
            assert abs(exact) > float(np.finfo(real).max) * (1 - 2.0 ** -9)
            continue
        e = max(math.frexp(v)[1] for v in col)
        quantum = Fraction(2) ** (max(e, 3 - fmt.bias) - rp.S * fmt.words)
        ulp = ulp_of(r, name)
        bound = k * quantum + Fraction(ulp) / 2 if op == "sum" else quantum + 2 * Fraction(ulp)
        assert abs(Fraction(r) - exact) <= bound, (j, r, float(exact), float(bound))


@given(data=st.data())
@SETTINGS
def test_float16_sums_are_the_exact_sum_correctly_rounded(data):
    values = data.draw(stacks("float16"))
    values[~np.isfinite(values)] = 1.0
    got = summed(values, "float16", "sum", [list(range(values.shape[0]))], [0])
    exact = [float(sum(map(Fraction, values[:, j].tolist()), Fraction(0))) for j in range(values.shape[1])]
    want = np.array(exact, dtype=np.float64).astype(np.float16)  # (the float64 of the sum is exact here)
    zero = want == 0
    want[zero & (values == 0).all(axis=0) & np.signbit(values).all(axis=0)] = -0.0
    assert got.tobytes() == want.tobytes()


def test_complex_parts_are_summed_apart():
    info = _dtypes.from_numpy(np.dtype(np.complex64))
    units = np.array([[1 + 2j, np.inf - 0j], [1e-30 - 2j, 1 - 0j]], dtype=np.complex64)
    codes = rp.codes(units, info)
    out = np.empty(2, dtype=np.complex64)
    rp.decode(rp.encode(units, info, codes), info, codes, "sum", out)
    assert out.view(np.float32).tolist() == [1.0, 0.0, np.inf, -0.0]


def test_bad_pairs():
    with pytest.raises(ValueError, match="op='sum' and op='mean'"):
        rp.check(info_of("float32"), "max")
    with pytest.raises(TypeError, match="integer sums are exact"):
        rp.check(_dtypes.from_numpy(np.dtype(np.int32)), "sum")
    with pytest.raises(TypeError, match="complex64/128"):
        rp.check(_dtypes.from_numpy(np.dtype(np.longdouble)), "sum")
    assert rp.applies(info_of("bfloat16"), "mean") and not rp.applies(info_of("float32"), "prod")


PRECISION = {"float16": (11, -24), "bfloat16": (8, -133), "float32": (24, -149), "float64": (53, -1074)}


def ulp_of(r: float, dtype: str) -> float:
    """The spacing of ``dtype``'s values at ``r`` (its binade's; complex: of a part)."""
    bits, tiny = PRECISION[{"complex64": "float32", "complex128": "float64"}.get(dtype, dtype)]
    return math.ldexp(1.0, max(math.frexp(r)[1] - bits, tiny)) if r else math.ldexp(1.0, tiny)


@pytest.mark.parametrize("name", ["float32", "float64"])
def test_normal_terms_give_the_correctly_rounded_sum(name):
    """The measured claim of docs/semantics.md, smaller: seeded normal terms, 8 and 64 per element."""
    dtype = np.dtype(name)
    for k in (8, 64):
        values = np.random.default_rng(k).standard_normal((k, 300)).astype(dtype).astype(np.float64)
        got = summed(values, name, "sum", [list(range(k))], [0])
        for j in range(values.shape[1]):
            exact = sum(map(Fraction, values[:, j].tolist()), Fraction(0))
            want = float(exact) if name == "float64" else _round_f32(exact)
            assert float(got[j]) == want, (k, j)


def _round_f32(exact: Fraction) -> float:
    """``exact`` correctly rounded to float32 (ties to even), without a float64 in between."""
    if exact == 0:
        return 0.0
    e = math.frexp(float(exact))[1]
    if abs(exact) < Fraction(2) ** (e - 1):  # float() rounded up into the next binade
        e -= 1
    scale = Fraction(2) ** (e - 24)
    q = exact / scale
    n = math.floor(q)
    rest = q - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2):
        n += 1
    return float(n * scale)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64", "complex64"])
@pytest.mark.parametrize("k", [1, 3])
def test_codes_of_mostly_zeros(name, k):
    """The exponent codes of stacks that are mostly +0.0 and -0.0 (a ReLU network's gradients), across
    more than one piece of ``CHUNK`` elements, against the definition written plainly per element: the
    exponent field, at least 2; +0.0 is 1, -0.0 is 0; the largest over the units."""
    info = info_of(name)
    fmt = rp.format_of(info)
    rng = np.random.default_rng(7)
    n = rp.CHUNK + 5 if k == 1 else 1000
    m = 2 * n if name == "complex64" else n  # real parts
    with np.errstate(all="ignore"):
        values = rng.standard_normal((k, m)) * np.exp2(rng.integers(-1100, 1100, (k, m)))
        real = values.astype(np.float32 if name in ("bfloat16", "complex64") else REALS[name])
    bits = real.view(np.uint32) >> 16 if name == "bfloat16" else real.view(fmt.bits)
    bits = bits.astype(fmt.bits)
    which = rng.random((k, m))
    bits[which < 0.4] = 0  # +0.0
    bits[which > 0.9] = fmt.bits.type(1 << (fmt.bits.itemsize * 8 - 1))  # -0.0
    units = bits.view(info.storage)
    got = rp.codes(units, info)
    wide = bits.astype(np.int64) if fmt.bits.itemsize < 8 else bits
    field = ((wide >> fmt.mbits) & fmt.emask).astype(np.int64)
    sign_only = fmt.bits.type(1 << (fmt.bits.itemsize * 8 - 1))
    want = np.where(bits == 0, 1, np.where(bits == sign_only, 0, np.maximum(field, 2)))
    np.testing.assert_array_equal(got, want.max(axis=0).astype(got.dtype))


# ---- the compiled float32 passes (_kernels.c) against the NumPy passes ----

@contextlib.contextmanager
def numpy_passes():
    """The NumPy passes alone, the compiled ones set aside through the private ``_reproducible._compiled``:
    no public name chooses between them (they give the same bits by design, which these tests check)."""
    saved = list(rp._compiled)
    rp._compiled[:] = [None]
    try:
        yield
    finally:
        rp._compiled[:] = saved


def compiled_or_skip():
    if rp.compiled() is None:
        if os.environ.get("COLLECTIVES_TEST_REQUIRE_KERNELS") == "1":  # CI builds them: a missing build fails
            pytest.fail("the compiled float32 passes (collectives/_kernels*.so) did not load")
        pytest.skip("collectives was built without its compiled passes (no C compiler)")


def both_passes(units: np.ndarray, name: str, op: str, groups: list[list[int]]) -> None:
    """Codes, words (each group's, as a rank's), the decoded result and ``sum_terms``: the compiled passes
    give NumPy's codes, NumPy's word values (a zero's sign aside: decoding makes every zero sum +0.0) and
    NumPy's bytes."""
    info = info_of(name)
    results = []
    for numpy_only in (False, True):
        with numpy_passes() if numpy_only else contextlib.nullcontext():
            codes = functools.reduce(np.maximum, [rp.codes(units[g], info) for g in groups])
            words = [rp.encode(units[g], info, codes) for g in groups]
            total = functools.reduce(operator.add, words)
            out = np.empty(units.shape[1], dtype=info.storage)
            rp.decode(total, info, codes, op, out)
            terms = np.empty_like(out)
            rp.sum_terms(list(units), info, op, terms)
            results.append((codes, words, out, terms))
    (c1, w1, o1, t1), (c2, w2, o2, t2) = results
    np.testing.assert_array_equal(c1, c2)
    for a, b in zip(w1, w2):
        np.testing.assert_array_equal(a, b)  # (== on floats: -0.0 equals +0.0)
    assert o1.tobytes() == o2.tobytes()
    assert t1.tobytes() == t2.tobytes() == o2.tobytes()


@pytest.mark.parametrize("op", ["sum", "mean"])
@given(data=st.data())
@SETTINGS
def test_the_compiled_passes_give_the_numpy_bits(op, data):
    compiled_or_skip()
    values = data.draw(stacks("float32"))
    k = values.shape[0]
    cut = data.draw(st.integers(0, k))
    both_passes(storage(values, "float32"), "float32", op, [list(range(cut)), list(range(cut, k))])


@pytest.mark.parametrize("name", ["float32", "complex64"])
def test_the_compiled_passes_across_pieces_and_specials(name):
    """Long rows (several of the compiled sum's pieces of 2048 elements, vector loops and their tails) of
    extreme exponents, subnormals, zeros of both signs, NaN and infinities: the NumPy passes' bits."""
    compiled_or_skip()
    rng = np.random.default_rng(11)
    k, n = 5, 2 * 2048 + 37
    with np.errstate(all="ignore"):
        real = (rng.standard_normal((k, 2 * n if name == "complex64" else n))
                * np.exp2(rng.integers(-160, 130, (k, 2 * n if name == "complex64" else n)))).astype(np.float32)
    which = rng.random(real.shape)
    real[which < 0.1] = 0.0
    real[which > 0.95] = -0.0
    real[:, :7] = [[np.nan, np.inf, -np.inf, np.inf, -0.0, 0.0, 1e-45]] * k
    real[1:, 3] = -np.inf  # +inf and -inf: NaN
    units = real.view(np.complex64) if name == "complex64" else real
    for op in ("sum", "mean"):
        both_passes(units, name, op, [[0, 3], [1], [2, 4]])
        for k in (1, 2, 3, 4):  # sum_terms has a fused pass for 2 to 4 terms
            both_passes(units[:k], name, op, [list(range(k))])


def test_the_compiled_sum_refuses_a_term_count_it_does_not_take():
    """``coll_sum_f32`` takes 1 to ``FUSED_TERMS`` terms; outside that it returns its error status and writes
    nothing (``sum_terms`` passes more terms to the passes one by one, so it never asks). Through the loaded
    library (a private: no public call can pass it such a count); its bits at 65 terms are NumPy's."""
    compiled_or_skip()
    fast = rp.compiled()
    terms = [np.full(9, 1.5, np.float32) for _ in range(rp.FUSED_TERMS + 1)]
    out = np.full(9, 7.0, np.float32)
    for k in (0, rp.FUSED_TERMS + 1):
        assert fast.sum(fast.table(terms), k, 9, 0, out.ctypes.data) == 1
        assert (out == 7.0).all()  # untouched
    assert fast.sum(fast.table(terms), rp.FUSED_TERMS, 9, 0, out.ctypes.data) == 0
    assert (out == 1.5 * rp.FUSED_TERMS).all()
    info = info_of("float32")
    rp.sum_terms(terms, info, "sum", out)  # 65 terms: the passes one by one
    with numpy_passes():
        expected = np.empty_like(out)
        rp.sum_terms(terms, info, "sum", expected)
    assert out.tobytes() == expected.tobytes() and (out == 1.5 * (rp.FUSED_TERMS + 1)).all()

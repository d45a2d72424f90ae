"""Reproducible sums: the same bits for any number of ranks, any split of the terms, any order.

A float sum changes with the order of its additions, and the order changes with the number of ranks, the
algorithm and the message size. ``reproducible=True`` sums fixed-point integers instead, in two
collectives:

1. **the exponents** (:func:`codes`): per element, a small integer code of each term's binary exponent
   (one byte per element for float16, bfloat16 and float32, two for float64), with three special codes:
   ``0`` for -0.0, ``1`` for +0.0 and ``emask`` (the all-ones exponent field) for inf and NaN. The codes
   are allreduced with ``max``: every rank learns, per element, ``E``, a power of two above every term's
   magnitude (``|x| < 2**E``), whether every term is -0.0, and whether some term is inf or NaN;
2. **the fixed-point words** (:func:`encode`): each term ``x`` as ``trunc(x * 2**(S - E))`` (``S`` =
   :data:`S` fraction bits; float64 gets a second word with the next ``S`` bits), an integer below
   ``2**S`` held in a float64, the words of a rank's own terms summed locally, those sums summed over the
   ranks with ``sum``. Every partial sum, in any order and grouping, is an integer below ``2**52``: float64
   adds it exactly, so the sum is the same integer whatever the number of ranks, the split of the terms,
   their order, the algorithm or the transport. One more word carries the number of terms. Where some
   term is inf or NaN, the first word instead counts NaNs, +infs and -infs.

The integer sum is then converted back once (:func:`decode`), correctly rounded to the caller's dtype;
mean divides it by the number of terms in float64, then rounds once more into the dtype.

**Bound.** Every term loses less than one unit of its last word, ``2**(E - S*WORDS)``, so with ``N`` terms
``|sum - exact| < N * 2**(E - S*WORDS) + ulp(sum)/2``, and ``|mean - exact/N| < 2**(E - S*WORDS) +
2 * ulp(mean)``. float16 sums are exact before the final rounding (every float16 is a multiple of
``2**-24``, and ``2**(E - S)`` divides it): their result is the correctly rounded sum. At most
:data:`MAX_TERMS` terms per element (every rank's units together).

**Specials**, as IEEE addition (and so the ordinary path) gives them: a NaN anywhere, or +inf and -inf
together, is NaN; otherwise an inf is that inf; a sum of only -0.0 terms is -0.0; an exact cancellation
is +0.0; a finite sum beyond the dtype's range rounds to inf.

NumPy passes, run in pieces of :data:`CHUNK` elements (the temporaries stay in cache), ignoring the
caller's NumPy error state; for float32 (and complex64's parts) the compiled passes of ``_kernels.c``
instead where the package was built with them (:func:`compiled`), which give the same integers. Where one
process sees every term of an element (the node-shared window), :func:`sum_terms` computes the whole sum.

Example:
    >>> import numpy as np
    >>> from collectives import _dtypes, _reproducible as rp
    >>> info = _dtypes.from_numpy(np.dtype(np.float32))
    >>> units = np.array([[1e8, -0.0], [1.0, -0.0], [-1e8, -0.0]], dtype=np.float32)   # three terms
    >>> float((units[0, 0] + units[1, 0]) + units[2, 0])            # float32, in this order: 1.0 is lost
    0.0
    >>> c = rp.codes(units, info)              # each rank's; allreduced with max over the ranks
    >>> words = rp.encode(units, info, c)      # each rank's; allreduced with sum over the ranks
    >>> out = np.empty(2, dtype=np.float32)
    >>> rp.decode(words, info, c, "sum", out)
    >>> out.tolist()
    [1.0, -0.0]
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _dtypes

MAX_TERMS = 1 << 16  # terms per element a reproducible sum may have (every rank's units together)
FUSED_TERMS = 64  # the most terms the compiled sum takes at once (_kernels.c MAX_TERMS; more: the passes one by one)
S = 52 - 16  # fraction bits of one word: MAX_TERMS words below 2**S sum to below 2**52 (exact in float64)
CHUNK = 1 << 15  # elements per piece of the conversions
OPS = ("sum", "mean")
_NAN_AT, _PINF_AT = 2.0 ** 34, 2.0 ** 17  # a special element's first word: NaNs * 2**34 + infs * 2**17 + -infs
_F64 = np.dtype(np.float64)
_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
_TWO_S = float(2.0 ** S)
_INV_TWO_S = float(2.0 ** -S)


class _Compiled:
    """The compiled passes for float32 terms (``_kernels.c``, built with the package where a C compiler
    is found: setuptools' optional extension), loaded with ctypes at first use; :func:`compiled` is None
    where the library is missing, and the NumPy passes below run instead. Both give the same integers, so
    the same bits (``tests/unit/test_reproducible_unit.py`` compares them on every case it draws)."""

    def __init__(self, lib):
        import ctypes

        p, i64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
        self._pointers = ctypes.c_void_p
        self.codes, self.encode, self.decode, self.sum = (
            lib.coll_codes_f32, lib.coll_encode_f32, lib.coll_decode_f32, lib.coll_sum_f32)
        self.codes.argtypes = [p, i64, i64, p]
        self.encode.argtypes = [p, i64, i64, p, p]
        self.decode.argtypes = [p, p, i64, ctypes.c_int, f64, p]
        self.sum.argtypes = [p, i64, i64, ctypes.c_int, p]
        for fn in (self.codes, self.encode, self.decode):
            fn.restype = None
        self.sum.restype = ctypes.c_int  # 0, or 1: a term count outside 1..FUSED_TERMS (nothing written)

    def table(self, arrays) -> object:
        """A C array of the arrays' data pointers (each contiguous)."""
        return (self._pointers * len(arrays))(*[a.ctypes.data for a in arrays])


_compiled: list = []  # [the _Compiled, or None]: loaded once


def compiled() -> _Compiled | None:
    """The compiled float32 passes, or None where the package was built without them."""
    if not _compiled:
        _compiled.append(_load())
    return _compiled[0]


def _load() -> _Compiled | None:
    from . import _native

    lib = _native.library()
    if lib is None:
        return None
    try:
        return _Compiled(lib)
    except AttributeError:  # an older build without a symbol
        return None


def _fast(fmt: Format) -> _Compiled | None:
    """The compiled passes where they take ``fmt`` (float32 and complex64 parts), else None."""
    return compiled() if fmt.mbits == 23 and fmt.words == 1 else None


class Format(NamedTuple):
    """How the terms of one real floating dtype are coded (:func:`format_of`)."""

    name: str
    bits: np.dtype  # the unsigned integer of the dtype's width (the terms' bits)
    mbits: int  # explicit mantissa bits
    emask: int  # the all-ones exponent field: the code of inf and NaN
    bias: int
    code: np.dtype  # the dtype of the codes (uint8, or int16 for float64)
    words: int  # words per term: 1, or 2 for float64
    real: np.dtype | None  # the storage of one part, for complex dtypes (their parts are summed apart)

    @property
    def shift(self) -> int:
        """``S - E`` of code ``c`` is ``shift - c`` (``E = c - bias + 1``)."""
        return S + self.bias - 1


def _format(name: str, bits: str, mbits: int, ebits: int, code: str, words: int) -> Format:
    emask = (1 << ebits) - 1
    return Format(name, np.dtype(bits), mbits, emask, emask >> 1, np.dtype(code), words, None)


_FLOAT16 = _format("float16", "u2", 10, 5, "u1", 1)
_BFLOAT16 = _format("bfloat16", "u2", 7, 8, "u1", 1)
_FLOAT32 = _format("float32", "u4", 23, 8, "u1", 1)
_FLOAT64 = _format("float64", "u8", 52, 11, "i2", 2)
_FORMATS = {"float16": _FLOAT16, "bfloat16": _BFLOAT16, "float32": _FLOAT32, "float64": _FLOAT64,
            "complex64": _FLOAT32._replace(name="complex64", real=_F32),
            "complex128": _FLOAT64._replace(name="complex128", real=_F64)}


def supported(info: _dtypes.DType) -> bool:
    """Whether ``info`` has a reproducible sum (float16, bfloat16, float32, float64, complex64/128)."""
    return info.name in _FORMATS and info.kind in "fc"


def applies(info: _dtypes.DType, op: str) -> bool:
    """Whether a reduction of ``info`` with ``op`` is made reproducible by ``COLLECTIVES_REPRODUCIBLE=1``
    (a float or complex sum or mean; every other legal pair gives the same bits at any number of ranks
    already: integer sums and products, min, max)."""
    return op in OPS and supported(info)


def check(info: _dtypes.DType, op: str, what: str = "reproducible=True") -> None:
    """Raise ValueError (an op other than sum/mean) or TypeError (a dtype without a reproducible sum)."""
    if op not in OPS:
        raise ValueError(f"{what} applies to op='sum' and op='mean', got op={op!r}: min and max (and integer "
                         f"products) give the same bits at any number of ranks already; drop reproducible=True")
    if not supported(info):
        hint = ("integer sums are exact, the same at any number of ranks already; drop reproducible=True"
                if info.kind in "iub" else "use float16, bfloat16, float32, float64, complex64 or complex128")
        raise TypeError(f"{what} sums float16, bfloat16, float32, float64 and complex64/128 arrays, got "
                        f"{info.name}: {hint}")


def format_of(info: _dtypes.DType) -> Format:
    return _FORMATS[info.name]


def words(info: _dtypes.DType) -> int:
    """Words per element of ``info`` (complex: per part)."""
    return format_of(info).words


def elements(n: int, info: _dtypes.DType) -> int:
    """The number of coded elements of ``n`` elements of ``info`` (complex: two parts each)."""
    return 2 * n if info.kind == "c" else n


def wire_size(n: int, info: _dtypes.DType, tail: bool = True) -> int:
    """float64 words on the wire for ``n`` elements of ``info`` (and the count of terms, with ``tail``)."""
    return elements(n, info) * words(info) + (1 if tail else 0)


def _reals(a: np.ndarray, fmt: Format) -> np.ndarray:
    """``a`` (storage dtype, contiguous) as its real parts: a complex array's parts side by side."""
    return a.view(fmt.real) if fmt.real is not None else a


def _units(units, fmt: Format):
    """The units as a ``(k, n)`` array or a list of ``k`` arrays of ``n`` elements, each as its real parts
    (complex: ``2n``): :func:`codes` and :func:`encode` index them as ``units[u][lo:hi]`` alike."""
    if isinstance(units, np.ndarray):
        return _reals(units, fmt)
    return [_reals(u, fmt) for u in units]


def code_dtype(info: _dtypes.DType) -> np.dtype:
    """The dtype of ``info``'s exponent codes (uint8; int16 for float64 and complex128)."""
    return format_of(info).code


def codes(units, info: _dtypes.DType, out: np.ndarray | None = None) -> np.ndarray:
    """The exponent codes of a stack of units (``(k, n)``, contiguous, ``info``'s storage dtype; ``k`` may
    be 0; or a list of ``k`` contiguous arrays of ``n`` elements): per element the largest code over the
    units (an array of :func:`elements` entries of :func:`code_dtype`: ``out``, else a new one), to be
    allreduced with ``max``."""
    fmt = format_of(info)
    k = len(units)
    units = _units(units, fmt)  # (k, n): complex as (k, 2n) real parts
    n = units[0].shape[0] if k else units.shape[1]
    if out is None:
        out = np.empty(n, dtype=fmt.code)
    if k == 0:
        out[...] = 0  # no unit: the identity of max (-0.0's code)
    elif (fast := _fast(fmt)) is not None:
        fast.codes(fast.table([units[u] for u in range(k)]), k, n, out.ctypes.data)
        return out
    negative_zero = fmt.bits.type(1 << (fmt.bits.itemsize * 8 - 1))  # -0.0's bits
    narrow = fmt.emask == np.iinfo(fmt.code).max  # the code dtype holds exactly the exponent field
    spare = np.empty(min(n, CHUNK), dtype=fmt.code)
    twos = np.full(min(n, CHUNK), 2, dtype=fmt.code)
    zeros = np.empty(min(n, CHUNK), dtype=np.bool_)
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        for u in range(k):
            c = out[lo:hi] if u == 0 else spare[:hi - lo]
            b = units[u][lo:hi].view(fmt.bits)
            np.right_shift(b, fmt.mbits, out=c, casting="unsafe")  # the sign bit lands above the code's bits
            if not narrow:
                c &= fmt.emask
            if c.min() < 2:  # zeros, subnormals and the smallest normals: E of the smallest normals
                np.maximum(c, twos[:hi - lo], out=c)
                # then +0.0: 1, -0.0: 0, by subtracting masks (a gradient may be half zeros: assigning
                # through a mask costs some 40 times more, and max against a scalar 14 times more here)
                z = zeros[:hi - lo]
                np.equal(b, 0, out=z)
                np.subtract(c, z.view(np.uint8), out=c)
                np.equal(b, negative_zero, out=z)
                np.subtract(c, z.view(np.uint8), out=c)
                np.subtract(c, z.view(np.uint8), out=c)
            if u:
                np.maximum(out[lo:hi], c, out=out[lo:hi])
    return out


def _float64(part: np.ndarray, fmt: Format, out: np.ndarray | None = None) -> np.ndarray:
    """Terms of a real format as float64 (exact)."""
    if fmt is _BFLOAT16:
        part = _dtypes.bf16_to_f32(part)
    if out is None:
        return part.astype(_F64)
    np.copyto(out, part)
    return out


def encode(units, info: _dtypes.DType, global_codes: np.ndarray, *, blocks: int = 1,
           out: np.ndarray | None = None, tail: bool = True) -> np.ndarray:
    """The fixed-point words of a stack of units (``(k, n)``, or a list of ``k`` arrays of ``n``
    elements, as :func:`codes` takes them), summed over the units: a float64 array of
    ``blocks`` blocks, block ``b`` holding ``WORDS`` rows of its elements (so that a reduce-scatter gives
    each rank its elements' words), then, with ``tail``, the number of units. ``global_codes``: the
    codes allreduced with ``max`` (:func:`codes`). ``out``: where to write (else a new array).

    Each word is an integer: ``x * 2**(S - E)`` (exact) truncated toward zero; a term loses less than one
    unit of its last word."""
    fmt = format_of(info)
    k = len(units)
    units = _units(units, fmt)  # (k, n): complex as (k, 2n) real parts
    n = units[0].shape[0] if k else units.shape[1]
    nwords = fmt.words
    m = n // blocks
    size = blocks * nwords * m + (1 if tail else 0)
    wire = np.empty(size, dtype=_F64) if out is None else out
    if tail:
        wire[-1] = k
    rows = wire[:blocks * nwords * m].reshape(blocks, nwords, m)
    fast = _fast(fmt)
    if fast is not None:
        for b in range(blocks):
            fast.encode(fast.table([units[u][b * m:(b + 1) * m] for u in range(k)]), k, m,
                        global_codes[b * m:].ctypes.data, rows[b, 0].ctypes.data)
        return wire
    special = bool(global_codes.size) and int(global_codes.max()) == fmt.emask
    chunk = min(m, CHUNK)
    exponent = np.empty(chunk, dtype=_I32)
    narrow = np.empty(chunk, dtype=_F32) if fmt is _FLOAT32 else None  # a float32 term's word, before it is widened
    if k == 1 and nwords == 1 and blocks == 1 and fmt is not _BFLOAT16:  # the common case
        x, shift = units[0], fmt.shift
        with np.errstate(all="ignore"):
            for lo in range(0, m, CHUNK):
                hi = min(m, lo + CHUNK)
                e = exponent[:hi - lo]
                np.subtract(shift, global_codes[lo:hi], out=e, dtype=_I32)
                y = rows[0, 0, lo:hi]
                if narrow is not None:
                    np.copyto(y, _word_f32(x[lo:hi], e, narrow[:hi - lo]))
                else:
                    np.copyto(y, x[lo:hi])
                    np.ldexp(y, e, out=y)
                    np.trunc(y, out=y)
                if special:
                    _specials_in([units[0][lo:hi]], fmt, global_codes[lo:hi], [y])
        return wire
    spare = np.empty((nwords, chunk), dtype=_F64)  # the second and later units' words, before they are added
    low = np.empty(chunk, dtype=_F64) if nwords == 2 else None
    with np.errstate(all="ignore"):
        for b in range(blocks):
            for lo in range(0, m, CHUNK):
                hi = min(m, lo + CHUNK)
                g0, g1 = b * m + lo, b * m + hi  # the elements
                c = global_codes[g0:g1]
                e = exponent[:hi - lo]
                np.subtract(fmt.shift, c, out=e, dtype=_I32)  # S - E
                targets = [rows[b, w, lo:hi] for w in range(nwords)]
                if k == 0:
                    for t in targets:
                        t[...] = 0.0
                for u in range(k):
                    if narrow is not None:  # float32: its word made in float32, added in float64
                        word = _word_f32(units[u][g0:g1], e, narrow[:hi - lo])
                        if u:
                            np.add(targets[0], word, out=targets[0])  # integers below 2**52: exact
                        else:
                            np.copyto(targets[0], word)
                        continue
                    dest = targets if u == 0 else [row[:hi - lo] for row in spare]
                    y = _float64(units[u][g0:g1], fmt, dest[0])
                    np.ldexp(y, e, out=y)  # exact: a power of two (a term far below E may underflow to 0)
                    if nwords == 2:
                        r = low[:hi - lo]  # type: ignore[index]
                        np.copyto(r, y)
                    np.trunc(y, out=y)
                    if nwords == 2:
                        r -= y  # exact: the part below one unit of the first word
                        np.multiply(r, _TWO_S, out=dest[1])
                        np.trunc(dest[1], out=dest[1])
                    if u:
                        for t, d in zip(targets, dest):
                            t += d  # integers below 2**52: exact
                if special:
                    _specials_in([unit[g0:g1] for unit in units], fmt, c, targets)
    return wire


def _word_f32(x: np.ndarray, e: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The words of float32 terms ``x`` (``trunc(x * 2**e)``), computed in float32 into ``out``: exact,
    the same values as in float64 (where no term is inf or NaN, ``|x| < 2**E`` and ``e = S - E``: each
    product is below ``2**S``, a float32 scaled by a power of two, exact where it is normal, and below 1
    where it is not; the words of specials are replaced afterwards), with half the bytes per pass."""
    np.ldexp(x, e, out=out)
    return np.trunc(out, out=out)


def _specials_in(units: list, fmt: Format, c: np.ndarray, targets: list) -> None:
    """Where some term (on any rank) is inf or NaN, the first word counts this rank's NaNs, +infs and
    -infs (in fields of 17 bits: MAX_TERMS fits), the others are 0."""
    special = c == fmt.emask
    if not special.any():
        return
    counts = np.zeros(c.size, dtype=_F64)
    for unit in units:
        v = _dtypes.bf16_to_f32(unit) if fmt is _BFLOAT16 else unit
        counts += np.isnan(v) * _NAN_AT
        counts += (v == np.inf) * _PINF_AT
        counts += v == -np.inf
    np.copyto(targets[0], counts, where=special)
    for t in targets[1:]:
        np.copyto(t, 0.0, where=special)


def decode(summed: np.ndarray, info: _dtypes.DType, global_codes: np.ndarray, op: str, out: np.ndarray, *,
           terms: int | None = None) -> None:
    """Write the sum (or mean, over ``terms`` terms) that the ``summed`` words (one block: ``WORDS`` rows,
    then the number of terms unless ``terms`` is given) and ``global_codes`` (the codes of the same
    elements) encode into ``out`` (contiguous, ``info``'s storage dtype), correctly rounded (sum)."""
    fmt = format_of(info)
    flat = _reals(out.reshape(-1), fmt)
    n = flat.size
    nwords = fmt.words
    if terms is None:
        terms = int(summed[nwords * n])
    if terms == 0:  # no term on any rank: an empty sum is +0.0, an empty mean NaN (as NumPy's)
        flat[...] = 0.0 if op == "sum" else np.nan
        return
    rows = summed[:nwords * n].reshape(nwords, n)
    fast = _fast(fmt)
    if fast is not None:
        fast.decode(np.ascontiguousarray(rows[0]).ctypes.data, global_codes.ctypes.data, n, op == "mean",
                    float(terms), flat.ctypes.data)
        return
    special = bool(n) and int(global_codes.max()) == fmt.emask
    negative_zero = bool(n) and int(global_codes.min()) == 0
    chunk = min(n, CHUNK)
    exponent = np.empty(chunk, dtype=_I32)
    f = np.empty(chunk, dtype=_F64)
    with np.errstate(all="ignore"):
        for lo in range(0, n, CHUNK):
            hi = min(n, lo + CHUNK)
            c = global_codes[lo:hi]
            e = exponent[:hi - lo]
            np.subtract(c, fmt.shift, out=e, dtype=_I32)  # E - S
            v = f[:hi - lo]
            if nwords == 1:
                np.ldexp(rows[0, lo:hi], e, out=v)  # exact (float16/32, bfloat16: within float64's range)
            else:  # the two words as one float64, rounded once (both exact; their sum rounded), then scaled:
                np.multiply(rows[1, lo:hi], _INV_TWO_S, out=v)  # exact
                v += rows[0, lo:hi]
                np.ldexp(v, e, out=v)  # exact, or rounded once where subnormal (then v was exact)
            v += 0.0  # a zero word sum is +0.0, whatever sign a transport gave it (-0.0 + 0.0 is +0.0)
            if negative_zero:
                v[c == 0] = -0.0
            if special:
                _specials_out(rows[0, lo:hi], fmt, c, v)
            if op == "mean":
                _dtypes.divide(v, terms)
            _store(v, flat[lo:hi], fmt)


def sum_terms(terms: list, info: _dtypes.DType, op: str, out: np.ndarray) -> None:
    """Write the reproducible sum (or mean) of ``terms`` (a non-empty list of contiguous arrays of ``n``
    elements, ``info``'s storage dtype, one unit each) into ``out`` (``n`` elements, contiguous): the same
    bits as the collectives' path gives for the same units split any way among the ranks (the codes' max
    and the words' sum are computed here, over every term at once, instead of over the ranks). The kernel of
    the node-shared window (``_backends.shm``), where one rank sees every rank's terms of its slice."""
    fmt = format_of(info)
    fast = _fast(fmt)
    if fast is not None and len(terms) <= FUSED_TERMS:  # every term at once, element by element
        reals = [_reals(t, fmt) for t in terms]
        if fast.sum(fast.table(reals), len(reals), reals[0].shape[0], op == "mean",
                    _reals(out.reshape(-1), fmt).ctypes.data):
            raise ValueError(f"the compiled sum takes 1 to {FUSED_TERMS} terms per element, got {len(reals)}")
        return
    c = codes(terms, info)
    words = encode(terms, info, c, tail=False)
    decode(words, info, c, op, out, terms=len(terms))


def _specials_out(first: np.ndarray, fmt: Format, c: np.ndarray, v: np.ndarray) -> None:
    """Where some term was inf or NaN: NaN if some was NaN, or +inf and -inf were both there; else the inf."""
    special = c == fmt.emask
    if not special.any():
        return
    w = first.astype(np.int64)  # (elsewhere the first word is a sum of words, below 2**52: masked out below)
    nan = (w >> 34) != 0
    pinf = ((w >> 17) & 0x1FFFF) != 0
    ninf = (w & 0x1FFFF) != 0
    result = np.where(pinf, np.inf, -np.inf)
    result[nan | (pinf & ninf)] = np.nan
    np.copyto(v, result, where=special)


def _store(v: np.ndarray, out: np.ndarray, fmt: Format) -> None:
    """Round float64 ``v`` once into ``out`` (the format's storage)."""
    if fmt is _BFLOAT16:
        _dtypes.f32_to_bf16(_round_to_odd_f32(v), out=out)
    else:
        np.copyto(out, v, casting="unsafe")  # float64 -> float32/float16/float64: rounded to nearest even, once


def _round_to_odd_f32(f: np.ndarray) -> np.ndarray:
    """float64 to float32 rounded to odd (toward zero, the last bit set where inexact): rounding that to
    bfloat16 (8 bits) is then the correct rounding of ``f`` itself (no double rounding)."""
    t = f.astype(_F32)
    over = np.abs(t.astype(_F64)) > np.abs(f)
    if over.any():
        t[over] = np.nextafter(t[over], np.float32(0))
    inexact = t.astype(_F64) != f
    inexact &= ~np.isnan(f)
    if inexact.any():
        bits = t.view(np.uint32)
        bits |= inexact.astype(np.uint32)
    return t

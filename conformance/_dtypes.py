"""The dtype table of the documented semantics (docs/semantics.md, "Dtypes and ops"), and exact data.

Written from the documentation, not from the library: a reduction op is legal on a dtype exactly when
the table says "yes"; every other pair must raise ``TypeError``. Data for reductions are small integers
and quarters (products: powers of two, Gaussian units), so that every sum, product, min and max is exact in
every dtype, whatever the order the backend adds in; only ``mean`` (a division) and, for float16 and
bfloat16, ``prod`` are compared with a tolerance.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

OPS = ("sum", "prod", "min", "max", "mean")
# kinds: b bool, i signed, u unsigned, f floating (float16, bfloat16, float32, float64, long double),
# c complex, x other fixed-size dtypes (bit for bit only: structured, strings, datetimes, float8, complex32,
# byte-swapped numbers).
LEGAL = {"sum": "iufc", "prod": "iufc", "min": "biuf", "max": "biuf", "mean": "fc"}


def legal(op: str, kind: str) -> bool:
    return kind in LEGAL[op]


@dataclass(frozen=True)
class Spec:
    """One dtype as the suite sees it.

    ``storage``: the NumPy dtype that holds its bits on the host (``uint16`` for bfloat16); ``value``: the
    NumPy dtype its values are computed in (``float32`` for bfloat16), ``None`` for bit-only dtypes.
    """

    name: str
    kind: str
    storage: np.dtype
    value: np.dtype | None
    half: bool = False  # float16/bfloat16: may be accumulated in float32 and rounded back

    def to_values(self, bits: np.ndarray) -> np.ndarray:
        if self.name == "bfloat16":
            wide = np.array(bits, dtype=np.uint32, ndmin=1) << 16
            return wide.view(np.float32).reshape(np.shape(bits))
        return bits

    def from_values(self, values: np.ndarray) -> np.ndarray:
        if self.name == "bfloat16":
            b = np.array(values, dtype=np.float32, order="C", ndmin=1).view(np.uint32)
            bits = ((b + (((b >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)  # nearest, ties to even
            return bits.reshape(np.shape(values))
        return np.asarray(values).astype(self.storage)


def _spec(name, kind, storage, value="same", half=False) -> Spec:
    storage = np.dtype(storage)
    if value == "same":
        value = storage if kind != "x" else None
    return Spec(name, kind, storage, None if value is None else np.dtype(value), half)


_STANDARD = [
    _spec("bool", "b", np.bool_),
    *[_spec(f"int{b}", "i", f"int{b}") for b in (8, 16, 32, 64)],
    *[_spec(f"uint{b}", "u", f"uint{b}") for b in (8, 16, 32, 64)],
    _spec("float16", "f", np.float16, half=True),
    _spec("bfloat16", "f", np.uint16, np.float32, half=True),
    _spec("float32", "f", np.float32),
    _spec("float64", "f", np.float64),
    _spec("complex64", "c", np.complex64),
    _spec("complex128", "c", np.complex128),
]
STANDARD = {s.name: s for s in _STANDARD}

# NumPy's own extras. long double only where it is not just float64 (it is on Windows and Apple arm64).
NUMPY_EXTRA = {}
if np.finfo(np.longdouble).nmant > np.finfo(np.float64).nmant:
    NUMPY_EXTRA["longdouble"] = _spec("longdouble", "f", np.longdouble)
    NUMPY_EXTRA["clongdouble"] = _spec("clongdouble", "c", np.clongdouble)
_swapped = np.dtype(np.float64).newbyteorder()
NUMPY_EXTRA.update({
    "datetime64": _spec("datetime64", "x", "datetime64[ns]"),
    "str": _spec("str", "x", "<U3"),
    "struct": _spec("struct", "x", np.dtype([("a", "<i4"), ("b", "<f8")])),
    "float64-swapped": _spec("float64-swapped", "x", _swapped),
})

# torch's storage-only floating types (torch dtype name -> spec), all moved bit for bit only.
TORCH_EXTRA = {
    "complex32": _spec("complex32", "x", np.uint32),
    **{n: _spec(n, "x", np.uint8) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                             "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")},
}

ALL = {**STANDARD, **NUMPY_EXTRA, **TORCH_EXTRA}


def seed_of(*parts) -> int:
    """A seed from strings and numbers, the same in every process (Python's hash() is salted)."""
    return zlib.crc32("|".join(map(str, parts)).encode())


def random_bits(spec: Spec, shape: tuple, seed: int) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads, -0.0, subnormals, ...) for bit-for-bit transport."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    if spec.kind == "b":
        return rng.integers(0, 2, n).astype(np.bool_).reshape(shape)
    raw = rng.integers(0, 256, n * spec.storage.itemsize, dtype=np.uint8)
    return raw.view(spec.storage).reshape(shape).copy()


def exact_values(spec: Spec, shape: tuple, op: str, seed: int) -> np.ndarray:
    """Values (in ``spec.value``) whose reduction with ``op`` over up to 4 ranks is exact."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    k = spec.kind
    if k == "b":
        v = rng.integers(0, 2, n).astype(np.bool_)
    elif k == "i":
        v = rng.choice([-2, -1, 1, 2], n) if op == "prod" else rng.integers(-4, 5, n)
    elif k == "u":
        v = rng.choice([1, 2, 3], n) if op == "prod" else rng.integers(0, 8, n)
    elif k == "f":
        v = rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], n) if op == "prod" else rng.integers(-16, 17, n) / 4
    elif k == "c":
        if op == "prod":
            v = rng.choice(np.array([1, -1, 1j, -1j, 1 + 1j, 1 - 1j]), n)
        else:
            v = (rng.integers(-8, 9, n) + 1j * rng.integers(-8, 9, n)) / 4
    else:
        raise ValueError(f"{spec.name} has no values to reduce")
    return np.asarray(v).astype(spec.value).reshape(shape)


def reference(spec: Spec, op: str, stack: np.ndarray) -> np.ndarray:
    """The reduction of ``stack`` (ranks along axis 0, in ``spec.value``) as the docs define it."""
    if spec.kind == "b":
        return stack.all(axis=0) if op == "min" else stack.any(axis=0)
    if op == "sum":
        return stack.sum(axis=0, dtype=spec.value)
    if op == "prod":
        return stack.prod(axis=0, dtype=spec.value)
    if op == "min":
        return stack.min(axis=0)
    if op == "max":
        return stack.max(axis=0)
    if op == "mean":  # "the sum over ranks divided by size"
        return (stack.sum(axis=0, dtype=spec.value) / stack.shape[0]).astype(spec.value)
    raise ValueError(op)


def tolerance(spec: Spec, op: str) -> float:
    """Relative tolerance for comparing a reduction (0: exact)."""
    if spec.half and op in ("mean", "prod"):
        return 1e-2  # accumulated in float32 and rounded back (documented), or native
    if op == "mean":
        return 4 * float(np.finfo(spec.value).eps)  # one division: within an ulp or two however it is done
    return 0.0


def canonical_bytes(spec: Spec, bits: np.ndarray) -> bytes:
    """The bytes that carry meaning; x87 long double's 6 padding bytes are left out of reductions."""
    bits = np.array(bits, order="C", copy=True).reshape(-1)
    if spec.name in ("longdouble", "clongdouble") and spec.storage.itemsize in (16, 32):
        per = 10 if spec.name == "longdouble" else None
        raw = bits.view(np.uint8).reshape(-1, spec.storage.itemsize)
        if per is not None:
            return raw[:, :per].tobytes()
        return np.concatenate([raw[:, :10], raw[:, 16:26]], axis=1).tobytes()
    return bits.tobytes()

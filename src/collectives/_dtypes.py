"""One table: which dtypes exist for us, which reduction ops are legal on them, and how they travel.

Every rule about dtypes and ops lives here, so the host (MPI) and the GPU (NCCL) transports raise the same
errors with the same words. A dtype is described by :class:`DType`: its name, the NumPy *storage* dtype of
its host buffer (``uint16`` for ``bfloat16`` where NumPy has no such type) and its kind.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ._ops import LEGAL, OPS, check, check_op  # noqa: F401 - OPS and check_op: the op rules, re-exported with the dtype rules

@dataclass(frozen=True)
class DType:
    name: str
    storage: np.dtype
    kind: str
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.name, self.storage, self.kind)))

    def __hash__(self) -> int:  # computed once: a DType keys the engine's caches and the call descriptions
        return self._hash

    def __reduce__(self):  # made anew where unpickled (a str's hash differs between processes)
        return (DType, (self.name, self.storage, self.kind))

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize


_BF16 = DType("bfloat16", np.dtype(np.uint16), "f")
_CACHE: dict[np.dtype, DType] = {}


def from_numpy(dtype: np.dtype) -> DType:
    """Describe a NumPy dtype (including ml_dtypes' bfloat16/float8 used by JAX)."""
    hit = _CACHE.get(dtype)
    if hit is not None:
        return hit
    kind = dtype.kind
    if kind == "O":
        raise TypeError(
            "object arrays hold Python object pointers, which cannot be sent between processes; "
            "convert to a numeric dtype first (or use synchronize() for arbitrary picklable objects)"
        )
    if not dtype.isnative:  # byte-swapped: movable bit for bit, not reducible by MPI's native types
        info = DType(f"{dtype.name} ({'big' if dtype.byteorder == '>' else 'little'}-endian)", dtype, "x")
    elif dtype.name == "bfloat16":  # ml_dtypes (JAX)
        info = DType("bfloat16", np.dtype(np.uint16), "f")
    elif kind in "biufc" and dtype.names is None and dtype.subdtype is None:
        info = DType(dtype.name, dtype, kind)
    elif dtype.names is not None or dtype.subdtype is not None:  # structured or sub-array: the full layout
        info = DType(str(dtype), dtype, "x")  # (fields, offsets, byte order) so that ranks compare it all
    else:  # void, strings, datetimes, ml_dtypes float8 ...: fixed-size bytes
        info = DType(dtype.name or str(dtype), dtype, "x")
    _CACHE[dtype] = info
    return info


def bfloat16() -> DType:
    return _BF16


def opaque(name: str, storage: np.dtype) -> DType:
    """A dtype we can only move bit for bit (e.g. torch.complex32, float8)."""
    return DType(name, storage, "x")


def name_of(x) -> str:
    """The name of an array's dtype as its library prints it, without torch's prefix (``float32``)."""
    return str(getattr(x, "dtype", "?")).replace("torch.", "")


def from_name(name: str) -> DType:
    """A dtype's description from its name (:func:`name_of`), for an array whose memory the host cannot
    view (a CUDA array): a name NumPy does not know is moved bit for bit (``opaque``), never reduced."""
    if name == "bfloat16":
        return _BF16
    try:
        return from_numpy(np.dtype(name))
    except TypeError:
        return opaque(name, np.dtype(np.uint8))


def check_reduction(dtype: DType, op: str) -> None:
    """Raise TypeError if ``op`` is not defined on ``dtype`` (same words on every transport: ``_ops``)."""
    if dtype.kind not in LEGAL[op]:
        check(dtype.kind, dtype.name, op)


# ---- bfloat16 <-> float32 on host buffers (round to nearest even, NaN stays NaN) ----

def bf16_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 values (their uint16 bits) widened to float32, exactly: a new array, or written into
    ``out`` (float32, ``bits``' shape), which is returned."""
    if out is None:
        wide = bits.astype(np.uint32)
    else:
        wide = out.view(np.uint32)
        wide[...] = bits
    wide <<= 16  # in place: a 0-d array stays an array (a binary ufunc would return a NumPy scalar)
    return wide.view(np.float32)


def f32_to_bf16(values: np.ndarray, out: np.ndarray) -> None:
    b = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((b + (((b >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((b[nan] >> 16) | 0x0040).astype(np.uint16)
    out[...] = rounded.reshape(out.shape)


# ---- mean's division, whatever the caller's NumPy error state ----
# A caller's np.seterr(all="raise") (or "warn" under python -W error) would turn the underflow of a tiny
# mean into an exception on some ranks only, or print warnings from library code. np.errstate costs about
# a microsecond, as much as a whole small allreduce, so it is entered only when the caller's error state
# is not the one last seen quiet (NumPy keeps it in a context variable: reading it costs ~40 ns).

_errstate_var: ContextVar[Any] | None
try:  # NumPy >= 2 (the object numpy._core._ufunc_config uses; its stub is in umath)
    from numpy._core.umath import _extobj_contextvar as _errstate_var
except ImportError:  # pragma: no cover - NumPy 1.x: always enter errstate
    _errstate_var = None
_quiet_state: list = [None]  # the last error state object found to ignore underflow


def divide(buf: np.ndarray, n, out: np.ndarray | None = None) -> None:
    """``out = buf / n`` (``out`` defaults to ``buf``) in buf's dtype, never raising nor warning: mean's
    division. Complex values are divided part by part (NumPy's complex division by ``n + 0j`` would turn
    the imaginary part of a NaN into a NaN)."""
    if out is None:
        out = buf
    if buf.dtype.kind == "c":
        buf, out = _real_pairs(buf), _real_pairs(out)
    if _errstate_var is not None:
        state = _errstate_var.get()
        if state is _quiet_state[0]:
            np.divide(buf, n, out=out)
            return
        if np.geterr()["under"] == "ignore":
            _quiet_state[0] = state
            np.divide(buf, n, out=out)  # n >= 1: an underflow is the only error a division can raise
            return
    with np.errstate(all="ignore"):
        np.divide(buf, n, out=out)


def _real_pairs(z: np.ndarray) -> np.ndarray:
    """A complex array as a real one of twice the last dimension (a view)."""
    real = np.dtype(f"f{z.dtype.itemsize // 2}") if z.dtype.itemsize <= 16 else np.dtype(np.longdouble)
    return z.view(real) if z.ndim else z.reshape(1).view(real)


# ---- how a reduction travels: the one rule of the host path (_reduction) and the device transports ----
# (here, in layer 0, so that the CUDA transports, which may not import _reduction, follow it too)

_MINMAX = ("min", "max")
_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)
_WIDE_INT = {"i": np.dtype(np.int64), "u": np.dtype(np.uint64)}


def ordered_int(dtype: np.dtype) -> np.dtype | None:
    """The signed integer dtype of the same width that float min/max of ``dtype`` travel as (the
    order-preserving map: negative values get their magnitude bits flipped, so -0.0 < +0.0; NaN becomes
    :func:`ordered_nan`), or None: not a float, or a float without such an integer (longdouble)."""
    if dtype.kind == "f" and dtype.itemsize in (2, 4, 8):
        return np.dtype(f"i{dtype.itemsize}")
    return None


def ordered_nan(ints: np.dtype, op: str) -> int:
    """The integer a NaN maps to under :func:`ordered_int`'s map: the extreme ``op`` picks (the largest
    for max, the smallest for min), so a NaN anywhere is a NaN in the result."""
    info = np.iinfo(ints)
    return int(info.max if op == "max" else info.min)


def wire_op(op: str) -> str:
    """The op a transport runs for ``op``: ``mean`` is a sum, divided once afterwards (:class:`Wire`)."""
    return "sum" if op == "mean" else op


def value_dtype(info: DType, op: str, native) -> np.dtype:
    """The dtype ``info``'s values are reduced in with ``op``, on a transport that reduces ``(dtype, op)``
    correctly itself where ``native(dtype, op)`` (``HostTransport.reduces``, or a device transport's own).

    bool travels as bytes (uint8, else uint64); bfloat16 always in float32; float min/max as the ordered
    integers of their width (:func:`ordered_int`) where the transport reduces those, else in float32
    (exact); float16 in float32 where the transport cannot reduce it; 8- to 32-bit integers in 64-bit
    integers where the transport's own op is not trusted (the same result modulo 2**n)."""
    if info.kind == "b":
        return _U8 if native(_U8, op) else _WIDE_INT["u"]
    if info.name == "bfloat16":
        return _F32
    storage = info.storage
    if info.kind == "f" and op in _MINMAX:  # the ordered integers carry it, whatever the transport does with floats
        ints = ordered_int(storage)
        if ints is None or native(ints, op):
            return storage
        return _F32  # float16 whose 16-bit integers the transport cannot order: exact in float32
    reduced = wire_op(op)
    if native(storage, reduced):
        return storage
    if info.kind == "f":
        return _F32  # float16 on a transport without a float16 type
    if info.kind in _WIDE_INT and native(_WIDE_INT[info.kind], reduced):
        return _WIDE_INT[info.kind]
    raise TypeError(f"op={op!r} on {info.name}: the transport reduces neither {info.name} nor a wider type "
                    f"correctly; use another dtype")


class Wire(NamedTuple):
    """How one reduction travels (:func:`wire`)."""

    dtype: np.dtype  # the value dtype (:func:`value_dtype`): the caller's values are converted to it, exactly
    op: str  # the op the transport runs ("mean" is a "sum")
    ordered: np.dtype | None  # float min/max: the integers the values travel as (None: as they are; longdouble
    #                            min/max, host only, carry byte flags instead: _reduction)
    divide: bool  # mean: the result is divided once by the number of ranks, in ``dtype`` (a true division,
    #               as :func:`divide` does, never a product with 1/n), before it is rounded back once


def wire(info: DType, op: str, native) -> Wire:
    """The whole plan of a reduction of ``info`` with ``op`` on a transport whose own correct reductions
    ``native`` says: widen to ``dtype``, map float min/max to ``ordered``, run ``op``, map back, divide
    (mean), round back into the caller's dtype (floats: to nearest even; integers: modulo 2**n).

    Example:
        >>> native = lambda dtype, op: dtype != np.float16 and dtype.itemsize >= 4   # no 16-bit types
        >>> wire(from_numpy(np.dtype(np.float16)), "mean", native)
        Wire(dtype=dtype('float32'), op='sum', ordered=None, divide=True)
        >>> wire(bfloat16(), "max", native)
        Wire(dtype=dtype('float32'), op='max', ordered=dtype('int32'), divide=False)
    """
    value = value_dtype(info, op, native)
    ordered = ordered_int(value) if op in _MINMAX and value.kind == "f" else None
    return Wire(value, wire_op(op), ordered, op == "mean")

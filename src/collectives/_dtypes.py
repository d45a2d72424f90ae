"""One table: which dtypes exist for us, which reduction ops are legal on them, and how they travel.

Every rule about dtypes and ops lives here, so the host (MPI) and the GPU (NCCL) transports raise the same
errors with the same words. A dtype is described by :class:`DType`: its name, the NumPy *storage* dtype of
its host buffer (``uint16`` for ``bfloat16`` where NumPy has no such type) and its kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._ops import LEGAL, OPS, check, check_op  # noqa: F401 - OPS and check_op: the op rules, re-exported with the dtype rules

@dataclass(frozen=True)
class DType:
    name: str
    storage: np.dtype
    kind: str

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


def check_reduction(dtype: DType, op: str) -> None:
    """Raise TypeError if ``op`` is not defined on ``dtype`` (same words on every transport: ``_ops``)."""
    if dtype.kind not in LEGAL[op]:
        check(dtype.kind, dtype.name, op)


# ---- bfloat16 <-> float32 on host buffers (round to nearest even, NaN stays NaN) ----

def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    wide = bits.astype(np.uint32)
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

try:  # NumPy >= 2
    from numpy._core._ufunc_config import _extobj_contextvar as _errstate_var
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

"""Make the same logical array in several array libraries, and read any of them back as NumPy."""

from __future__ import annotations

import numpy as np

LIBS = ["numpy", "torch", "strict"]

# dtype name -> which libs have it
DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64", "complex128"]


def has(lib: str, dtype: str) -> bool:
    if dtype == "bfloat16":
        return lib == "torch"
    if lib == "torch" and dtype in ("uint16", "uint32", "uint64"):
        return False  # torch has them only partially (no arithmetic on CPU for all ops)
    return not (lib == "strict" and dtype in ("float16",))


def make(lib: str, values: np.ndarray, dtype: str):
    """values: a NumPy array of exactly representable numbers; returns it in ``lib`` with ``dtype``."""
    if lib == "numpy":
        return values.astype(dtype)
    if lib == "torch":
        import torch

        if dtype == "bfloat16":
            return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(np.array(values, dtype=dtype, order="C"))
    if lib == "strict":
        import array_api_strict as xs

        return xs.asarray(values.astype(dtype), dtype=getattr(xs, dtype))
    raise ValueError(lib)


def to_numpy(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        x = x.detach()
        if x.dtype == torch.bfloat16:
            return x.float().numpy()
        return x.numpy()
    return np.from_dlpack(x)


def reference_dtype(dtype: str) -> str:
    return "float32" if dtype == "bfloat16" else dtype


def rank_values(rank: int, shape, dtype: str, op: str | None = None) -> np.ndarray:
    """Deterministic per-rank data, exactly representable in every dtype, so sums are exact."""
    rng = np.random.default_rng(1000 + rank)
    n = int(np.prod(shape)) if shape else 1
    if dtype == "bool":
        v = rng.integers(0, 2, n).astype(bool)
    elif op == "prod":
        v = rng.integers(1, 3, n)
    elif dtype.startswith(("int", "uint")):
        v = rng.integers(0, 20, n)
    elif dtype.startswith("complex"):
        v = rng.integers(-8, 8, n) + 1j * rng.integers(-8, 8, n)
    else:
        v = rng.integers(-16, 16, n) / 4
    return np.asarray(v).reshape(shape)


def reduce_reference(arrays, op: str, dtype: str):
    stack = np.stack([a.astype(reference_dtype(dtype)) for a in arrays])
    if dtype == "bool":
        return stack.any(0) if op == "max" else stack.all(0)
    if op == "sum":
        return stack.sum(0, dtype=stack.dtype)
    if op == "prod":
        return stack.prod(0, dtype=stack.dtype)
    if op == "min":
        return stack.min(0)
    if op == "max":
        return stack.max(0)
    if op == "mean":  # complex: each part divided by the (real) number of ranks, as documented
        total = stack.sum(0, dtype=stack.dtype)
        if total.dtype.kind == "c":
            parts = total.view(total.real.dtype)
            return (parts / parts.dtype.type(len(arrays))).astype(parts.dtype).view(total.dtype)
        return (total / len(arrays)).astype(stack.dtype)
    raise ValueError(op)


def legal(op: str, dtype: str) -> bool:
    if dtype == "bool":
        return op in ("min", "max")
    if dtype.startswith("complex"):
        return op in ("sum", "prod", "mean")
    if dtype.startswith(("int", "uint")):
        return op != "mean"
    return True

"""The one place that knows array libraries.

Everything above this module sees an array through an *adapter*: its device (from ``__dlpack_device__``),
a NumPy view of its host memory in logical (C) order, whether the result may be written into it, and how
to make a new array of the same library and device from a NumPy buffer. Below this module transports see
only contiguous NumPy buffers.

Array libraries are recognised by looking in ``sys.modules`` (as array-api-compat does), never by
importing them: a torch tensor can only exist if torch was imported already.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import _dtypes

# DLPack device types (dlpack.h, DLDeviceType)
CPU, CUDA, CUDA_HOST, OPENCL, VULKAN, METAL, VPI, ROCM, ROCM_HOST = 1, 2, 3, 4, 7, 8, 9, 10, 11
CUDA_MANAGED, ONEAPI = 13, 14
HOST_DEVICE_TYPES = frozenset({CPU, CUDA_HOST, ROCM_HOST})
DEVICE_NAMES = {CPU: "cpu", CUDA: "cuda", CUDA_HOST: "cuda_host", ROCM: "rocm", ROCM_HOST: "rocm_host",
                CUDA_MANAGED: "cuda_managed", METAL: "metal", ONEAPI: "oneapi", VULKAN: "vulkan",
                OPENCL: "opencl", VPI: "vpi"}
HOST = (CPU, 0)


def device_name(device: tuple[int, int]) -> str:
    return f"{DEVICE_NAMES.get(device[0], f'dlpack-device-{device[0]}')}:{device[1]}"


class Adapter:
    """How one kind of array is seen. Subclasses override what differs."""

    name = "array"
    mutable = False  # may results be written into the caller's array?

    def device(self, x) -> tuple[int, int]:
        dev = x.__dlpack_device__()
        return int(dev[0]), int(dev[1])

    def host_view(self, x) -> tuple[np.ndarray, _dtypes.DType]:
        """A NumPy view (no copy where possible) of x's host memory, in x's logical order."""
        try:
            view = np.from_dlpack(x)
        except (TypeError, BufferError, RuntimeError, ValueError):
            view = np.asarray(x)
        info = _dtypes.from_numpy(view.dtype)
        if info.storage != view.dtype:
            view = view.view(info.storage)
        return view, info

    def writable(self, x, view: np.ndarray) -> bool:
        return False

    def write_back(self, x, view: np.ndarray, result: np.ndarray) -> None:
        view[...] = result

    def written(self, x, result):
        """Note that ``x`` was written in place when ``result`` is ``x`` (torch: autograd's version
        counter); return ``result``."""
        return result

    def assign(self, out, result):
        """Copy ``result`` (an array of out's library, shape and device: a device transport's) into
        ``out``; return ``out``."""
        out[...] = result
        return out

    def wrap(self, result: np.ndarray, info: _dtypes.DType, like) -> Any:
        """A new array of like's library, on like's device, holding ``result`` (storage dtype)."""
        from array_api_compat import array_namespace, device as device_of

        xp = array_namespace(like)
        native = result
        like_dtype = getattr(like, "dtype", None)
        if info.name == "bfloat16":
            native = _numpy_bfloat16_view(result)
        try:
            return xp.asarray(native, device=device_of(like))
        except (TypeError, ValueError):
            return xp.asarray(native, dtype=like_dtype)


def _check_torch_dtype(torch, dtype) -> None:
    """TypeError for torch dtypes with no NumPy storage view (quantized, bit and sub-byte types)."""
    if dtype.is_complex or dtype.is_floating_point or dtype == torch.bool:
        return
    if str(dtype) in _TORCH_INTEGER_NAMES:
        return
    name = str(dtype).replace("torch.", "")
    if name.startswith(("qint", "quint")):
        hint = "communicate t.int_repr() (and its scale and zero point) instead"
    elif name.startswith("bits"):
        hint = f"view it as an integer dtype of the same size first, e.g. t.view(torch.uint{dtype.itemsize * 8})"
    else:
        hint = "pack it into a uint8 tensor first"
    raise TypeError(f"torch dtype {name} is not supported (quantized, bit and sub-byte dtypes have no "
                    f"NumPy equivalent to move or reduce); {hint}")


_TORCH_INTEGER_NAMES = frozenset(f"torch.{k}{b}" for k in ("int", "uint") for b in (8, 16, 32, 64))


def _numpy_bfloat16_view(result: np.ndarray) -> np.ndarray:
    import ml_dtypes  # present wherever a library handed us an ml_dtypes bfloat16 array (JAX)

    return result.view(ml_dtypes.bfloat16)


class NumpyAdapter(Adapter):
    name = "numpy"

    def device(self, x):
        return HOST

    def host_view(self, x):
        info = _dtypes.from_numpy(x.dtype)
        return (x if info.storage == x.dtype else x.view(info.storage)), info

    def writable(self, x, view):
        return bool(x.flags.writeable)

    def wrap(self, result, info, like):
        if info.storage != like.dtype:
            return result.view(like.dtype)
        return result


class TorchAdapter(Adapter):
    name = "torch"
    mutable = True

    def device(self, x):
        dev = x.device
        if dev.type == "cpu":
            return HOST
        if dev.type == "meta":
            raise TypeError("a tensor on torch's 'meta' device has no data to send or receive; make it on a "
                            "real device first (e.g. torch.empty_like(t, device='cpu'), or "
                            "module.to_empty(device='cpu') for a model)")
        return super().device(x.detach())

    def host_view(self, x):
        torch = sys.modules["torch"]
        t = x.detach()
        _check_torch_dtype(torch, t.dtype)
        if t.is_conj() or t.is_neg():  # lazily conjugated/negated: numpy cannot see it; work on a copy
            view, info = self.host_view(t.resolve_conj().resolve_neg())
            view.flags.writeable = False  # a copy: results go back through write_back (torch copy_)
            return view, info
        dtype = t.dtype
        if dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16), _dtypes.bfloat16()
        if dtype == torch.complex32:
            return t.view(torch.int32).numpy(), _dtypes.opaque("complex32", np.dtype(np.int32))
        if dtype.is_floating_point and dtype.itemsize == 1:  # float8 variants
            return t.view(torch.uint8).numpy(), _dtypes.opaque(str(dtype).replace("torch.", ""), np.dtype(np.uint8))
        view = t.numpy()
        return view, _dtypes.from_numpy(view.dtype)

    def writable(self, x, view):
        return True

    def written(self, x, result):
        if result is x:
            bump_versions((x,))
        return result

    def assign(self, out, result):
        with sys.modules["torch"].no_grad():  # written in place, as under no_grad (a new version)
            out.copy_(result)
        return out

    def write_back(self, x, view, result):
        if view.flags.writeable:
            view[...] = result
            return
        torch = sys.modules["torch"]
        with torch.no_grad():
            x.copy_(self.wrap(result, None, x))

    def wrap(self, result, info, like):
        torch = sys.modules["torch"]
        dtype = like.dtype
        if result.dtype.itemsize != dtype.itemsize or dtype in (torch.bfloat16, torch.complex32) or (
            dtype.is_floating_point and dtype.itemsize == 1
        ):
            signed = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[dtype.itemsize]
            t = torch.from_numpy(np.ascontiguousarray(result).view(signed)).view(dtype)
        else:
            t = torch.from_numpy(result)
        return t if like.device.type == "cpu" else t.to(like.device)


def _first_bump(tensors: tuple) -> None:
    """``bump_versions`` until its first call, which replaces it by torch's own entry point."""
    global bump_versions
    torch = sys.modules["torch"]
    bump = getattr(getattr(torch, "_C", None), "_increment_version", None)
    if bump is None:  # a torch without the private entry point: the public one (tuples are iterables)
        bump = torch.autograd.graph.increment_version
    bump_versions = bump
    bump(tensors)


# bump_versions(tensors): bump autograd's version counter of torch ``tensors`` (a tuple) written in place
# behind torch's back (through a NumPy view, or by MPI/NCCL into their memory), as a write under
# torch.no_grad() does, so that a backward() needing their old values raises instead of giving a wrong
# gradient. It is torch._C._increment_version, what the public torch.autograd.graph.increment_version
# calls, without its per-call isinstance (200 ns of the 4 us torch hot path); tensors made under
# torch.inference_mode() have no counter and are left alone (by torch).
bump_versions = _first_bump


NUMPY = _NUMPY = NumpyAdapter()
TORCH = _TORCH = TorchAdapter()
GENERIC = _GENERIC = Adapter()
_BY_TYPE: dict[type, Adapter] = {np.ndarray: _NUMPY}


def adapter(x) -> Adapter:
    """The adapter for x, or TypeError when x is not an array."""
    hit = _BY_TYPE.get(type(x))
    if hit is not None:
        return hit
    if isinstance(x, np.ma.MaskedArray):  # (not cached: refused every time)
        raise TypeError("a NumPy masked array: its mask would be ignored (a collective moves and reduces the "
                        "data only); pass np.ma.getdata(x), and the mask as an array of its own if the other "
                        "ranks need it (np.ma.getmaskarray(x))")
    if isinstance(x, np.ndarray):
        found: Adapter = _NUMPY
    elif "torch" in sys.modules and isinstance(x, sys.modules["torch"].Tensor):
        found = _TORCH
    elif hasattr(x, "__dlpack_device__") and hasattr(x, "__dlpack__") and not isinstance(x, np.generic):
        found = _GENERIC
    else:
        raise TypeError(_not_an_array(x))
    _BY_TYPE[type(x)] = found
    return found


TRACER_HINT = ("a JAX tracer: the call is inside a traced function (jax.jit, vmap, grad, scan), where "
               "arrays have no values yet; collectives move concrete arrays between processes, so call it "
               "outside jit (DistributedOptimizer's update too: jit the gradient computation, then call "
               "update outside jit on the gradients it returns)")


def is_tracer(x) -> bool:
    """Whether ``x`` is a JAX tracer (a traced value inside ``jax.jit`` and the like), told apart by its
    classes' names, never by importing JAX."""
    return "jax" in sys.modules and any(c.__name__ == "Tracer" and c.__module__.startswith("jax")
                                        for c in type(x).__mro__)


def _not_an_array(x) -> str:
    kind = type(x).__name__
    if is_tracer(x):
        return f"expected an array, got {kind}, {TRACER_HINT}"
    if isinstance(x, (list, tuple)):
        hint = "convert it first, e.g. np.asarray(x) (or use synchronize()/allreduce_tree() for trees)"
    elif isinstance(x, (int, float, complex, bool, np.generic)):
        hint = "wrap it in a 0-d array first, e.g. np.asarray(x)"
    else:
        hint = "pass a NumPy, torch, CuPy, JAX or array-API array (anything with __dlpack__)"
    return f"expected an array, got {kind}; {hint}"

"""The array libraries the suite can exercise, behind one small interface.

Each library says which dtypes it has, which memory layouts it can make, how to make an array holding given
bits, how to read an array's bits back, and what the documented in-place rule expects of it. Libraries are
imported only when a test needs them; a missing one makes its tests skip (or fail, with
``COLLECTIVES_CONFORMANCE_REQUIRE=1``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np

from . import _dtypes
from ._dtypes import Spec


@dataclass(frozen=True)
class Layout:
    """How an array is laid out: its logical shape, and whether it is a view into a larger base."""

    name: str
    shape: tuple
    contiguous: bool = True


LAYOUTS = {
    "0d": Layout("0d", ()),
    "empty": Layout("empty", (0,)),
    "empty-nd": Layout("empty-nd", (3, 0, 2)),
    "1d": Layout("1d", (8,)),
    "one": Layout("one", (1,)),
    "nd-odd": Layout("nd-odd", (3, 5, 7)),
    "strided": Layout("strided", (4, 3), False),     # base[1:, ::2] of a (5, 6) base
    "reversed": Layout("reversed", (9,), False),     # base[::-1]: a negative stride
    "fortran": Layout("fortran", (4, 3), False),     # column-major
    "readonly": Layout("readonly", (6,)),            # a NumPy array with writeable=False
}
CANONICAL = "nd-odd"  # the layout every dtype and op is checked on, also in the sampled suite


class Made:
    """An input array and what the test needs to check the in-place rule on it."""

    def __init__(self, x, base=None, inside=None):
        self.x = x
        self.base = base          # the array x is a view of (strided, reversed), or None
        self.inside = inside      # index expression of x's elements within base (numpy)


class Lib:
    name = "?"
    module = "?"
    device = "host"
    layouts = ("0d", "empty", "empty-nd", "1d", "one", "nd-odd")

    # ---- availability ----
    def unavailable(self) -> str | None:
        """Why this library cannot be used here, or None."""
        try:
            importlib.import_module(self.module)
        except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install: reported as the reason
            return f"{self.name}: cannot import {self.module} ({type(exc).__name__}: {exc})"
        return None

    def setup(self, comm) -> None:
        """Called once, after the communicator exists (CUDA libraries choose their device here)."""

    def dtypes(self) -> list[Spec]:
        raise NotImplementedError

    # ---- making and reading arrays ----
    def from_bits(self, bits: np.ndarray, spec: Spec):
        """A new, C-contiguous array of this library holding ``bits`` (storage dtype)."""
        raise NotImplementedError

    def to_bits(self, x, spec: Spec) -> np.ndarray:
        """A C-contiguous NumPy copy of x's bits (storage dtype), in logical order."""
        raise NotImplementedError

    def fortran(self, bits: np.ndarray, spec: Spec):
        raise NotImplementedError

    def make(self, spec: Spec, layout: str, bits: np.ndarray, filler: np.ndarray) -> Made:
        """An array holding ``bits`` (of LAYOUTS[layout].shape) in the given layout. ``filler`` fills the
        rest of a view's base: it must stay as it is."""
        if layout == "strided":
            base_bits = filler.reshape(5, 6).copy()
            base_bits[1:, ::2] = bits
            base = self.from_bits(base_bits, spec)
            return Made(base[1:, ::2], base, (slice(1, None), slice(None, None, 2)))
        if layout == "reversed":
            base = self.from_bits(np.ascontiguousarray(bits[::-1]), spec)
            return Made(base[::-1], base, (slice(None, None, -1),))
        if layout == "fortran":
            return Made(self.fortran(bits, spec))
        return Made(self.from_bits(bits, spec))

    # ---- what the documented semantics expect ----
    def writable(self, layout: str) -> bool:
        """Does the result land in x itself (docs: "In place, or a new array")?"""
        return False

    def is_native(self, y, like) -> bool:
        """Is ``y`` an array of this library (and of ``like``'s kind and device)?"""
        return type(y) is type(like)

    def dtype_name(self, y) -> str:
        return str(y.dtype)

    def expect_dtype(self, like) -> str:
        return self.dtype_name(like)

    def shape(self, y) -> tuple:
        return tuple(int(n) for n in y.shape)

    def same_device(self, y, like) -> bool:
        return True

    def layout_state(self, x):
        """Something that changes if x's memory layout changes (strides)."""
        return None


# ------------------------------------------------------------------------------------------------ NumPy

class NumpyLib(Lib):
    name = "numpy"
    module = "numpy"
    layouts = Lib.layouts + ("strided", "reversed", "fortran", "readonly")

    def dtypes(self):
        return [_dtypes.STANDARD[n] for n in _dtypes.STANDARD if n != "bfloat16"] + list(
            _dtypes.NUMPY_EXTRA.values())

    def from_bits(self, bits, spec):
        return np.array(bits, dtype=spec.storage, order="C", copy=True)

    def to_bits(self, x, spec):
        return np.array(x, dtype=spec.storage, order="C", copy=True)

    def fortran(self, bits, spec):
        return np.asfortranarray(bits.copy())

    def make(self, spec, layout, bits, filler):
        if layout == "readonly":
            x = self.from_bits(bits, spec)
            x.flags.writeable = False
            return Made(x)
        return super().make(spec, layout, bits, filler)

    def writable(self, layout):
        return layout != "readonly"

    def layout_state(self, x):
        return (x.strides, x.flags.f_contiguous, x.flags.writeable)


# ------------------------------------------------------------------------------------------------ torch

_TORCH_INT = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


class TorchLib(Lib):
    name = "torch"
    module = "torch"
    device = "host"
    layouts = Lib.layouts + ("strided", "fortran")

    @property
    def torch(self):
        return importlib.import_module("torch")

    def setup(self, comm):
        if comm.size > 1:  # ranks share the machine's cores: one thread each, or they fight over them
            self.torch.set_num_threads(1)

    def _device(self):
        return "cpu"

    @staticmethod
    def _direct(spec):
        """NumPy has this dtype itself: torch.from_numpy / .numpy() share the bits as they are."""
        return spec.name in _dtypes.STANDARD and spec.name != "bfloat16"

    def tdtype(self, spec):
        return getattr(self.torch, spec.name)

    def dtypes(self):
        torch = self.torch
        names = list(_dtypes.STANDARD) + list(_dtypes.TORCH_EXTRA)
        return [_dtypes.ALL[n] for n in names if isinstance(getattr(torch, n, None), torch.dtype)]

    def from_bits(self, bits, spec):
        torch = self.torch
        bits = np.array(bits, dtype=spec.storage, order="C", copy=True)
        if self._direct(spec):
            t = torch.from_numpy(bits)
        else:
            signed = bits.view(_TORCH_INT[spec.storage.itemsize])
            t = torch.from_numpy(signed).view(self.tdtype(spec))
        return t.to(self._device())

    def to_bits(self, x, spec):
        t = x.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        t = t.cpu().contiguous()
        if self._direct(spec):
            return t.numpy().copy()
        signed = t.view(getattr(self.torch, _TORCH_INT[spec.storage.itemsize]))
        return signed.numpy().view(spec.storage).copy()

    def fortran(self, bits, spec):
        return self.from_bits(np.ascontiguousarray(bits.T), spec).T

    def writable(self, layout):
        return True

    def is_native(self, y, like):
        return isinstance(y, self.torch.Tensor) and y.device == like.device

    def dtype_name(self, y):
        return str(y.dtype).replace("torch.", "")

    def same_device(self, y, like):
        return y.device == like.device

    def layout_state(self, x):
        return (tuple(x.stride()), x.storage_offset(), x.data_ptr())


class TorchCudaLib(TorchLib):
    name = "torch-cuda"
    device = "cuda"

    def unavailable(self):
        why = super().unavailable()
        if why:
            return why
        if not self.torch.cuda.is_available():
            return "torch-cuda: torch.cuda.is_available() is False (no CUDA device or a CPU build of torch)"
        return None

    def setup(self, comm):
        super().setup(comm)
        torch = self.torch
        torch.cuda.set_device(getattr(comm, "local_rank", comm.rank) % torch.cuda.device_count())

    def _device(self):
        return f"cuda:{self.torch.cuda.current_device()}"


# ------------------------------------------------------------------------------------------------- JAX

class JaxLib(Lib):
    name = "jax"
    module = "jax"

    def unavailable(self):
        why = super().unavailable()
        if why:
            return why
        jax = importlib.import_module("jax")
        jax.config.update("jax_enable_x64", True)  # else float64 silently becomes float32
        return None

    def dtypes(self):
        jnp = importlib.import_module("jax.numpy")
        return [_dtypes.STANDARD[n] for n in _dtypes.STANDARD if hasattr(jnp, n)]

    def from_bits(self, bits, spec):
        jnp = importlib.import_module("jax.numpy")
        host = np.array(bits, dtype=spec.storage, copy=True)
        if spec.name == "bfloat16":
            host = host.view(jnp.bfloat16)
        return jnp.asarray(host)

    def to_bits(self, x, spec):
        host = np.asarray(x)
        return np.array(host.view(spec.storage) if spec.name == "bfloat16" else host, dtype=spec.storage,
                        order="C", copy=True)

    def is_native(self, y, like):
        jax = importlib.import_module("jax")
        return isinstance(y, jax.Array)

    def same_device(self, y, like):
        return y.devices() == like.devices()


# ------------------------------------------------------------------------------------------------ CuPy

class CupyLib(Lib):
    name = "cupy"
    module = "cupy"
    device = "cuda"
    layouts = Lib.layouts + ("strided", "reversed", "fortran")

    @property
    def cp(self):
        return importlib.import_module("cupy")

    def unavailable(self):
        why = super().unavailable()
        if why:
            return why
        try:
            n = self.cp.cuda.runtime.getDeviceCount()
        except Exception as exc:  # noqa: BLE001 - any CUDA runtime failure means "no device": reported
            return f"cupy: no CUDA device ({type(exc).__name__}: {exc})"
        return None if n > 0 else "cupy: no CUDA device"

    def setup(self, comm):
        cp = self.cp
        cp.cuda.Device(getattr(comm, "local_rank", comm.rank) % cp.cuda.runtime.getDeviceCount()).use()

    def dtypes(self):
        return [_dtypes.STANDARD[n] for n in _dtypes.STANDARD if n != "bfloat16"]

    def from_bits(self, bits, spec):
        return self.cp.asarray(np.array(bits, dtype=spec.storage, copy=True))

    def to_bits(self, x, spec):
        return np.array(self.cp.asnumpy(x), dtype=spec.storage, order="C", copy=True)

    def fortran(self, bits, spec):
        return self.cp.asfortranarray(self.cp.asarray(bits.copy()))

    def writable(self, layout):
        return True

    def same_device(self, y, like):
        return y.device == like.device

    def layout_state(self, x):
        return (x.strides, x.data.ptr)


# ------------------------------------------------------------------------------ any array-API library

class ArrayAPILib(Lib):
    """``xp:<module>``: any library whose namespace follows the array API standard and whose arrays speak
    DLPack, in host memory. The docs' rule for such a library: a new array of the same library, input
    untouched. Its dtypes are the standard's ones its namespace has."""

    device = "host"
    layouts = Lib.layouts + ("strided", "fortran")

    def __init__(self, module: str):
        self.module = module
        self.name = f"xp:{module}"

    @property
    def xp(self):
        return importlib.import_module(self.module)

    def dtypes(self):
        xp = self.xp
        return [_dtypes.STANDARD[n] for n in _dtypes.STANDARD if n != "bfloat16" and hasattr(xp, n)]

    def from_bits(self, bits, spec):
        xp = self.xp
        return xp.asarray(np.array(bits, dtype=spec.storage, copy=True), dtype=getattr(xp, spec.name))

    def to_bits(self, x, spec):
        return np.array(np.from_dlpack(x), dtype=spec.storage, order="C", copy=True)

    def fortran(self, bits, spec):
        return self.xp.permute_dims(self.from_bits(np.ascontiguousarray(bits.T), spec), (1, 0))


class StrictLib(ArrayAPILib):
    """array-api-strict: the array-API library of the default matrix, whose arrays also say their device."""

    def __init__(self):
        super().__init__("array_api_strict")
        self.name = "strict"

    def same_device(self, y, like):
        return y.device == like.device


def host_copy(x) -> np.ndarray:
    """A NumPy view or copy of any library's array, host or CUDA (for comparing results)."""
    module = type(x).__module__
    if module.startswith("torch"):
        return x.detach().cpu().numpy()
    if module.startswith("cupy"):
        return x.get()
    return x if isinstance(x, np.ndarray) else np.from_dlpack(x)


LIBS = {lib.name: lib for lib in (NumpyLib(), TorchLib(), StrictLib(), JaxLib(), CupyLib(), TorchCudaLib())}


def get(name: str) -> Lib:
    if name not in LIBS and name.startswith("xp:"):
        LIBS[name] = ArrayAPILib(name[3:])
    return LIBS[name]

"""The contract of the device (CUDA) transports, and their names.

A device transport moves arrays in device memory: it takes the array itself and its adapter (it needs the
library's stream as well as the pointer), validates dtype and op with the same rules and words as the
host path (``_dtypes``) and writes results into the caller's array. It agrees on nothing itself: in checked
mode every call that reaches it was agreed once, as the user made it, before its transport was chosen (the
engine's ``validate.agree_device``; a tree's or bucket's device leaves by the tree's agreement), and the
transport's own checks then fail alike on every rank.
Three implement it: ``nccl.NCCLTransport`` (our ctypes binding of libnccl), and in ``cuda``
``CudaAwareMPITransport`` (device pointers handed to MPI) and ``HostStagingTransport`` (copies to host
memory, then the host path). Which one a device gets is decided once, by every rank together, in
``factory.device_transport``.
"""

from __future__ import annotations

import abc
import contextlib
import sys

import numpy as np

from .. import _dtypes
from .._errors import BackendUnavailableError

NCCL = "nccl"
CUDA_AWARE_MPI = "cuda-aware-mpi"
HOST_STAGING = "host-staging"
TRANSPORT_NAMES = (NCCL, CUDA_AWARE_MPI, HOST_STAGING)


class DeviceTransport(abc.ABC):
    """What the three CUDA transports share: the contract, validation, the library lookup.

    Capabilities (class attributes, with their defaults here):

    - ``fuses``: :meth:`allreduce_many` reduces many arrays in one fused call (NCCL: one group); the
      default runs :meth:`allreduce` on each.
    """

    name = "device"
    array_level = True
    fuses = False

    def __init__(self, engine, index: int):
        self._engine = engine  # the host collectives of its staged paths (Engine.staged)
        self._host = engine.host
        self.rank, self.size = engine.rank, engine.size
        self.local_rank, self.local_size = engine.local_rank, engine.local_size
        self.device_index = int(index)
        self._library_of = library_of  # tests swap in a stand-in library
        self._streams: dict = {}  # array library name -> this transport's stream for asynchronous calls
        self._last_event = None  # recorded after the last asynchronous call, until known complete
        self._starting = False  # inside start(): the operation runs on the transport's own stream

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} cuda:{self.device_index}>"

    # ---- the operations: x is the caller's array, a its adapter; results go into x where it is written ----
    @abc.abstractmethod
    def broadcast(self, x, a, root: int):
        """Root's ``x`` into every rank's ``x``; returns ``x``."""

    @abc.abstractmethod
    def allreduce(self, x, a, op: str):
        """Reduce ``x`` over the ranks (``op`` includes ``mean``), result in every rank's ``x``."""

    @abc.abstractmethod
    def reduce(self, x, a, op: str, root: int):
        """Reduce ``x`` over the ranks, result in root's ``x``; the others' ``x`` unchanged."""

    @abc.abstractmethod
    def allgather(self, x, a):
        """A new ``(size, *x.shape)`` array on x's device, row r holding rank r's ``x``."""

    def gather(self, x, a, root: int):
        """On ``root``, a new ``(size, *x.shape)`` array on x's device (as :meth:`allgather`); None on the
        other ranks. Default: the allgather, kept on ``root`` (the same bits; ``size`` times the traffic
        to the other ranks: NCCL has no gather of its own)."""
        out = self.allgather(x, a)
        return out if self.rank == root else None

    @abc.abstractmethod
    def reduce_scatter(self, x, a, op: str):
        """A new ``(x.shape[0] // size, *x.shape[1:])`` array on x's device: this rank's block of the
        reduction of ``x`` (``op`` includes ``mean``); ``x`` unchanged. The leading dimension was checked."""

    @abc.abstractmethod
    def alltoall(self, x, a):
        """A new array of x's shape on x's device: block i from rank i's block ``rank``; ``x`` unchanged."""

    # ---- asynchronous collectives (async_op=True) ----
    def start(self, operation: str, x, a, *args):
        """Begin ``operation`` (a method name above, with its arguments) without blocking the host on the
        GPU: ``(result, request)``.

        The operation is enqueued on this transport's own stream (one per array library), after all work
        already enqueued on the caller's current stream (an event the own stream waits for); ``x`` is
        kept from the allocator until that stream is done with it. The request's ``test()`` asks a CUDA
        event recorded after the operation (never blocks); its ``wait()`` makes the caller's current
        stream (at the time of ``wait()``) wait for that event: no host block. NCCL enqueues the
        collective and returns; host staging and CUDA-aware MPI run it to completion here (they must
        wait for the stream to reach the data) and the event is then recorded after their copies. Every
        asynchronous collective of a transport shares its stream: they run in issue order, which NCCL
        needs (the same order on every rank); a later blocking call is ordered after them
        (:meth:`_after_async`).
        """
        xp = self._library_of(x)
        side = self._streams.get(xp.name)
        if side is None:
            side = self._streams[xp.name] = xp.new_stream(x)
        xp.wait_event(side, xp.event_on(xp.current_stream(x)))
        self._starting = True
        try:
            with xp.on_stream(x, side):
                result = getattr(self, operation)(x, a, *args)
        finally:
            self._starting = False
        xp.keep_for(x, side)
        event = self._last_event = xp.event_on(side)
        return result, DeviceRequest(xp, x, event)

    def _after_async(self, xp, x) -> None:
        """Before a blocking call: order it after the asynchronous ones not yet known complete (the
        caller's current stream waits for the last one's event; no host block)."""
        event = self._last_event
        if event is None or self._starting:
            return
        if xp.event_done(event):
            self._last_event = None
            return
        xp.wait_event(xp.current_stream(x), event)

    # ---- point-to-point: the default stages through host memory and the host path ----
    @property
    def max_tag(self) -> int:
        """The largest tag a message may carry: the host transport's (``HostTransport.max_tag``), since a
        message, or its description (NCCL), travels by the host path under the caller's tag."""
        return self._host.max_tag

    def send(self, x, a, dst: int, tag: int) -> None:
        """Send ``x`` to ``dst`` (validated by the Communicator). Default: a host copy, sent by the host
        path (``Engine.staged``: ``send``'s steps, its header, its deadline), complete when this returns."""
        xp, _ = self._prepare(x)
        self._engine.staged("send", xp.to_host(x), dst, tag)

    def recv(self, x, a, src, tag: int, box: list) -> None:
        """Receive into ``x`` from ``src`` (None: any rank); ``box[0]`` becomes the sender. Default: into a
        host copy by the host path (its check of the message against the buffer), then into ``x``."""
        xp, _ = self._prepare(x)
        host = xp.to_host(x)
        box[0] = self._engine.staged("recv", host, src, tag)
        xp.from_host(x, host)

    def allreduce_many(self, arrays, a, op: str):
        """Reduce each array of ``arrays`` in place (fused where :attr:`fuses`)."""
        for x in arrays:
            self.allreduce(x, a, op)
        return arrays

    def close(self) -> None:  # noqa: B027 - optional: a transport that holds nothing keeps this no-op
        """Release what the transport holds (the host transport belongs to the communicator)."""

    # ---- shared by the implementations ----
    def _encode(self, xp, buf, info, plan: _dtypes.Wire, *, keep: bool = False):
        """The host rules' encoding (``_dtypes.wire``), on the device with the array library's own
        operations: ``(wire, fresh)``, ``wire`` the flat contiguous buffer the transport reduces (``buf``'s
        values converted to ``plan.dtype``, float min/max mapped to ordered integers), ``fresh`` whether
        it is new memory (then :meth:`_decode` copies the result back). ``keep``: ``buf`` must stay as it
        was (a send buffer, a rank that only contributes), so it is never mapped in place."""
        flat = xp.flat(buf)
        if plan.dtype == info.storage or (info.kind == "b" and plan.dtype.itemsize == 1):
            value, fresh = flat, False  # as it is (bool: its 0/1 bytes)
        else:
            value, fresh = xp.cast(flat, plan.dtype), True  # widened: exact
        if plan.ordered is None:
            return value, fresh
        if keep and not fresh:
            value, fresh = xp.copy(value), True
        return xp.to_ordered_(value, plan.ordered, _dtypes.ordered_nan(plan.ordered, plan.op)), fresh

    def _decode(self, xp, wire, plan: _dtypes.Wire, target, fresh: bool) -> None:
        """Finish what :meth:`_encode` began, on the reduced ``wire``: ordered integers back to floats,
        mean's one division (in ``plan.dtype``), and, when ``fresh``, the result rounded back into
        ``target`` (a contiguous array of the caller's dtype; floats round to nearest even)."""
        value = wire if plan.ordered is None else xp.from_ordered_(wire, plan.dtype)
        if plan.divide:
            xp.divide_(value, self.size)
        if fresh:
            xp.copy_back(target, value.reshape(xp.shape(target)))

    def _staged(self, x, op: str, root: int | None = None):
        """Reduce ``x`` through host memory and the host path (``Engine.staged``: every host rule holds),
        result copied back into ``x`` (on root only for a reduce). The host-staging transport's reductions,
        and CUDA-aware MPI's integer ops that this MPI was found to get wrong."""
        xp, _ = self._prepare(x)
        if root is None:
            xp.from_host(x, self._engine.staged("allreduce", xp.to_host(x), op))
            return x
        host = self._engine.staged("reduce", xp.to_host(x), op, root)
        if self.rank == root:
            xp.from_host(x, host)
        return x

    def reproducible(self, x, a, collective: str, op: str, *args):
        """A reproducible sum or mean of ``x`` (``reproducible=True``): ``collective`` is ``allreduce``,
        ``reduce`` (``args``: the root), ``reduce_scatter`` or ``allreduce_units``. Every device transport
        runs it through host memory: the host path's reproducible sum (``_reproducible``, by
        ``Engine.staged``) of a host copy, so its bits are those of the same call on host memory, at any
        number of ranks, whatever the transport (NCCL's own sum depends on the ranks and its algorithm).
        Returns what the operation of that name does: ``x`` written (allreduce; reduce, on the root), or a
        new array on x's device."""
        xp, _ = self._prepare(x)
        host = self._engine.staged(collective, xp.to_host(x), op, *args, reproducible=True)
        if collective == "allreduce" or (collective == "reduce" and self.rank == args[0]):
            xp.from_host(x, host)
            return x
        return x if collective == "reduce" else xp.to_device(host, x)

    def reproducible_packed(self, xs: list, a, op: str) -> None:
        """The reproducible sums or means (allreduce) of several arrays of one dtype on this transport's
        device in one call of :meth:`reproducible`: their values packed one after another into a
        contiguous buffer on the device, that buffer summed through host memory (one copy each way, one
        host collective), and each array written back from its part. The reproducible sum is element by
        element, so every array gets the bits its own call would give: a tree's CUDA leaves, in the
        buckets ``_buckets`` makes of them, cost one host collective a bucket instead of one a leaf."""
        xp, _ = self._prepare(xs[0])
        flats = [xp.flat(xp.contiguous(x)[0]) for x in xs]
        counts = [xp.numel(f) for f in flats]
        packed = xp.empty((sum(counts),), like=flats[0])
        offset = 0
        for f, n in zip(flats, counts):
            xp.copy_back(xp.part(packed, offset, n, (n,)), f)
            offset += n
        self.reproducible(packed, a, "allreduce", op)
        offset = 0
        for x, n in zip(xs, counts):
            xp.copy_back(x, xp.part(packed, offset, n, xp.shape(x)))
            offset += n

    def nbytes(self, x) -> int:
        """The bytes of ``x``'s values (its elements times their size)."""
        xp, _ = self._prepare(x)
        return xp.numel(x) * xp.itemsize(x)

    def _staged_scatter(self, x, op: str):
        """:meth:`reduce_scatter` through host memory and the host path (every host rule holds): the
        host-staging transport's, and CUDA-aware MPI's where :meth:`_staged` is taken."""
        xp, _ = self._prepare(x)
        return xp.to_device(self._engine.staged("reduce_scatter", xp.to_host(x), op), x)

    def _staged_alltoall(self, x):
        """:meth:`alltoall` through host memory and the host path."""
        xp, _ = self._prepare(x)
        return xp.to_device(self._engine.staged("alltoall", xp.to_host(x)), x)

    def _prepare(self, x):
        xp = self._library_of(x)
        return xp, xp.dtype(x)

    def _allgather_buffers(self, x):
        """Validate an allgather of ``x``: ``(xp, send, out, nbytes)`` with
        ``send`` x's contiguous data, ``out`` a new ``(size, *x.shape)`` array on x's device and
        ``nbytes`` the bytes of one rank's part."""
        xp, _ = self._prepare(x)
        send, _ = xp.contiguous(x)
        out = xp.empty((self.size,) + xp.shape(x), like=x)
        return xp, send, out, xp.numel(x) * xp.itemsize(x)


class DeviceRequest:
    """The request of an asynchronous device collective (:meth:`DeviceTransport.start`): ``test()``
    queries its CUDA event, ``wait()`` makes the caller's current stream wait for it (no host block)."""

    __slots__ = ("_event", "_x", "_xp")

    def __init__(self, xp, x, event):
        self._xp, self._x, self._event = xp, x, event

    def test(self) -> bool:
        return self._xp.event_done(self._event)

    def wait(self) -> None:
        self._xp.wait_event(self._xp.current_stream(self._x), self._event)


# ---------------------------------------------------------------------------------------------------------
# the array libraries, seen from the device transports

class _TorchCUDA:
    """torch: devices, current streams, and the few tensor operations the device transports need."""

    name = "torch"

    def __init__(self, torch):
        self.torch = torch
        self._dtypes: dict = {}

    # -- devices --
    def unusable(self) -> str | None:
        torch = self.torch
        if torch.cuda.is_available():
            return None
        build = "" if torch.version.cuda else f" (torch {torch.__version__} is a CPU-only build)"
        return f"torch is imported but torch.cuda.is_available() is False{build}"

    def device_count(self) -> int:
        return self.torch.cuda.device_count()

    def pci_bus_id(self, index: int) -> str | None:
        p = self.torch.cuda.get_device_properties(index)
        try:
            return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        except (AttributeError, TypeError, ValueError):
            uuid = getattr(p, "uuid", None)
            return f"uuid:{uuid}" if uuid else None

    def using(self, index: int):
        return self.torch.cuda.device(index)

    # -- arrays --
    def owns(self, x) -> bool:
        return isinstance(x, self.torch.Tensor)

    def dtype(self, x) -> _dtypes.DType:
        hit = self._dtypes.get(x.dtype)
        if hit is None:
            name = str(x.dtype).replace("torch.", "")
            if name == "bfloat16":
                hit = _dtypes.bfloat16()
            else:
                try:
                    hit = _dtypes.from_numpy(np.dtype(name))
                except TypeError:  # float8 variants, complex32, quantized: only moved bit for bit
                    hit = _dtypes.opaque(name, np.dtype(f"u{x.element_size()}"))
            self._dtypes[x.dtype] = hit
        return hit

    def numel(self, x) -> int:
        return x.numel()

    def itemsize(self, x) -> int:
        return x.element_size()

    def shape(self, x) -> tuple:
        return tuple(x.shape)

    def index(self, x) -> int:
        return x.device.index

    def stream(self, x) -> int:
        return self.torch.cuda.current_stream(x.device).cuda_stream

    def synchronize(self, x) -> None:
        self.torch.cuda.current_stream(x.device).synchronize()

    # -- streams and events (the asynchronous collectives, DeviceTransport.start) --
    def current_stream(self, x):
        return self.torch.cuda.current_stream(x.device)

    def new_stream(self, x):
        return self.torch.cuda.Stream(device=x.device)

    def on_stream(self, x, stream):
        return self.torch.cuda.stream(stream)  # current for x's device inside the block

    def event_on(self, stream):
        event = self.torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)  # no host block

    def event_done(self, event) -> bool:
        return event.query()

    def keep_for(self, x, stream) -> None:
        """The caching allocator must not hand x's memory out again before ``stream``'s work on it is done
        (``Tensor.record_stream``)."""
        x.detach().record_stream(stream)

    def contiguous(self, x, copy: bool = True):
        """``(buf, in_place)``: x's own memory when it is plain and contiguous, else a contiguous
        temporary on x's device (holding x's values when ``copy``)."""
        t = x.detach()
        if t.is_contiguous() and not t.is_conj() and not t.is_neg():
            return t, True
        if not copy:
            return self.torch.empty(t.shape, dtype=t.dtype, device=t.device), False
        return t.resolve_conj().resolve_neg().contiguous(), False

    def ptr(self, buf) -> int:
        return buf.data_ptr()

    def copy_back(self, x, buf) -> None:
        x.detach().copy_(buf)  # honours x's strides and lazy conj/neg bits; no autograd record

    def empty(self, shape, like):
        return self.torch.empty(tuple(shape), dtype=like.dtype, device=like.device)

    def part(self, buf, offset: int, count: int, shape):
        """Elements ``offset`` to ``offset + count`` of the flat contiguous ``buf``, as a view of ``shape``."""
        return buf[offset:offset + count].reshape(tuple(shape))

    def to_host(self, x):
        return x.detach().cpu()  # waits for the producer stream

    def from_host(self, x, host) -> None:
        x.detach().copy_(host)

    def to_device(self, host, like):
        return host.to(like.device)

    # -- the host rules' encoding, on the device (DeviceTransport._encode and _decode) --
    def flat(self, buf):
        return buf.reshape(-1)  # contiguous: a view

    def copy(self, buf):
        return buf.clone()

    def cast(self, buf, dtype: np.dtype):
        """A new array of ``buf``'s values in the NumPy ``dtype`` (exact for the widenings of the rules)."""
        return buf.to(getattr(self.torch, dtype.name))

    def to_ordered_(self, buf, ints: np.dtype, nan: int):
        """Map the flat floats ``buf`` in place to the signed integers ``ints`` of the same order (as
        ``_reduction.to_ordered``): negative values get their magnitude bits flipped, NaN becomes ``nan``.
        Returns the integer view."""
        torch = self.torch
        k = buf.view(getattr(torch, ints.name))
        is_nan = torch.isnan(buf)  # before k (the same memory) changes
        k.bitwise_xor_(k.bitwise_right_shift(8 * ints.itemsize - 1).bitwise_and_(np.iinfo(ints).max))
        return k.masked_fill_(is_nan, nan)

    def from_ordered_(self, k, dtype: np.dtype):
        """Invert :meth:`to_ordered_` in place; returns the float view (a NaN comes back as a NaN)."""
        k.bitwise_xor_(k.bitwise_right_shift(8 * k.element_size() - 1).bitwise_and_(self.torch.iinfo(k.dtype).max))
        return k.view(getattr(self.torch, dtype.name))

    def divide_(self, buf, n: int) -> None:
        """mean's division as ``_dtypes.divide`` does it on the host: ``buf / n`` in buf's dtype, complex
        values part by part. The divisor is a tensor on buf's device: torch on CUDA multiplies by the
        reciprocal of a host scalar instead, which can be one unit in the last place off."""
        real = self.torch.view_as_real(buf) if buf.is_complex() else buf
        real.div_(self.torch.full((), n, dtype=real.dtype, device=real.device))


class _CupyCUDA:
    """CuPy: the same operations as :class:`_TorchCUDA`. CuPy arrays are always writable."""

    name = "cupy"

    def __init__(self, cupy):
        self.cupy = cupy

    # -- devices --
    def unusable(self) -> str | None:
        try:
            n = self.cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            return f"CuPy is imported but cannot reach a GPU ({type(exc).__name__}: {exc})"
        return None if n > 0 else "CuPy is imported but sees no GPU"

    def device_count(self) -> int:
        return self.cupy.cuda.runtime.getDeviceCount()

    def pci_bus_id(self, index: int) -> str | None:
        return str(self.cupy.cuda.Device(index).pci_bus_id).lower()

    def using(self, index: int):
        return self.cupy.cuda.Device(index)

    # -- arrays --
    def owns(self, x) -> bool:
        return isinstance(x, self.cupy.ndarray)

    def dtype(self, x) -> _dtypes.DType:
        return _dtypes.from_numpy(x.dtype)

    def numel(self, x) -> int:
        return x.size

    def itemsize(self, x) -> int:
        return x.itemsize

    def shape(self, x) -> tuple:
        return tuple(x.shape)

    def index(self, x) -> int:
        return x.device.id

    def stream(self, x) -> int:
        with x.device:
            return self.cupy.cuda.get_current_stream().ptr

    def synchronize(self, x) -> None:
        with x.device:
            self.cupy.cuda.get_current_stream().synchronize()

    # -- streams and events (the asynchronous collectives, DeviceTransport.start) --
    def current_stream(self, x):
        with x.device:
            return self.cupy.cuda.get_current_stream()

    def new_stream(self, x):
        with x.device:
            return self.cupy.cuda.Stream(non_blocking=True)

    @contextlib.contextmanager
    def on_stream(self, x, stream):
        with x.device, stream:  # current for x's device inside the block
            yield

    def event_on(self, stream):
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(stream)
        return event

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)  # no host block

    def event_done(self, event) -> bool:
        return bool(event.done)

    def keep_for(self, x, stream) -> None:
        """Nothing to do: CuPy's memory pool has no ``record_stream``; x is kept alive by the handle, and
        each later asynchronous call's stream first waits for the caller's (see DeviceTransport.start)."""

    def contiguous(self, x, copy: bool = True):
        if x.flags.c_contiguous:
            return x, True
        with x.device:
            return (self.cupy.ascontiguousarray(x) if copy else self.cupy.empty(x.shape, x.dtype)), False

    def ptr(self, buf) -> int:
        return buf.data.ptr

    def copy_back(self, x, buf) -> None:
        with x.device:
            self.cupy.copyto(x, buf, casting="unsafe")

    def empty(self, shape, like):
        with like.device:
            return self.cupy.empty(tuple(shape), dtype=like.dtype)

    def part(self, buf, offset: int, count: int, shape):
        return buf[offset:offset + count].reshape(tuple(shape))  # a view (see _TorchCUDA.part)

    def to_host(self, x):
        with x.device:
            return self.cupy.asnumpy(x)  # blocking: waits for the current stream

    def from_host(self, x, host) -> None:
        with x.device:
            if x.flags.c_contiguous:
                x.set(np.ascontiguousarray(host))
            else:
                x[...] = self.cupy.asarray(host)

    def to_device(self, host, like):
        with like.device:
            return self.cupy.asarray(host)

    # -- the host rules' encoding, on the device (see _TorchCUDA) --
    def flat(self, buf):
        return buf.reshape(-1)  # contiguous: a view

    def copy(self, buf):
        with buf.device:
            return buf.copy()

    def cast(self, buf, dtype: np.dtype):
        with buf.device:
            return buf.astype(dtype)

    def to_ordered_(self, buf, ints: np.dtype, nan: int):
        cupy = self.cupy
        with buf.device:
            k = buf.view(ints)
            is_nan = cupy.isnan(buf)  # before k (the same memory) changes
            k ^= (k >> ints.type(8 * ints.itemsize - 1)) & ints.type(np.iinfo(ints).max)
            cupy.copyto(k, ints.type(nan), where=is_nan)
            return k

    def from_ordered_(self, k, dtype: np.dtype):
        ints = k.dtype
        with k.device:
            k ^= (k >> ints.type(8 * ints.itemsize - 1)) & ints.type(np.iinfo(ints).max)
            return k.view(dtype)

    def divide_(self, buf, n: int) -> None:
        """mean's division as ``_dtypes.divide`` does it on the host: ``buf / n`` in buf's dtype, complex
        values part by part."""
        with buf.device:
            real = buf.view(buf.real.dtype) if buf.dtype.kind == "c" else buf
            self.cupy.true_divide(real, real.dtype.type(n), out=real)


_APIS: dict = {}


def _api(module_name: str):
    """The cached helper for an imported library (torch or cupy), else None."""
    module = sys.modules.get(module_name)
    if module is None:
        return None
    hit = _APIS.get(module_name)
    if hit is None or (hit.torch if module_name == "torch" else hit.cupy) is not module:
        hit = _APIS[module_name] = (_TorchCUDA if module_name == "torch" else _CupyCUDA)(module)
    return hit


def library_of(x):
    """The helper for x's library: torch tensors and CuPy arrays; any other CUDA array is refused."""
    for name in ("torch", "cupy"):
        api = _api(name)
        if api is not None and api.owns(x):
            return api
    kind = f"{type(x).__module__}.{type(x).__qualname__}"
    raise BackendUnavailableError(
        f"CUDA array of type {kind}: collectives moves CUDA memory of torch tensors and CuPy arrays only; "
        f"convert it to one of those (e.g. torch.from_dlpack(x)) or copy it to host memory first")


def device_api():
    """A helper that can talk to the GPU (torch preferred, then CuPy), or BackendUnavailableError."""
    reasons = []
    for name in ("torch", "cupy"):
        api = _api(name)
        if api is None:
            reasons.append(f"{'torch' if name == 'torch' else 'CuPy'} is not imported")
            continue
        why = api.unusable()
        if why is None:
            return api
        reasons.append(why)
    raise BackendUnavailableError(
        "no usable CUDA array library in this process: " + "; ".join(reasons)
        + ". collectives handles CUDA arrays of torch (CUDA build) and CuPy; on a machine without a GPU, "
        "copy the array to host memory first")

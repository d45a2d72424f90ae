"""Communicators and the array collectives.

A :class:`Communicator` is a group of processes that call collectives together. :func:`init` makes one
(over MPI when it works, else the single-process ``"self"`` backend); :func:`world` returns the default
one. Every collective is both a method (``comm.allreduce(x)``) and a function (``allreduce(x, comm=comm)``).

How a call runs:

1. validate everything (kind of array, op, dtype/op pair, root) before any communication;
2. choose the transport from the array's device (:meth:`Communicator._transport_for`, the only place);
3. take a NumPy view of the array's memory (``_arrays``), make it contiguous if it is not;
4. move or reduce the bytes, widening dtypes the transport cannot reduce (float16, bfloat16);
5. write the result back into the caller's array when it is writable, else return a new array.
"""

from __future__ import annotations

import atexit
import sys
import threading

import numpy as np

from . import _arrays, _buckets, _check, _config, _dtypes
from ._backends.base import Transport
from ._backends.self import SelfTransport
from ._errors import BackendUnavailableError, reraise, translating

BACKENDS = ("auto", "mpi", "self")
_ndarray = np.ndarray  # one global look-up on the hot path instead of two
_torch_tensor = None  # torch.Tensor, once a torch tensor's call has been cached (torch is never imported here)
_NONE: dict = {}  # read-only by convention: what the hot path looks in for an op with no cached calls
_UNSET = object()  # "argument not part of this collective" (None is a value users may pass by mistake)


class Communicator:
    """A group of processes that call collectives together.

    Made by :func:`init` (or :func:`world`); not constructed directly. Every rank of the group must call
    every collective on it, in the same order.

    Attributes:
        rank: this process's index in the group, ``0 <= rank < size``.
        size: the number of processes.
        local_rank: this process's index among the group's processes on the same node (shared memory).
        local_size: the number of the group's processes on this node.
        backend: ``"mpi"`` or ``"self"``.
        check: whether a cross-rank agreement check runs before every collective.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.init()
        >>> x = np.full(3, float(comm.rank + 1))
        >>> y = comm.allreduce(x, op="mean")     # in place: y is x
        >>> bool(y is x and (x == (comm.size + 1) / 2).all())
        True
    """

    def __init__(self, host: Transport, *, check: bool = False):
        self._host = host
        self._devices: dict = {}  # (dlpack device type, id) -> device transport
        self._fast: dict = {}  # op -> {NumPy dtype: direct transport call} (hot path); see _fast_path
        self._fast_broadcast: dict = {}  # the same for broadcast (one look-up less)
        self._size = host.size  # a plain attribute for the hot path
        self.check = bool(check)

    @property
    def check(self) -> bool:
        """Whether a cross-rank agreement check runs before every collective (settable)."""
        return self._check

    @check.setter
    def check(self, value) -> None:
        self._check = bool(value)
        self._fast, self._fast_broadcast = {}, {}  # the hot path skips the check: empty it (unchecked
        # calls refill it, see _fast_path)

    # ---- identity ----
    @property
    def rank(self) -> int:
        return self._host.rank

    @property
    def size(self) -> int:
        return self._host.size

    @property
    def local_rank(self) -> int:
        return self._host.local_rank

    @property
    def local_size(self) -> int:
        return self._host.local_size

    @property
    def backend(self) -> str:
        return self._host.name

    @property
    def closed(self) -> bool:
        return self._host is None

    def __repr__(self) -> str:
        if self._host is None:
            return "<collectives.Communicator closed>"
        return (f"<collectives.Communicator backend={self.backend!r} rank={self.rank} size={self.size} "
                f"local_rank={self.local_rank} local_size={self.local_size}>")

    # ---- dispatch: the one place a transport is chosen ----
    def _transport_for(self, device: tuple[int, int]):
        """The transport for an array on ``device`` (a DLPack ``(type, id)`` pair).

        Host memory goes to the host transport (MPI or self), which moves NumPy buffers. CUDA memory goes
        to a device transport (NCCL, else CUDA-aware MPI, else staged through host memory), made on first
        use per device; device transports take arrays (``array_level``), since they need the library's
        stream as well as the pointer.
        """
        if self._host is None:
            raise BackendUnavailableError("this communicator was finalized; call collectives.init() again")
        if device[0] in _arrays.HOST_DEVICE_TYPES:
            return self._host
        if device[0] in (_arrays.CUDA, _arrays.CUDA_MANAGED):
            hit = self._devices.get(device)
            if hit is None:
                from ._backends import cuda

                hit = self._devices[device] = cuda.make_transport(self, device)
            return hit
        raise BackendUnavailableError(
            f"array on {_arrays.device_name(device)}: no transport for this device; copy it to host memory"
        )

    def _check_root(self, root) -> int:
        if isinstance(root, (bool, np.bool_)) or not isinstance(root, (int, np.integer)):
            raise TypeError(f"root must be an integer rank, got {type(root).__name__} {root!r}")
        root = int(root)
        if not 0 <= root < self.size:
            raise ValueError(f"root={root} is out of range for a communicator of size {self.size} "
                             f"(valid: 0..{self.size - 1})")
        return root

    # ---- the array collectives ----
    def broadcast(self, x, root: int = 0):
        """Root's ``x`` on every rank. See :func:`collectives.broadcast`."""
        try:
            if x.__class__ is _ndarray and root.__class__ is int:  # hot path: see _fast_path
                run = self._fast_broadcast.get(x.dtype)
                if run is not None and x.flags.carray and 0 <= root < self._size:  # C order, writable
                    run(x, root)
                    return x
            elif x.__class__ is _torch_tensor and root.__class__ is int:  # the same for torch: _fast_path
                run = self._fast_broadcast.get(x.dtype)
                if run is not None and x.is_cpu and x.is_contiguous() and 0 <= root < self._size:
                    run(x.detach().numpy() if x.requires_grad else x.numpy(), root)
                    return x
            a, transport, view, info, _, root = self._prepare("broadcast", x, root=root)
            if transport.array_level:
                return transport.broadcast(x, a, root)
            self._fast_path("broadcast", x, a, view, info, transport)
            return self._in_place(x, a, view, info, lambda buf: transport.broadcast(buf, root))
        except Exception as exc:  # noqa: BLE001 - re-raised; costs nothing unless raised: MPI's own errors become CollectiveError
            reraise(exc, "broadcast")

    def allreduce(self, x, op: str = "sum"):
        """Reduce ``x`` over all ranks, result on every rank. See :func:`collectives.allreduce`."""
        try:
            if x.__class__ is _ndarray and op.__class__ is str:  # hot path, see _fast_path
                run = self._fast.get(op, _NONE).get(x.dtype)
                if run is not None and x.flags.carray:  # C-contiguous, aligned and writable
                    run(x)
                    return x
            elif x.__class__ is _torch_tensor and op.__class__ is str:  # the same for torch: _fast_path
                run = self._fast.get(op, _NONE).get(x.dtype)
                if run is not None and x.is_cpu and x.is_contiguous():
                    run(x.detach().numpy() if x.requires_grad else x.numpy())
                    return x
            a, transport, view, info, op, _ = self._prepare("allreduce", x, op=op)
            if transport.array_level:
                return transport.allreduce(x, a, op)
            self._fast_path(op, x, a, view, info, transport)
            return self._in_place(x, a, view, info, lambda buf: self._reduce_buffer(
                transport, buf, info, op, transport.allreduce))
        except Exception as exc:  # noqa: BLE001 - re-raised (MPI errors as CollectiveError)
            reraise(exc, "allreduce")

    @translating("reduce")
    def reduce(self, x, op: str = "sum", root: int = 0):
        """Reduce ``x`` over all ranks, result on ``root``. See :func:`collectives.reduce`."""
        a, transport, view, info, op, root = self._prepare("reduce", x, op=op, root=root)
        if transport.array_level:
            return transport.reduce(x, a, op, root)
        if self.rank != root:  # non-root ranks contribute x and get it back unchanged
            buf = view if view.flags.c_contiguous else np.array(view, order="C")
            self._reduce_buffer(transport, buf, info, op,
                                lambda b, o: transport.reduce(b, o, root), divide=False)
            return x
        return self._in_place(x, a, view, info, lambda buf: self._reduce_buffer(
            transport, buf, info, op, lambda b, o: transport.reduce(b, o, root)))

    @translating("allgather")
    def allgather(self, x):
        """Every rank's ``x``, stacked along a new leading axis. See :func:`collectives.allgather`."""
        a, transport, view, info, _, _ = self._prepare("allgather", x)
        if transport.array_level:
            return transport.allgather(x, a)
        send = view if view.flags.c_contiguous else np.array(view, order="C")
        out = np.empty((self.size,) + view.shape, dtype=view.dtype)
        transport.allgather(send, out.reshape(self.size, -1))
        return a.wrap(out, info, x)

    def _prepare(self, collective: str, x, op=_UNSET, root=_UNSET):
        """Validate a call, choose its transport and, in checked mode, agree on it with the other ranks.

        Every check runs before any communication. In checked mode a rank whose own arguments are invalid
        first tells the others (they wait in the agreement step and raise MismatchError), then raises its
        TypeError/ValueError. Returns ``(adapter, transport, view, info, op, root)``; ``view`` and
        ``info`` (the NumPy view of x's memory and its dtype entry) are None for device transports.
        """
        args = {}
        view = info = None
        try:
            a = _arrays.adapter(x)
            device = a.device(x)
            if op is not _UNSET:
                op = args["op"] = _dtypes.check_op(op)
            if root is not _UNSET:
                root = args["root"] = self._check_root(root)
            transport = self._local_transport(device)
            if transport is not None and not transport.array_level:
                view, info = a.host_view(x)
                if op is not _UNSET:
                    _dtypes.check_reduction(info, op)
        except Exception as exc:
            if self.check:  # the others wait in the agreement step: tell them, then raise (see _check)
                _check.refuse(self._host, collective, exc)
            raise
        if transport is None:  # checked mode, an array outside host memory
            self._agree_device(collective, x, device, **args)
            transport = self._transport_for(device)
        elif self.check and not transport.array_level:
            self._agree(transport, collective, view, info, **args)
        return a, transport, view, info, op, root

    @translating("barrier")
    def barrier(self) -> None:
        """Block until every rank has called it. See :func:`collectives.barrier`."""
        transport = self._transport_for(_arrays.HOST)
        if self.check:
            _check.agree(transport, {"collective": "barrier"})
        transport.barrier()

    def _fast_path(self, op: str, x, a, view, info, transport) -> None:
        """Cache the transport's direct call for (op, dtype) of contiguous writable NumPy arrays, and of
        contiguous CPU torch tensors of a real dtype (called with the tensor's NumPy view).

        Filled by the general path once a call with that pair has been fully validated, so the cache holds
        only legal, natively supported pairs; a later call with the same pair skips the adapter, the dtype
        table and the op checks (two dictionary look-ups and a flag read instead; for torch, three cheap
        tensor attributes and ``.numpy()``). Keyed by the array's own dtype object: NumPy and torch dtypes
        never compare equal. Only exact ``np.ndarray`` and ``torch.Tensor`` (not subclasses such as
        ``nn.Parameter``, which keep the general path), and only dtypes whose storage view is the array's
        own dtype (not bfloat16 or the float8s, which are widened or reinterpreted; not complex torch
        tensors, whose lazily conjugated views NumPy cannot see). Never filled in checked mode (setting
        ``check`` empties it). Bounded: a handful of ops times the dtypes in use. The module-level
        :func:`allreduce` and :func:`broadcast` read it too, to save a call per collective.
        """
        global _torch_tensor
        if self._check or view is None:
            return
        if a is _arrays.NUMPY and x.__class__ is _ndarray:
            wire = x.dtype  # the hot path hands the transport x itself
        elif a is _arrays.TORCH and info.name == view.dtype.name and view.dtype.kind in "biuf":
            torch = sys.modules["torch"]
            if x.__class__ is not torch.Tensor:
                return
            _torch_tensor = torch.Tensor
            wire = view.dtype  # the hot path hands the transport x.numpy()
        else:
            return
        table = self._fast_broadcast if op == "broadcast" else self._fast.setdefault(op, {})
        if x.dtype not in table:
            fast = getattr(transport, "fast_call", None)
            run = fast(op, wire, self.size) if fast is not None else None
            if run is not None:
                table[x.dtype] = run

    def _local_transport(self, device):
        """``_transport_for(device)``, except in checked mode for an array outside host memory: None.

        Choosing a device transport is itself collective the first time (``_backends.cuda``), so in
        checked mode it must wait until the ranks have agreed on the call (:meth:`_agree_device`);
        otherwise a rank with a CUDA array among ranks with host arrays would start it alone.
        """
        if self.check and device[0] not in _arrays.HOST_DEVICE_TYPES:
            return None
        return self._transport_for(device)

    def _agree_device(self, collective, x, device, **args):
        """Checked mode, an array outside host memory: agree on the call from the array's own shape and
        dtype, before its transport is chosen."""
        dtype = str(getattr(x, "dtype", None)).replace("torch.", "")
        kind = _arrays.DEVICE_NAMES.get(device[0], f"dlpack-device-{device[0]}")
        call = {"collective": collective, **args, "shape": tuple(getattr(x, "shape", ())), "dtype": dtype,
                "device": kind}
        _check.agree(self._transport_for(_arrays.HOST), call)

    @staticmethod
    def _agree(transport, collective, view, info, **args):
        call = {"collective": collective, **args, "shape": tuple(view.shape), "dtype": info.name,
                "device": "host"}
        _check.agree(transport, call)

    # ---- helpers ----
    @staticmethod
    def _in_place(x, a, view, info, run):
        """Run ``run(buf)`` on a contiguous buffer holding x's elements; put the result where it belongs."""
        can_write = a.writable(x, view)
        if can_write and view.flags.writeable and view.flags.c_contiguous:
            run(view)
            return x
        buf = np.array(view, order="C")  # a copy: the caller's array is untouched until the end
        run(buf)
        if can_write:
            a.write_back(x, view, buf)
            return x
        return a.wrap(buf, info, x)

    def _reduce_buffer(self, transport, buf, info, op, collective, divide=True):
        """Reduce a contiguous buffer in place with ``collective(wire, op)``, widening where needed.

        ``divide=False`` is for ranks that only contribute (non-root ranks of reduce): their buffer is
        never written, so the caller's array stays bit for bit as it was (also a read-only one).
        """
        wire_op = "sum" if op == "mean" else op
        if info.kind == "b":
            collective(buf.view(np.uint8), wire_op)
            return
        if info.name == "bfloat16":
            wire = _dtypes.bf16_to_f32(buf)
        elif not transport.reduces(buf.dtype, wire_op):  # float16 -> float32; a faulty integer pair -> 64 bits
            wire = buf.astype(_buckets.wire_dtype(transport, info, op))
        else:
            wire = buf
        if op in ("min", "max") and _dtypes.orderable(wire.dtype):  # NaN-propagating, same on all ranks
            ints = _dtypes.float_to_ordered(wire, op)
            collective(ints, op)
            if not divide:
                return
            reduced = _dtypes.ordered_to_float(ints, wire.dtype)
            if wire is buf:
                buf[...] = reduced
                return
            wire = reduced
        else:
            collective(wire, wire_op)
            if wire is buf or not divide:
                if op == "mean" and divide:
                    np.divide(wire, self.size, out=wire)
                return
            if op == "mean":
                np.divide(wire, self.size, out=wire)
        if info.name == "bfloat16":
            _dtypes.f32_to_bf16(wire, out=buf)
        else:
            buf[...] = wire  # float32 -> float16, round to nearest

    def close(self) -> None:
        """Release this communicator's resources (its MPI duplicate, its shared-memory window, device
        communicators). Collective: every rank calls it (``finalize()`` and interpreter exit do). Idempotent."""
        host, self._host = self._host, None
        self._fast, self._fast_broadcast = {}, {}
        devices, self._devices = list(self._devices.values()), {}
        for d in devices:  # device transports first: NCCL communicators were set up over the host one
            d.close()
        if host is not None:
            host.close()

    # ---- the tree collectives ----
    def synchronize(self, tree, root: int = 0):
        """Root's values for every leaf of ``tree``. See :func:`collectives.synchronize`."""
        from ._tree import synchronize

        return synchronize(tree, root, comm=self)

    def allreduce_tree(self, tree, op: str = "mean"):
        """Reduce every array leaf of ``tree``, fused. See :func:`collectives.allreduce_tree`."""
        from ._tree import allreduce_tree

        return allreduce_tree(tree, op, comm=self)


# ---------------------------------------------------------------------------------------------------------
# init / world / finalize

_lock = threading.RLock()
_world: Communicator | None = None
_by_comm: dict[int, tuple[object, Communicator]] = {}
_atexit_registered = False


def _make_transport(backend: str, comm) -> Transport:
    if backend == "self":
        if comm is not None:
            raise ValueError("backend='self' is a single process and takes no comm=; use backend='mpi'")
        return SelfTransport()
    if backend == "mpi":
        from ._backends.mpi import MPITransport

        return MPITransport(comm)
    # auto
    try:
        from ._backends.mpi import MPITransport

        transport = MPITransport(comm)
    except BackendUnavailableError as exc:
        if comm is not None:
            raise
        launched = _config.launcher_size()
        if launched is not None:
            name, n = launched
            raise BackendUnavailableError(
                f"this process was started by a launcher for {n} processes ({name}={n}), but MPI cannot be "
                f"used ({exc}); refusing to run {n} independent single-process copies. Install mpi4py "
                f"for the launcher's MPI (pip install 'collectives[mpi]', or build mpi4py against your "
                f"cluster's MPI), or set COLLECTIVES_BACKEND=self to really run alone"
            ) from exc
        return SelfTransport()
    launched = _config.launcher_size()
    if comm is None and transport.size == 1 and launched is not None:
        name, n = launched
        transport.close()
        raise BackendUnavailableError(
            f"this process was started by a launcher for {n} processes ({name}={n}), but MPI's world has "
            f"1 process: mpi4py's MPI library is not the launcher's. Launch with the mpiexec that belongs to "
            f"mpi4py's MPI (python -m collectives info shows it), or rebuild mpi4py against the launcher's"
        )
    return transport


def init(backend: str = "auto", *, comm=None, check: bool | None = None) -> Communicator:
    """Start the library and return a :class:`Communicator`. Idempotent.

    Args:
        backend: ``"auto"`` (MPI when mpi4py works, else ``"self"``; ``COLLECTIVES_BACKEND`` overrides),
            ``"mpi"`` (fail with :class:`BackendUnavailableError` if MPI is unusable) or ``"self"`` (one
            process, no communication).
        comm: an existing mpi4py intra-communicator to work within (for frameworks with their own job).
            The library duplicates it and never talks on the original.
        check: turn the cross-rank agreement check on or off (default: ``COLLECTIVES_CHECK``).

    In an MPI job of more than one process, the first ``init`` also makes an uncaught exception on any
    rank end the whole job (``MPI_Abort``) instead of leaving the other ranks waiting in a collective
    (``COLLECTIVES_ABORT_ON_ERROR=0`` turns it off). With ``COLLECTIVES_TIMEOUT`` set when a communicator
    is made, its host collectives raise :class:`CollectiveTimeoutError` after that many seconds. With
    ``COLLECTIVES_NCCL_EAGER=1`` (on every rank, torch or CuPy imported), it also sets up this rank's CUDA
    device transport (``MismatchError`` if only some ranks set it; a refused init leaves nothing behind).

    Returns:
        The default communicator (``comm=None``), or the communicator for ``comm``. The first call also
        sets the default returned by :func:`world`. Calling again with the same arguments returns the
        same object.

    Raises:
        BackendUnavailableError: MPI was required (explicitly, or by a multi-process launcher) but cannot
            be used; or ``COLLECTIVES_NCCL_EAGER=1`` and the CUDA transport cannot be set up.
        MismatchError: ``COLLECTIVES_NCCL_EAGER`` differs across ranks.
        ValueError: an unknown backend, or a backend other than the one already initialised.

    Example:
        >>> import collectives as coll
        >>> comm = coll.init()
        >>> comm is coll.init() is coll.world()
        True
        >>> comm.backend in ("mpi", "self")
        True
    """
    global _world, _atexit_registered
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError(f"unknown backend={backend!r}; expected one of {', '.join(map(repr, BACKENDS))}")
    backend = backend.lower()
    if backend == "auto":
        backend = _config.backend()
        if backend not in BACKENDS:
            raise ValueError(f"COLLECTIVES_BACKEND={backend!r}: expected one of {', '.join(BACKENDS)}")
    with _lock:
        if comm is None and _world is not None:
            existing = _world
        elif comm is not None and id(comm) in _by_comm:
            existing = _by_comm[id(comm)][1]
        else:
            existing = None
        if existing is not None:
            if backend != "auto" and backend != existing.backend:
                raise ValueError(f"already initialised with backend {existing.backend!r}; "
                                 f"call collectives.finalize() before init(backend={backend!r})")
            if check is not None:
                existing.check = bool(check)
            return existing
        transport = _make_transport(backend, comm)
        from . import _failure

        _failure.install(transport)  # an uncaught exception on one rank aborts the job (see _failure)
        result = Communicator(transport, check=_config.check() if check is None else check)
        try:
            from ._backends import cuda

            cuda.initialize_eagerly(result)  # COLLECTIVES_NCCL_EAGER: agreed by every rank, else a no-op
        except BaseException:
            result.close()  # every rank fails alike here (the ranks agreed first), so every rank closes
            raise
        if comm is not None:
            _by_comm[id(comm)] = (comm, result)
        if _world is None:
            _world = result
        if not _atexit_registered:
            atexit.register(finalize)  # runs before mpi4py's MPI_Finalize (registered earlier)
            _atexit_registered = True
        return result


def world() -> Communicator:
    """The default communicator; calls ``init()`` on first use.

    Example:
        >>> import collectives as coll
        >>> 0 <= coll.world().rank < coll.world().size
        True
    """
    w = _world
    return w if w is not None else init()


def finalize() -> None:
    """Release every communicator the library made; :func:`init` may be called again afterwards.

    MPI itself is left initialised (mpi4py finalises it at exit), so other MPI users in the process are
    not disturbed. Collective (freeing MPI windows and communicators is): every rank calls it, as every
    rank reaches interpreter exit. Idempotent; also runs at interpreter exit.

    Example:
        >>> import collectives as coll
        >>> coll.finalize(); coll.finalize()
        >>> coll.world().closed
        False
    """
    global _world
    with _lock:
        comms = [c for _, c in _by_comm.values()]
        if _world is not None:
            comms.append(_world)
        _world = None
        _by_comm.clear()
    for c in comms:
        c.close()


def _resolve(comm) -> Communicator:
    if comm is None:
        w = _world
        return w if w is not None else init()
    if isinstance(comm, Communicator):
        return comm
    return init(comm=comm)


# ---------------------------------------------------------------------------------------------------------
# the collectives as functions

def broadcast(x, root: int = 0, *, comm=None):
    """Make every rank's ``x`` equal to root's.

    Every rank of ``comm`` must call it with the same ``root`` and an array of the same shape and dtype.
    Works on every dtype, bit for bit.

    Args:
        x: an array (NumPy, torch, array-api-strict, JAX, ... in host memory).
        root: the rank whose values are sent.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).

    Returns:
        ``x`` itself, holding root's values, when ``x`` is a writable NumPy array or a torch tensor (also a
        non-contiguous view: only its elements change; also a tensor that requires grad). Otherwise (a
        read-only array, array-api-strict, JAX) a new array of the same library and device.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> x = np.arange(4) * (comm.rank + 1)
        >>> coll.broadcast(x, root=0).tolist()
        [0, 1, 2, 3]
    """
    c = _world if comm is None else _resolve(comm)
    if c is None:
        c = init()
    if x.__class__ is _ndarray and root.__class__ is int:  # Communicator.broadcast's hot path, inlined
        run = c._fast_broadcast.get(x.dtype)
        if run is not None and x.flags.carray and 0 <= root < c._size:
            try:
                run(x, root)
            except Exception as exc:  # noqa: BLE001 - re-raised (MPI errors as CollectiveError)
                reraise(exc, "broadcast")
            return x
    return c.broadcast(x, root)


def allreduce(x, op: str = "sum", *, comm=None):
    """Combine ``x`` element-wise over all ranks; every rank gets the result.

    Every rank must call it with the same ``op`` and an array of the same shape and dtype.

    Args:
        x: an array in host memory.
        op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``"mean"``. Legal pairs: sum/prod on integers,
            floating and complex; min/max on integers, floating and bool (max = any, min = all); mean on
            floating and complex only. Other pairs raise ``TypeError`` before any communication.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).

    Returns:
        The result, in ``x`` itself when it is writable (see :func:`broadcast`), else a new array.
        float16/bfloat16 are accumulated in float32 where MPI cannot reduce them, then rounded back.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> x = np.array([1.0, 2.0]) * (comm.rank + 1)
        >>> coll.allreduce(x, op="mean").tolist() == [(comm.size + 1) / 2, comm.size + 1.0]
        True
    """
    c = _world if comm is None else _resolve(comm)
    if c is None:
        c = init()
    if x.__class__ is _ndarray and op.__class__ is str:  # Communicator.allreduce's hot path, inlined
        run = c._fast.get(op, _NONE).get(x.dtype)
        if run is not None and x.flags.carray:
            try:
                run(x)
            except Exception as exc:  # noqa: BLE001 - re-raised (MPI errors as CollectiveError)
                reraise(exc, "allreduce")
            return x
    return c.allreduce(x, op)


def reduce(x, op: str = "sum", root: int = 0, *, comm=None):
    """Combine ``x`` element-wise over all ranks; only ``root`` gets the result.

    Every rank must call it with the same ``op``, ``root``, shape and dtype. Same op/dtype rules as
    :func:`allreduce`.

    Returns:
        On ``root``: the result (in ``x`` when writable, else a new array). On every other rank: ``x``
        itself, unchanged.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> x = np.ones(2, dtype=np.int64)
        >>> y = coll.reduce(x, op="sum", root=0)
        >>> y.tolist() == ([comm.size] * 2 if comm.rank == 0 else [1, 1])
        True
    """
    return _resolve(comm).reduce(x, op, root)


def allgather(x, *, comm=None):
    """Every rank's ``x``, stacked: ``result[r]`` is rank r's ``x``.

    Every rank must call it with an array of the same shape and dtype.

    Returns:
        A new array of shape ``(size, *x.shape)``, of x's library, dtype and device.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> g = coll.allgather(np.array([comm.rank]))
        >>> g.shape == (comm.size, 1) and g[:, 0].tolist() == list(range(comm.size))
        True
    """
    return _resolve(comm).allgather(x)


def barrier(*, comm=None) -> None:
    """Return once every rank of ``comm`` has called it.

    Example:
        >>> import collectives as coll
        >>> coll.barrier()
    """
    _resolve(comm).barrier()

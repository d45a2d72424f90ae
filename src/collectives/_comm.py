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
import functools
import operator
import pickle
import sys
import threading
from time import time as _time
from collections import OrderedDict, deque
from typing import Any, NamedTuple

import numpy as np

from . import (_agree, _arrays, _buckets, _call, _config, _dtypes, _finite, _ops, _reduction, _registry,
               _reproducible, _threads, _trace, _tree)
from ._backends import closed as _closed
from ._backends import factory
from ._backends.base import HostTransport
from ._backends.closed import CLOSED
from ._errors import BackendUnavailableError, CollectiveError, reraise, transport_failure
from ._handles import Handle, settle_all
from ._threads import collective
from ._threads import enter as _enter, leave as _leave, refuse as _refuse_thread

CLOSE_WAIT_S = 30.0  # how long close() waits for handles not yet waited, without COLLECTIVES_TIMEOUT

BACKENDS = ("auto", "mpi", "self")
_ndarray = np.ndarray  # one global look-up on the hot path instead of two
_empty = np.empty
_torch_tensor = None  # torch.Tensor, once a torch tensor's call has been cached (torch is never imported here)
MAX_OUTSTANDING = 64  # asynchronous calls in flight per communicator before the oldest is completed (_sweep)
_NONE: dict = {}  # read-only by convention: what the hot path looks in for an op with no cached calls
_UNSET = object()  # "argument not part of this collective" (None is a value users may pass by mistake)
_P2P = ("send", "recv")  # the handles of point-to-point calls (only two ranks make each: see _sweep)


def _traced(collective: str, path: str = "blocking", root_at: int | None = None):
    """A Communicator method whose calls the flight recorder keeps (``_trace``): its record is started
    before the call and finished with it (``root_at``: the position of its ``root`` argument)."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            root = kwargs.get("root", args[root_at] if root_at is not None and len(args) > root_at else None)
            rec = self._begin_record(collective, None, None, root if root_at is not None else None, path)
            try:
                result = fn(self, *args, **kwargs)
            except BaseException as exc:
                if rec is not None:
                    rec.finish(exc)
                raise
            if rec is not None:
                rec.finish()
            return result
        return call
    return wrap


def _torch_plain(t) -> bool:
    """A CPU torch tensor whose ``.numpy()`` is its own memory, in order: strided, contiguous, not lazily
    negated (``z.conj().imag``). Only called for exact ``torch.Tensor`` of a cached real dtype."""
    return t.is_cpu and t.layout is _strided and t.is_contiguous() and not t.is_neg()


_strided = None  # torch.strided, set with _torch_tensor


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
        reproducible: whether float and complex sums and means default to ``reproducible=True``.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.init()
        >>> x = np.full(3, float(comm.rank + 1))
        >>> y = comm.allreduce(x, op="mean")     # in place: y is x
        >>> bool(y is x and (x == (comm.size + 1) / 2).all())
        True
    """

    def __init__(self, host: HostTransport, *, check: bool = False):
        self._host = host
        self._devices: dict = {}  # (dlpack device type, id) -> device transport
        self._fast: dict = {}  # op -> {array dtype: the call the general path chose} (hot path); see _fast_path
        self._fast_broadcast: dict = {}  # the same for broadcast (one look-up less)
        self._fast_blocks: dict = {}  # ("reduce_scatter", op, dtype) or ("alltoall", dtype) -> the same
        self._runners: dict = {}  # (op, DType) -> (transport, reduction call); see _runner
        self._pool = _buckets.Pool()  # the fused collectives' flat buffers (_buckets)
        self._scratch: dict = {}  # what -> a buffer the blocking reproducible sums reuse (see _reused)
        self._plans: OrderedDict = OrderedDict()  # tree structure -> (description, digest, plan) (_tree)
        self._size = host.size  # a plain attribute for the hot path
        self._subs: list = []  # communicators made by split(), closed with this one
        self._outstanding: dict = {}  # id -> Handle: asynchronous collectives not yet complete
        self._derived: dict = {}  # key -> a communicator the layers above made from this one (Engine.derived)
        self._engine = Engine(self)  # what the layers built on this communicator may use of it
        # The flight recorder (_trace): the last calls, a ring indexed by the sequence number. A hot-path
        # call stores its cached call (and a broadcast its root in _roots, at the same index), or (cached
        # call, shape) (reduce_scatter, alltoall): see trace_entries; the others a _trace.Record.
        capacity = _config.trace_buffer()
        self._ring: list | None = [None] * (1 << max(capacity - 1, 0).bit_length()) if capacity else None
        self._mask = len(self._ring) - 1 if self._ring is not None else 0
        self._roots: list = [None] * len(self._ring) if self._ring is not None else []
        self._seq = 0  # calls made on this communicator (the last one's sequence number)
        self._kept = capacity  # how many of the ring's entries a dump shows
        # point-to-point calls have a ring of their own (only two ranks make each: in the collectives'
        # sequence they would make the ranks' records differ where nothing diverged)
        self._p2p_ring: deque | None = deque(maxlen=capacity) if capacity else None
        self._p2p_seq = 0
        self._p2p_at = -1  # the collectives' sequence number when the last point-to-point call began
        self._hot_names: dict = {}  # a hot-path cached call -> (collective, op, dtype name)
        self._current = None  # the record of the call being validated (for its driver)
        self._calling: tuple | None = None  # the description of the call being validated (_call), for its driver
        self._repro = False  # whether the call being validated is a reproducible sum (_prepare), for its steps
        self._last_activity = 0.0  # when the sequence number last moved (the stall inspector's choice)
        self._name: str | None = None  # "world", "world.2" (a split), "comm1" (init(comm=...)): for dumps
        self._splits = 0  # split() calls made on this communicator (names its children alike on every rank)
        _trace.register(self._engine)
        # COLLECTIVES_CHECK_NAN (agreed by the transport): floating reductions' inputs are scanned before they
        # move (_finite): in _prepare, and by the hot path's cached call (_fast_path caches it guarded)
        self._check_nan = bool(host.check_nan)
        self._reproducible = _config.reproducible()  # the default of reproducible= (see the property)
        self.check = bool(check)
        host.on_failure(self._forget_fast_paths)  # a failed transport: every later call takes the checks
        if _config.timeline() is not None:  # COLLECTIVES_TIMELINE: instrumented entries in place of the methods
            from . import _timeline

            _timeline.install(self, self._engine)

    def _forget_fast_paths(self) -> None:
        self._fast, self._fast_broadcast, self._fast_blocks, self._runners = {}, {}, {}, {}

    @property
    def check(self) -> bool:
        """Whether a cross-rank agreement check runs before every collective (settable)."""
        return self._check

    @check.setter
    def check(self, value) -> None:
        self._check = bool(value)
        self._fast, self._fast_broadcast, self._fast_blocks = {}, {}, {}  # the hot path skips the check: empty it (unchecked
        # calls refill it, see _fast_path)

    @property
    def reproducible(self) -> bool:
        """Whether float and complex sums and means default to ``reproducible=True`` (settable; initially
        ``COLLECTIVES_REPRODUCIBLE``; a communicator made by :meth:`split` starts with its parent's). Other
        pairs (integer sums, min, max) give the same bits at any number of ranks anyway."""
        return self._reproducible

    @reproducible.setter
    def reproducible(self, value) -> None:
        self._reproducible = bool(value)
        self._fast, self._fast_blocks = {}, {}  # cached ordinary calls: not for calls that are now reproducible

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
        return self._host is CLOSED

    def __repr__(self) -> str:
        if self._host is CLOSED:
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
        if self._host is CLOSED:
            raise BackendUnavailableError(_closed.MESSAGE)
        if self._host.failed is not None:  # a timeout or a mismatch failed it: it stays failed
            self._host.usable()
        if device[0] in _arrays.HOST_DEVICE_TYPES:
            return self._host
        if device[0] in (_arrays.CUDA, _arrays.CUDA_MANAGED):
            hit = self._devices.get(device)
            if hit is None:
                hit = self._devices[device] = factory.device_transport(self._engine, device)
            return hit
        raise BackendUnavailableError(
            f"array on {_arrays.device_name(device)}: no transport for this device; copy it to host memory"
        )

    def _check_root(self, root, name: str = "root", what: str = "", also: str = "") -> int:
        """``root`` as a rank of this communicator, else TypeError/ValueError; ``name`` is the argument's
        name in the messages (a point-to-point call's ``dst``/``src``, with ``what`` the call and ``also``
        what else the argument may be)."""
        prefix = f"{what}: " if what else ""
        if isinstance(root, (bool, np.bool_)) or not isinstance(root, (int, np.integer)):
            raise TypeError(f"{prefix}{name} must be an integer rank{also}, got {type(root).__name__} {root!r}")
        root = int(root)
        if not 0 <= root < self.size:
            raise ValueError(f"{prefix}{name}={root} is out of range for a communicator of size {self.size} "
                             f"(valid: 0..{self.size - 1})")
        return root

    # ---- the array collectives ----
    # Each collective is written once, as its steps (``_broadcast``, ``_allreduce``, ...: a generator that
    # validates, yields each transfer as a _Step and finishes with the result); the blocking call runs them
    # to completion (_now), async_op=True runs them in a Handle (_async, _requests). The public methods add
    # the hot path of the blocking call (the cached call of the steps' last run with the same dtype).
    def broadcast(self, x, root: int = 0, *, async_op: bool = False):
        """Root's ``x`` on every rank. See :func:`collectives.broadcast`."""
        if async_op:
            return self._async("broadcast", self._broadcast, x, root)
        if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
            _threads.settle()
        if not _enter(False):  # another thread is inside a collective: refused (_threads)
            _refuse_thread("broadcast")
        try:
            cls = x.__class__
            if cls is _ndarray:  # the hot path (see _fast_path): a cached call, no validation
                run = self._fast_broadcast.get(x.dtype)
                if run is not None and x.flags.carray and root.__class__ is int and 0 <= root < self._size:
                    ring = self._ring
                    if ring is not None:  # the flight recorder (_trace): the cached call; the root beside it
                        n = self._seq = self._seq + 1
                        i = n & self._mask
                        ring[i] = run
                        self._roots[i] = root
                    run(x, root)
                    return x
            elif cls is _torch_tensor:
                run = self._fast_broadcast.get(x.dtype)
                if run is not None and root.__class__ is int and 0 <= root < self._size and _torch_plain(x):
                    ring = self._ring
                    if ring is not None:
                        n = self._seq = self._seq + 1
                        i = n & self._mask
                        ring[i] = run
                        self._roots[i] = root
                    run(x.detach().numpy() if x.requires_grad else x.numpy(), root)
                    _arrays.bump_versions((x,))  # written behind autograd's back: as under no_grad
                    return x
            return self._blocking(self._broadcast(x, root, False))
        except Exception as exc:  # noqa: BLE001 - re-raised; costs nothing unless raised: MPI's own errors become CollectiveError
            self._note_failure(exc, x)
            reraise(exc, "broadcast")
        finally:
            _leave()

    def _broadcast(self, x, root, asynchronous: bool):
        a, transport, view, info, _, root = self._prepare("broadcast", x, root=root, asynchronous=asynchronous)
        if transport.array_level:
            return a.written(x, (yield _Step(transport, "broadcast", (x, a, root), device=True)))
        buf, place = self._placing(x, a, view, info)
        run = None if asynchronous else (transport.fast_call("broadcast", view.dtype, self._size)
                                         or transport.broadcast)
        used = yield _Step(transport, "broadcast", (buf, root), run)
        if used is not None:
            self._fast_path("broadcast", x, a, view, info, used)
        return place()

    def allreduce(self, x, op: str = "sum", *, async_op: bool = False, reproducible: bool | None = None):
        """Reduce ``x`` over all ranks, result on every rank. See :func:`collectives.allreduce`."""
        if async_op:
            return self._async("allreduce", self._allreduce, x, op, reproducible)
        if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
            _threads.settle()
        if not _enter(False):  # another thread is inside a collective: refused (_threads)
            _refuse_thread("allreduce")
        try:
            cls = x.__class__
            try:  # (reproducible given: the general path, which never caches a reproducible call)
                table = self._fast.get(op, _NONE) if reproducible is None else _NONE
            except TypeError:  # an unhashable op: the general path says what is wrong with it
                table = _NONE
            if cls is _ndarray:  # the hot path (see _fast_path)
                run = table.get(x.dtype)
                if run is not None and x.flags.carray:  # C-contiguous, aligned and writable
                    ring = self._ring
                    if ring is not None:  # the flight recorder (_trace): the cached call only
                        n = self._seq = self._seq + 1
                        ring[n & self._mask] = run
                    run(x)
                    return x
            elif cls is _torch_tensor:
                run = table.get(x.dtype)
                if run is not None and _torch_plain(x):
                    ring = self._ring
                    if ring is not None:
                        n = self._seq = self._seq + 1
                        ring[n & self._mask] = run
                    run(x.detach().numpy() if x.requires_grad else x.numpy())
                    _arrays.bump_versions((x,))  # written behind autograd's back: as under no_grad
                    return x
            return self._blocking(self._allreduce(x, op, reproducible, False))
        except Exception as exc:  # noqa: BLE001 - re-raised (MPI errors as CollectiveError)
            self._note_failure(exc, x)
            reraise(exc, "allreduce")
        finally:
            _leave()

    def _allreduce(self, x, op, reproducible, asynchronous: bool):
        a, transport, view, info, op, _ = self._prepare("allreduce", x, op=op, asynchronous=asynchronous,
                                                        reproducible=reproducible)
        if transport.array_level:
            return a.written(x, (yield _Step(transport, "allreduce", (x, a, op), device=True)))
        buf, place = self._placing(x, a, view, info)
        if self._repro:
            yield from self._summing(transport, "allreduce", buf.reshape(1, -1), info, op, asynchronous, out=buf)
            return place()
        used = yield self._reduction(transport, "allreduce", buf, info, op, asynchronous)
        if used is not None and self._cacheable(info, op):
            self._fast_path(op, x, a, view, info, used)
        return place()

    @collective("allreduce_units")
    def allreduce_units(self, units, op: str = "sum", *, async_op: bool = False):
        """The reproducible sum or mean of every rank's units. See :func:`collectives.allreduce_units`."""
        if async_op:
            return self._async("allreduce", self._allreduce_units, units, op)
        return self._blocking(self._allreduce_units(units, op, False))

    def _allreduce_units(self, units, op, asynchronous: bool):
        a, transport, view, info, op, _ = self._prepare("allreduce", units, op=op, asynchronous=asynchronous,
                                                        reproducible=True, units=True)
        out = np.empty(view.shape[1:], dtype=view.dtype)
        stack = _contiguous(view).reshape(view.shape[0], out.size)
        yield from self._summing(transport, "allreduce", stack, info, op, asynchronous, out=out)
        return a.wrap(out, info, units)

    @collective("reduce")
    def reduce(self, x, op: str = "sum", root: int = 0, *, async_op: bool = False, reproducible: bool | None = None):
        """Reduce ``x`` over all ranks, result on ``root``. See :func:`collectives.reduce`."""
        if async_op:
            return self._async("reduce", self._reduce, x, op, root, reproducible)
        return self._blocking(self._reduce(x, op, root, reproducible, False))

    def _reduce(self, x, op, root, reproducible, asynchronous: bool):
        a, transport, view, info, op, root = self._prepare("reduce", x, op=op, root=root, asynchronous=asynchronous,
                                                           reproducible=reproducible)
        if transport.array_level:
            out = yield _Step(transport, "reduce", (x, a, op, root), device=True)
            return a.written(x, out) if self.rank == root else x
        if self._repro:
            receives = self.rank == root
            buf, place = self._placing(x, a, view, info) if receives else (_contiguous(view), None)
            yield from self._summing(transport, "reduce", buf.reshape(1, -1), info, op, asynchronous, (root,),
                                     receives=receives, out=buf)
            return place() if receives else x  # type: ignore[misc]
        if self.rank != root:  # non-root ranks contribute x and get it back unchanged
            yield self._reduction(transport, "reduce", _contiguous(view), info, op, asynchronous, (root,),
                                  receives=False)
            return x
        buf, place = self._placing(x, a, view, info)
        yield self._reduction(transport, "reduce", buf, info, op, asynchronous, (root,))
        return place()

    @collective("allgather")
    def allgather(self, x, *, async_op: bool = False):
        """Every rank's ``x``, stacked along a new leading axis. See :func:`collectives.allgather`."""
        if async_op:
            return self._async("allgather", self._allgather, x)
        return self._blocking(self._allgather(x, False))

    def _allgather(self, x, asynchronous: bool):
        a, transport, view, info, _, _ = self._prepare("allgather", x, asynchronous=asynchronous)
        if transport.array_level:
            return (yield _Step(transport, "allgather", (x, a), device=True))
        out = np.empty((self.size,) + view.shape, dtype=view.dtype)
        yield _Step(transport, "allgather", (_contiguous(view), out.reshape(self.size, -1)))
        return a.wrap(out, info, x)

    @collective("gather")
    def gather(self, x, root: int = 0, *, async_op: bool = False):
        """Every rank's ``x`` stacked on ``root``; None elsewhere. See :func:`collectives.gather`."""
        if async_op:
            return self._async("gather", self._gather, x, root)
        return self._blocking(self._gather(x, root, False))

    def _gather(self, x, root, asynchronous: bool):
        a, transport, view, info, _, root = self._prepare("gather", x, root=root, asynchronous=asynchronous)
        if transport.array_level:
            return (yield _Step(transport, "gather", (x, a, root), device=True))
        out = np.empty((self.size,) + view.shape, dtype=view.dtype) if self.rank == root else None
        yield _Step(transport, "gather", (_contiguous(view), None if out is None else out.reshape(self.size, -1),
                                          root))
        return None if out is None else a.wrap(out, info, x)

    def reduce_scatter(self, x, op: str = "sum", *, async_op: bool = False, reproducible: bool | None = None):
        """This rank's block of the reduction of ``x``. See :func:`collectives.reduce_scatter`."""
        if async_op:
            return self._async("reduce_scatter", self._reduce_scatter, x, op, reproducible)
        if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
            _threads.settle()
        if not _enter(False):  # another thread is inside a collective: refused (_threads)
            _refuse_thread("reduce_scatter")
        try:
            if x.__class__ is _ndarray and reproducible is None:  # the hot path (see _fast_path)
                try:
                    run = self._fast_blocks.get(("reduce_scatter", op, x.dtype))
                except TypeError:  # an unhashable op: the general path says what is wrong with it
                    run = None
                if run is not None and x.flags.c_contiguous and x.ndim and not x.shape[0] % self._size:
                    out = _empty((x.shape[0] // self._size,) + x.shape[1:], x.dtype)
                    ring = self._ring
                    if ring is not None:  # the cached call and the shape (read above anyway)
                        n = self._seq = self._seq + 1
                        ring[n & self._mask] = run, x.shape
                    run(x, out)
                    return out
            return self._blocking(self._reduce_scatter(x, op, reproducible, False))
        except Exception as exc:  # noqa: BLE001 - re-raised (MPI errors as CollectiveError)
            self._note_failure(exc, x)
            reraise(exc, "reduce_scatter")
        finally:
            _leave()

    def _reduce_scatter(self, x, op, reproducible, asynchronous: bool):
        a, transport, view, info, op, _ = self._prepare("reduce_scatter", x, op=op, blocks=True,
                                                        asynchronous=asynchronous, reproducible=reproducible)
        if transport.array_level:
            return (yield _Step(transport, "reduce_scatter", (x, a, op), device=True))
        size = self._size
        out = np.empty((view.shape[0] // size,) + view.shape[1:], dtype=view.dtype)
        if self._repro:
            yield from self._summing(transport, "reduce_scatter", _contiguous(view).reshape(1, -1), info, op,
                                     asynchronous, out=out)
            return a.wrap(out, info, x)
        if not _reduction.scatters(info, op):  # longdouble min/max: the block of an allreduce, same bits
            buf = np.array(view, order="C")
            yield self._reduction(transport, "allreduce", buf, info, op, asynchronous)
            out.reshape(-1)[...] = buf.reshape(size, -1)[self.rank]
            return a.wrap(out, info, x)
        used = yield self._reduction(transport, "reduce_scatter", _contiguous(view), info, op, asynchronous,
                                     out=out)
        if used is not None and self._cacheable(info, op):
            self._fast_path(("reduce_scatter", op, view.dtype), x, a, view, info, used, self._fast_blocks)
        return a.wrap(out, info, x)

    def _scatter_runner(self, transport, info, op: str):
        """The call that reduce-scatters ``(send, out)`` of ``info``'s dtype with ``op`` under the host
        rules (:func:`collectives._reduction.scatter_runner`), made once per (transport, dtype, op)."""
        key = ("reduce_scatter", op, info)
        hit = self._runners.get(key)
        if hit is None or hit[0] is not transport:
            general = functools.partial(self._reduce_scatter_into, transport, info=info, op=op)
            hit = self._runners[key] = (transport, _reduction.scatter_runner(transport, info, op, self._size,
                                                                              general))
        return hit[1]

    def _reduce_scatter_into(self, transport, send, out, info, op) -> None:
        """Reduce-scatter the contiguous host buffer ``send`` into ``out`` (this rank's block) under the
        host rules; ``send`` is left as it was."""
        size = self._size

        def collective(wire, o):
            block = _block_for(wire, out, size)
            transport.reduce_scatter(wire, block, o)
            return block

        _reduction.reduce_buffer(send, info, op, size, collective, transport.reduces, out=out)

    def alltoall(self, x, *, async_op: bool = False):
        """Block j of ``x`` to rank j, block i of the result from rank i. See :func:`collectives.alltoall`."""
        if async_op:
            return self._async("alltoall", self._alltoall, x)
        if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
            _threads.settle()
        if not _enter(False):  # another thread is inside a collective: refused (_threads)
            _refuse_thread("alltoall")
        try:
            if x.__class__ is _ndarray:  # the hot path (see _fast_path)
                run = self._fast_blocks.get(("alltoall", x.dtype))
                if run is not None and x.flags.c_contiguous and x.ndim and not x.shape[0] % self._size:
                    out = _empty(x.shape, x.dtype)
                    ring = self._ring
                    if ring is not None:  # the cached call and the shape (read above anyway)
                        n = self._seq = self._seq + 1
                        ring[n & self._mask] = run, x.shape
                    run(x, out)
                    return out
            return self._blocking(self._alltoall(x, False))
        except Exception as exc:  # noqa: BLE001 - re-raised (MPI errors as CollectiveError)
            self._note_failure(exc, x)
            reraise(exc, "alltoall")
        finally:
            _leave()

    def _alltoall(self, x, asynchronous: bool):
        a, transport, view, info, _, _ = self._prepare("alltoall", x, blocks=True, asynchronous=asynchronous)
        if transport.array_level:
            return (yield _Step(transport, "alltoall", (x, a), device=True))
        size = self._size
        out = np.empty(view.shape, dtype=view.dtype)
        run = None if asynchronous else (transport.fast_blocks("alltoall", None, view.dtype, size)
                                         or self._alltoall_blocks(transport))
        used = yield _Step(transport, "alltoall", (_contiguous(view).reshape(size, -1), out.reshape(size, -1)), run)
        if used is not None:
            self._fast_path(("alltoall", view.dtype), x, a, view, info, used, self._fast_blocks)
        return a.wrap(out, info, x)

    def _alltoall_blocks(self, transport):
        """``transport.alltoall`` on ``(send, out)`` of any shape (it takes ``(size, n)`` layouts)."""
        size = self._size
        return lambda send, out: transport.alltoall(send.reshape(size, -1), out.reshape(size, -1))

    # ---- point-to-point: send and recv (only the two ranks concerned call them) ----
    @collective("send")
    def send(self, x, dst: int, tag: int = 0, *, async_op: bool = False):
        """Send ``x`` to rank ``dst``. See :func:`collectives.send`."""
        if async_op:
            return self._async("send", self._send, x, dst, tag)
        return self._blocking(self._send(x, dst, tag, False))

    @collective("recv")
    def recv(self, x, src: int | None = None, tag: int = 0, *, async_op: bool = False):
        """Receive into ``x`` from rank ``src`` (None: any rank); the sender's rank. See
        :func:`collectives.recv`."""
        if async_op:
            return self._async("recv", self._recv, x, src, tag)
        return self._blocking(self._recv(x, src, tag, False))

    def _send(self, x, dst, tag, asynchronous: bool):
        a, transport, view, info, dst, tag = self._prepare_p2p("send", x, dst, tag, asynchronous)
        if transport.array_level:
            yield _Step(transport, "send", (x, a, dst, tag), device=True)
            return None
        yield _Step(transport, "send", (_contiguous(view), info.name, dst, tag))
        return None

    def _recv(self, x, src, tag, asynchronous: bool):
        a, transport, view, info, src, tag = self._prepare_p2p("recv", x, src, tag, asynchronous)
        box: list = [None]  # the sender's rank, written by the transport
        if transport.array_level:
            yield _Step(transport, "recv", (x, a, src, tag, box), device=True)
            return box[0]
        buf, place = self._placing(x, a, view, info)
        yield _Step(transport, "recv", (buf, info.name, src, tag, box))
        place()
        return box[0]

    def _prepare_p2p(self, what: str, x, peer, tag, asynchronous: bool):
        """Validate a send or recv before anything is sent: the array, the peer (``recv``: None is any
        rank), the tag, a writable receive buffer; ``(adapter, transport, view, info, peer, tag)``. No
        agreement step, checked mode or not: only two ranks take part."""
        side = "dst" if what == "send" else "src"
        self._current = rec = self._begin_p2p_record(what, x, asynchronous)
        a = _arrays.adapter(x)
        device = a.device(x)
        if isinstance(tag, (bool, np.bool_)) or not isinstance(tag, (int, np.integer)):
            raise TypeError(f"{what}: tag must be an integer, got {type(tag).__name__} {tag!r}")
        if peer is not None or what != "recv":  # (recv: None is any rank)
            peer = self._check_root(peer, side, what, " or None (any rank)" if what == "recv" else "")
        transport = self._transport_for(device)
        tag = int(tag)
        if not 0 <= tag <= transport.max_tag:
            raise ValueError(f"{what}: tag={tag} is out of range (valid: 0..{transport.max_tag}, this MPI's "
                             f"MPI_TAG_UB)")
        if what == "send" and peer == self.rank and not asynchronous:
            raise ValueError(f"send: dst={peer} is this rank: a blocking send to itself cannot complete before "
                             f"its receive is posted; use send(..., async_op=True) and then recv")
        view = info = None
        if not transport.array_level:
            view, info = a.host_view(x)
            if what == "recv" and not a.writable(x, view):
                raise ValueError(f"recv needs a writable array to receive into, got a read-only "
                                 f"{type(x).__module__}.{type(x).__qualname__}; pass a writable NumPy array or "
                                 f"torch tensor")
        if rec is not None:
            rec.path = (f"{rec.path}, {transport.name}, {side}={'any' if peer is None else peer}, tag={tag}")
        return a, transport, view, info, peer, tag

    def _begin_p2p_record(self, what: str, x, asynchronous: bool):
        """The flight recorder's record of a point-to-point call, in the communicator's p2p ring (numbered
        apart from the collectives), or None when the record is off."""
        ring = self._p2p_ring
        if ring is None:
            return None
        n = self._p2p_seq = self._p2p_seq + 1
        self._p2p_at = self._seq
        self._last_activity = _time()
        rec = _trace.Record(n, what, None, None, getattr(x, "dtype", None), getattr(x, "shape", None),
                            getattr(x, "nbytes", None), "point-to-point, " + ("asynchronous" if asynchronous
                                                                              else "blocking"))
        ring.append(rec)
        return rec

    def _reduction(self, transport, operation: str, buf, info, op: str, asynchronous: bool, extra: tuple = (), *,
                   receives: bool = True, out=None) -> _Step:
        """The step of a reduction of ``buf`` under the host rules (``_reduction``). Blocking: the call the
        general path chose (``_runner``, ``_scatter_runner``: a transport's direct call where the values
        travel as they are, else ``reduce_buffer``), which the hot path caches. Asynchronous: the same
        rules in steps (:meth:`_reducing`)."""
        rules = (info, op, extra, receives, out)
        args = (buf,) if out is None else (buf, out)
        if asynchronous:
            return _Step(transport, operation, args, rules=rules)
        if operation == "allreduce":
            run = self._runner(transport, info, op)
        elif operation == "reduce_scatter":
            run = self._scatter_runner(transport, info, op)
        else:
            call = getattr(transport, operation)

            def run(b):
                _reduction.reduce_buffer(b, info, op, self._size, lambda wire, o: call(wire, o, *extra),
                                         transport.reduces, receives=receives)
        return _Step(transport, operation, args, run)

    def _cacheable(self, info, op) -> bool:
        """Whether the hot path may keep the ordinary call of (dtype, op): not where the communicator's
        default makes that pair reproducible (the hot path would run the ordinary call)."""
        return not (self._reproducible and _reproducible.applies(info, op))

    def _summing(self, transport, operation: str, stack, info, op: str, asynchronous: bool, extra: tuple = (), *,
                 receives: bool = True, out=None, calling=None):
        """The steps of a reproducible sum or mean (``_reproducible``) of ``stack``, this rank's units
        (``(k, n)``, contiguous, ``info``'s storage dtype): the exponent codes allreduced with max at the
        call (:meth:`_exponents`), then the fixed-point words with ``operation`` (allreduce; reduce to
        ``extra[0]``; reduce_scatter: each rank its block), decoded into ``out`` where ``receives``.
        ``calling``: the call's description (``_call``; default: the one the validation made)."""
        size = self._size
        calling = self._calling if calling is None else calling
        n = _reproducible.elements(stack.shape[1], info)
        codes = _reproducible.codes(stack, info, out=self._reused("codes", _reproducible.code_dtype(info), n,
                                                                  asynchronous))
        self._exponents(transport, codes, asynchronous, calling)
        tail = operation != "reduce_scatter"
        wire = self._reused("words", np.dtype(np.float64), _reproducible.wire_size(stack.shape[1], info, tail),
                            asynchronous)
        if operation == "reduce_scatter":
            _reproducible.encode(stack, info, codes, blocks=size, tail=False, out=wire)
            block = np.empty(wire.size // size, dtype=wire.dtype)
            yield _Step(transport, "reduce_scatter", (wire, block, "sum"))
            m = codes.size // size
            _reproducible.decode(block, info, codes[self.rank * m:(self.rank + 1) * m], op, out, terms=size)
            return
        if (operation == "allreduce" and not asynchronous and size > 1 and info.kind == "f"
                and stack.shape[1] % size == 0 and wire.nbytes >= self.SPLIT_BYTES):
            yield from self._summing_split(transport, stack, info, op, codes, out)
            return
        _reproducible.encode(stack, info, codes, out=wire)
        yield _Step(transport, operation, (wire, "sum", *extra))
        if not receives:
            return
        terms = int(wire[-1])
        if terms > _reproducible.MAX_TERMS:  # (allreduce_units only: every rank learns it alike)
            raise ValueError(f"allreduce_units: {terms} units on all ranks together, more than a reproducible sum "
                             f"takes ({_reproducible.MAX_TERMS}); sum the units in groups of at most "
                             f"{_reproducible.MAX_TERMS} and then the groups' results")
        _reproducible.decode(wire, info, codes, op, out)

    SCRATCH_BYTES = 256 * 2**20  # the largest buffer a communicator keeps for reproducible sums
    # a blocking reproducible allreduce with this many bytes of words or more: reduce-scatter of the words,
    # each rank decodes its block, allgather of the results (_summing_split); below it one allreduce of the
    # words is faster (MPI's node-shared path: 1.3 against 6 to 10 ms at 2 MiB of words, 2 ranks)
    SPLIT_BYTES = 32 * 2**20

    def _summing_split(self, transport, stack, info, op: str, codes, out):
        """The words' allreduce of :meth:`_summing` as a reduce-scatter, each rank decoding only its block
        (every block carries the count of units in a last word), then an allgather of the decoded values
        into ``out``: the same bits on every rank (each element is decoded once, its bits moved), half the
        bytes of the words' second half on the wire, and 1/size of the decoding per rank."""
        size, n = self._size, stack.shape[1]
        m = n // size
        per = _reproducible.wire_size(m, info)  # a block's words and its count
        wire = self._reused("words", np.dtype(np.float64), size * per, False)
        for b in range(size):
            _reproducible.encode(stack[:, b * m:(b + 1) * m], info, codes[b * m:(b + 1) * m],
                                 out=wire[b * per:(b + 1) * per])
        block = np.empty(per, dtype=np.float64)
        yield _Step(transport, "reduce_scatter", (wire, block, "sum"))
        terms = int(block[-1])  # every block's count is the total: the same on every rank
        if terms > _reproducible.MAX_TERMS:
            raise ValueError(f"allreduce_units: {terms} units on all ranks together, more than a reproducible sum "
                             f"takes ({_reproducible.MAX_TERMS}); sum the units in groups of at most "
                             f"{_reproducible.MAX_TERMS} and then the groups' results")
        mine = np.empty(m, dtype=out.dtype)
        _reproducible.decode(block, info, codes[self.rank * m:(self.rank + 1) * m], op, mine)
        yield _Step(transport, "allgather", (mine, out.reshape(size, m)))

    def _reused(self, what: str, dtype: np.dtype, n: int, asynchronous: bool) -> np.ndarray:
        """``n`` elements of ``dtype`` for a reproducible sum's ``what`` ("codes", "words"): a buffer the
        blocking calls reuse (writing into memory already mapped is much faster than into a new large
        array), up to :data:`SCRATCH_BYTES`; a new one for an asynchronous call (it is in use until
        ``wait()``) or a larger buffer."""
        if asynchronous or n * dtype.itemsize > self.SCRATCH_BYTES:
            return np.empty(n, dtype=dtype)
        buf = self._scratch.get(what)
        if buf is None or buf.dtype != dtype or buf.size < n:
            buf = self._scratch[what] = np.empty(n, dtype=dtype)
        return buf[:n]

    def _exponents(self, transport, codes, asynchronous: bool, calling) -> None:
        """The first collective of a reproducible sum: the exponent codes allreduced with max, completed at
        the call in both modes (the words' collective needs its result; a transfer started later, at a
        ``done()`` on one rank and a ``wait()`` on another, could meet the ranks' other collectives in
        another order). Asynchronous: started with its fingerprint, as every asynchronous transfer is."""
        cinfo = _dtypes.from_numpy(codes.dtype)
        if asynchronous:
            for request in self._reducing(transport, "allreduce", codes, cinfo, "max", (), _nothing, calling=calling):
                request.wait()
            return
        transport.caller = calling
        try:
            self._runner(transport, cinfo, "max")(codes)
        finally:
            transport.caller = None

    # ---- asynchronous collectives (async_op=True) ----
    def _async(self, what: str, define, *args) -> Handle:
        """A :class:`Handle` running the steps ``define(*args, True)`` (see _requests): validation (and
        checked mode's agreement) runs here and a TypeError/ValueError is raised here, as is the error of a
        failed or closed communicator. Errors of the collective itself are raised by ``wait()``."""
        self._host.usable()  # a failed (or closed) communicator refuses at the call, as the blocking calls do
        if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
            _threads.settle()
        if not _enter(False):  # another thread is inside a collective: refused (_threads)
            _refuse_thread(what)
        self._current = rec = None
        try:
            if self._outstanding:
                self._sweep()
            steps = define(*args, True)
            self._calling = None
            try:
                first = next(steps)  # validates, up to the first transfer
            finally:
                rec = self._current
            calling = self._calling  # (_prepare described it)
        except StopIteration as stop:
            if rec is not None:
                rec.finish()
            return Handle.completed(what, stop.value)
        except BaseException as exc:
            if rec is not None:
                rec.finish(exc)
            if isinstance(exc, BackendUnavailableError) or not isinstance(exc, Exception):
                raise  # no transport for the array, a closed communicator: nothing started
            err = exc if isinstance(exc, CollectiveError) else transport_failure(exc, what)
            if err is None:
                raise
            return Handle.completed(what, error=err)
        finally:
            _leave()
        return Handle(what, self._requests(steps, first, calling), self._outstanding, self._host.fail, rec)

    def _sweep(self) -> None:
        """Before a call (asynchronous, or blocking on the general path, a barrier, an object collective):
        move on the outstanding handles whose transfers have completed, oldest first, stopping at the first
        collective still in flight (one ``MPI_Test`` each; a message still in flight is passed over: it may
        wait for its peer's later call), so that a handle dropped without ``wait()`` is released with its
        buffers once done, not only at ``close()``; and complete the oldest collective while more than
        :data:`MAX_OUTSTANDING` are in flight (MPI moves a non-blocking collective only inside MPI calls:
        without a bound, dropped handles would pile up, each with its buffers). Every rank issues the same
        collectives in the same order, so every rank completes the same oldest call here; a wait is
        bounded as ``wait()`` is. An error stays with its handle."""
        outstanding = self._outstanding
        for h in list(outstanding.values()):
            if not h._progress():
                if h.what in _P2P:
                    continue
                if len(outstanding) <= MAX_OUTSTANDING:
                    break
                try:
                    h.wait()
                except Exception:  # noqa: BLE001 - the handle keeps it: its own wait() raises it
                    pass
            outstanding.pop(id(h), None)  # (finishing removed it already; a handle that failed too)

    def _async_tree(self, tree, op, bucket_bytes, reproducible) -> Handle:
        """:meth:`allreduce_tree` with ``async_op=True``: its buckets' transfers (``_tree``) in a Handle."""
        self._host.usable()
        if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
            _threads.settle()
        if not _enter(False):
            _refuse_thread("allreduce_tree")
        rec = self._begin_record("allreduce_tree", None, op, None, "tree buckets, asynchronous")
        try:
            steps = _tree.allreduce_tree(self._engine, tree, op, bucket_bytes, True, reproducible)
        except BaseException as exc:
            if rec is not None:
                rec.finish(exc)
            if isinstance(exc, BackendUnavailableError) or not isinstance(exc, Exception):
                raise
            err = exc if isinstance(exc, CollectiveError) else transport_failure(exc, "allreduce_tree")
            if err is None:
                raise
            return Handle.completed("allreduce_tree", error=err)
        finally:
            _leave()
        if isinstance(steps, Handle):
            if rec is not None:
                rec.finish(steps._error)
            return steps
        return Handle("allreduce_tree", steps, self._outstanding, self._host.fail, rec)

    def _requests(self, steps, step: _Step, calling):
        """The asynchronous driver of a collective's steps: each transfer started with the transport's
        ``start`` (a device transport's on its own stream, after the caller's current stream; a reduction
        in its wire steps, :meth:`_reducing`), its request yielded to the Handle, which moves this on once
        the request is complete (``_handles``). ``calling``: the call as the user made it (``_call``), which
        the transport's fingerprint beside each host transfer carries."""
        while True:
            got = None
            if step.device:
                got, request = step.transport.start(step.operation, *step.args)
                yield request
            elif step.rules is not None:
                info, op, extra, receives, out = step.rules
                yield from self._reducing(step.transport, step.operation, step.args[0], info, op, extra,
                                          _nothing, receives=receives, out=out, calling=calling)
            else:
                yield _started(step.transport, calling, step.operation, step.args)
            try:
                step = steps.send(got)
            except StopIteration as stop:
                return stop.value

    @staticmethod
    def _placing(x, a, view, info):
        """``(buf, place)``: a contiguous writable buffer holding x's elements (x's own memory where it
        can be), and ``place()``, which puts the result where it belongs (x, written back into x, or a new
        array) and returns it. The caller's array is untouched until ``place()`` when it is a copy."""
        can_write = a.writable(x, view)
        if can_write and view.flags.writeable and view.flags.c_contiguous:
            return view, lambda: a.written(x, x)  # torch: autograd's version counter, as for a write under no_grad
        buf = np.array(view, order="C")

        def place():
            if can_write:
                a.write_back(x, view, buf)
                return a.written(x, x)
            return a.wrap(buf, info, x)

        return buf, place

    def _reducing(self, transport, operation, buf, info, op, extra, finish, *, receives=True, out=None,
                  calling=None):
        """The steps of a reduction under the host rules (``_reduction.steps``), each transfer started
        with ``transport.start`` beside ``calling`` (the call as the user made it, ``_call``; None: this
        reduction of ``buf`` itself, for the tree and bucket layers); returns ``finish()``.

        Every transfer starts at the call. The one pair that needs two transfers, one after the other
        (float min/max wider than 64 bits: values, then NaN and zero-sign flags), runs blocking at the call
        instead: a second transfer started later, by ``done()`` on one rank and by ``wait()`` on another,
        could meet the ranks' other collectives in a different order."""
        if calling is None:
            calling = _call.describe(operation, op, info, buf.size, extra[0] if extra else -1)
        if not _reduction.scatters(info, op):
            call = getattr(transport, operation)
            transport.caller = calling
            try:
                _reduction.reduce_buffer(buf, info, op, self._size, lambda wire, o: call(wire, o, *extra),
                                         transport.reduces, receives=receives, out=out)
            finally:
                transport.caller = None
            return finish()
        run = _reduction.steps(buf, info, op, self._size, transport.reduces, receives=receives, out=out)
        result = None
        while True:
            with np.errstate(all="ignore"):
                try:
                    wire, wire_op = run.send(result)
                except StopIteration:
                    break
            if operation == "reduce_scatter":
                result = _block_for(wire, out, self._size)
                yield _started(transport, calling, operation, (wire, result, wire_op))
            else:
                result = None
                yield _started(transport, calling, operation, (wire, wire_op, *extra))
        return finish()

    # ---- sub-communicators ----
    def split(self, color, key=0, *, timeout: float | None = None) -> Communicator | None:
        """Split this communicator into groups of ranks with equal ``color`` (``MPI_Comm_split``).

        Collective: every rank of this communicator calls it. Ranks with the same ``color`` form one new
        communicator, ranked by ``(key, rank here)``; a rank with ``color=None`` joins none and gets None.
        The new communicator has this one's settings (checked mode, ``COLLECTIVES_TIMEOUT``,
        ``COLLECTIVES_CHECK_NAN``), its own MPI communicator and, on first use of CUDA arrays, its own
        device transport (its own NCCL communicator). ``close()`` releases it (collective over its
        ranks); closing this communicator closes it too.

        Args:
            color: a non-negative integer, or None.
            key: an integer ordering the ranks within a group (ties: by rank here).
            timeout: seconds; every wait of the new communicator for the other ranks is bounded by it (by
                ``COLLECTIVES_TIMEOUT`` where that is smaller), as ``COLLECTIVES_TIMEOUT`` bounds a whole
                job's: a call that exceeds it raises :class:`CollectiveTimeoutError` and the communicator
                stays failed (docs/semantics.md). None (default): this communicator's bound, if any.

        Returns:
            The new :class:`Communicator`, or None where ``color`` is None.

        Raises:
            TypeError, ValueError: this rank's ``color`` or ``key`` is invalid (raised there; every other
                rank raises :class:`MismatchError` naming it, and no communicator is made).

        Example:
            >>> import collectives as coll
            >>> comm = coll.world()
            >>> sub = comm.split(color=comm.rank % 2, key=comm.rank)     # even and odd ranks
            >>> sub.size == len(range(comm.rank % 2, comm.size, 2)) and sub.rank == comm.rank // 2
            True
            >>> sub.close()
            >>> bounded = comm.split(color=0, timeout=600)   # every wait of its calls: 10 minutes at most
            >>> import numpy as np
            >>> bounded.allreduce(np.ones(2)).tolist() == [float(comm.size)] * 2
            True
            >>> bounded.close()
        """
        return self._split(color, key, timeout)

    @_traced("split")
    def _split(self, color, key, timeout=None):
        host = self._transport_for(_arrays.HOST)
        error = None
        try:
            color, key = _check_split(color, key)
            timeout = _check_timeout(timeout)
        except (TypeError, ValueError) as exc:
            error = exc
        # Every rank learns whether every other rank's arguments are valid before MPI splits (a rank that
        # raised alone would leave the others in MPI_Comm_split): the refusal branch of _agree.
        _agree.agree(host, "split", (), (), error, checked=self.check)
        sub = host.split(color, key, timeout)
        self._splits += 1
        if sub is None:
            return None
        child = Communicator(sub, check=self.check)
        child._reproducible = self._reproducible
        child._name = f"{self._name}.{self._splits}"  # the same on every rank of the child (split is collective)
        self._subs = [s for s in self._subs if not s.closed]  # a closed one is released (not kept to the end)
        self._subs.append(child)
        return child

    # ---- Python objects ----
    @collective("broadcast_object")
    @_traced("broadcast_object", root_at=1)
    def broadcast_object(self, obj, root: int = 0):
        """Root's picklable ``obj`` on every rank. See :func:`collectives.broadcast_object`."""
        host = self._transport_for(_arrays.HOST)
        try:
            root = self._check_root(root)
        except Exception as exc:
            if self.check:
                _agree.agree(host, "broadcast_object", (), None, exc)
            raise
        if self.check:
            _agree.agree(host, "broadcast_object", (("root", root),))
        blob = None
        if self.rank == root:  # (whether it pickled, the bytes or the message): every rank raises alike
            data, failure = _pickled(obj, "broadcast_object", "root's obj")
            blob = (failure, data)
        failure, data = host.objects_broadcast(blob, root)
        if failure:
            raise TypeError(data.decode())
        result = obj if self.rank == root else _unpickled(data, "broadcast_object", f"root {root}'s obj", self.rank)
        _agree_unpickled(host, result)
        return obj if self.rank == root else result

    @collective("allgather_object")
    @_traced("allgather_object")
    def allgather_object(self, obj) -> list:
        """Every rank's picklable ``obj``, in rank order. See :func:`collectives.allgather_object`."""
        host = self._transport_for(_arrays.HOST)
        if self.check:
            _agree.agree(host, "allgather_object")
        data, failure = _pickled(obj, "allgather_object", f"rank {self.rank}'s obj")
        blobs = host.objects_allgather((failure, data))  # bytes travel as they are (pickled once)
        notes = [d.decode() for f, d in blobs if f]
        if notes:  # every rank learns who failed, then every rank raises the same TypeError
            raise TypeError("; ".join(notes))
        values = [obj if r == self.rank else _unpickled(d, "allgather_object", f"rank {r}'s obj", self.rank)
                  for r, (_, d) in enumerate(blobs)]
        _agree_unpickled(host, *values)
        return values

    def _check_blocks(self, collective: str, x) -> None:
        """``x``'s leading dimension must split into ``size`` equal blocks (reduce_scatter, alltoall)."""
        shape = tuple(getattr(x, "shape", ()))
        if not shape:
            raise ValueError(f"{collective} needs an array with at least one dimension (its leading dimension "
                             f"is split into {self.size} blocks, one per rank), got a 0-d array; reshape it")
        if shape[0] % self.size:
            raise ValueError(f"{collective}: the leading dimension of x (shape {shape}) must be divisible by the "
                             f"communicator's size {self.size}, got {shape[0]}; pad x to a multiple of "
                             f"{self.size} rows")

    def _prepare(self, collective: str, x, op=_UNSET, root=_UNSET, blocks: bool = False,
                 asynchronous: bool = False, reproducible=None, units: bool = False):
        """Validate a call, choose its transport and, in checked mode, agree on it with the other ranks.

        Every check runs before any communication. In checked mode a rank whose own arguments are invalid
        first tells the others (they wait in the agreement step and raise MismatchError), then raises its
        TypeError/ValueError. Returns ``(adapter, transport, view, info, op, root)``; ``view`` and
        ``info`` (the NumPy view of x's memory and its dtype entry) are None for device transports.
        ``asynchronous`` (``async_op=True``) is part of what the ranks agree on: MPI does not match a
        non-blocking collective with a blocking one. ``reproducible`` (a sum or mean: the caller's argument,
        None for the communicator's default) sets ``self._repro`` for the call's steps; a reproducible call
        is described, and agreed, with its op named ``"reproducible sum"`` or ``"reproducible mean"``.
        ``units``: ``x`` is a stack of units (:meth:`allreduce_units`), whose leading dimension may differ
        between ranks (described and agreed by one unit's shape).
        """
        args: dict[str, object] = {"async_op": True} if asynchronous else {}
        view = info = None
        self._repro = False
        self._current = self._begin_record(collective, x, None if op is _UNSET else op, None if root is _UNSET else root,
                                     "asynchronous" if asynchronous else "blocking")
        try:
            a = _arrays.adapter(x)
            device = a.device(x)
            if op is not _UNSET:
                op = args["op"] = _dtypes.check_op(op)
            if root is not _UNSET:
                root = args["root"] = self._check_root(root)
            if blocks:
                self._check_blocks(collective, x)
            if units:
                _check_units(x)
            if op is not _UNSET and device[0] not in _arrays.HOST_DEVICE_TYPES:
                _no_device_reproducible(x, op, reproducible, self._reproducible)
            transport = self._local_transport(device)
            if transport is not None and not transport.array_level:
                view, info = a.host_view(x)
                if op is not _UNSET:
                    _dtypes.check_reduction(info, op)
                    self._repro = _wants_reproducible(reproducible, self._reproducible, info, op)
                    if self._repro:
                        args["op"] = f"reproducible {op}"
                        if self._size > _reproducible.MAX_TERMS:
                            raise ValueError(f"reproducible sums take at most {_reproducible.MAX_TERMS} terms per "
                                             f"element, and this communicator has {self._size} ranks")
        except Exception as exc:
            if self.check:  # the others wait in the agreement step: tell them, then raise (see _agree)
                _agree.agree(self._host, collective, (), None, exc)
            raise
        if transport is None:  # checked mode, an array outside host memory
            self._agree_device(collective, x, device, **args)
            transport = self._transport_for(device)
        elif not transport.array_level:
            # the call as the user made it (_call): what the fingerprint beside each transfer compares
            shape = view.shape[1:] if units else view.shape  # type: ignore[union-attr]
            self._calling = _call.describe(collective, args.get("op") if isinstance(op, str) else None, info,  # type: ignore[arg-type]
                                           int(np.prod(shape, dtype=np.int64)), root if isinstance(root, int) else -1)
            if self.check:
                self._agree(transport, collective, view, info, shape, **args)
            if self._check_nan and op is not _UNSET and _finite.checks(info):  # COLLECTIVES_CHECK_NAN
                _finite.check(transport, collective, _finite.scan([(view, info)]))
        rec = self._current
        if rec is not None:
            rec.path = f"{rec.path}, {transport.name}" + (", reproducible" if self._repro else "")
            if units:  # the ranks' unit counts may differ: what must agree is a unit's shape (as described)
                rec.shape = tuple(view.shape[1:])  # type: ignore[union-attr]
        return a, transport, view, info, op, root

    def _begin_record(self, collective: str, x=None, op=None, root=None, path: str = "blocking"):
        """Start the flight recorder's record of a call (:class:`collectives._trace.Record`) at the next
        sequence number, or None when the record is off (``COLLECTIVES_TRACE_BUFFER=0``)."""
        ring = self._ring
        if ring is None:
            return None
        n = self._seq = self._seq + 1
        try:  # (an array's three attributes: cheaper read than getattr with a default)
            dtype, shape, nbytes = x.dtype, x.shape, x.nbytes
        except AttributeError:
            dtype, shape, nbytes = getattr(x, "dtype", None), getattr(x, "shape", None), getattr(x, "nbytes", None)
        rec = _trace.Record(n, collective, op if op is None or op.__class__ is str else repr(op), root, dtype, shape,
                            nbytes, path)
        self._last_activity = rec.start
        ring[n & self._mask] = rec
        return rec

    def _note_failure(self, exc: BaseException, x) -> None:
        """A hot-path call raised (an MPI error, a timeout, a mismatch found beside it): its entry in the
        record gets the error and ``x``'s shape (which the hot path does not keep); a general-path call's
        record is finished by its driver."""
        ring = self._ring
        if ring is not None:
            i = self._seq & self._mask
            entry = ring[i]
            if entry is not None and entry.__class__ is not _trace.Record:  # a hot-path entry (trace_entries)
                run, shape = entry[:2] if entry.__class__ is tuple else (entry, getattr(x, "shape", None))
                ring[i] = run, shape, f"{type(exc).__name__}: {exc}"

    def _blocking(self, steps):
        """Run a collective's steps to completion (:func:`_now`); its record says how that ended. Dropped
        handles that have completed are released first (:meth:`_sweep`)."""
        if self._outstanding:
            self._sweep()
        self._current = None
        try:
            result = _now(steps, self)
        except BaseException as exc:
            rec = self._current
            if rec is not None:
                rec.finish(exc)
            raise
        rec = self._current
        if rec is not None:
            rec.finish()
        return result

    @collective("barrier")
    @_traced("barrier")
    def barrier(self) -> None:
        """Block until every rank has called it. See :func:`collectives.barrier`."""
        transport = self._transport_for(_arrays.HOST)
        if self._outstanding:
            self._sweep()
        if self.check:
            _agree.agree(transport, "barrier")
        transport.caller = _BARRIER
        try:
            transport.barrier()
        finally:
            transport.caller = None

    def _runner(self, transport, info, op: str):
        """The call that allreduces a contiguous buffer of ``info``'s dtype with ``op`` in place
        (:func:`collectives._reduction.runner`), made once per (transport, dtype, op) and kept here."""
        key = (op, info)
        hit = self._runners.get(key)
        if hit is None or hit[0] is not transport:
            hit = self._runners[key] = (transport, _reduction.runner(transport, info, op, self._size))
        return hit[1]

    def _fast_path(self, op, x, a, view, info, run, blocks: dict | None = None) -> None:
        """Cache ``run`` (the call the general path has just chosen for a fully validated call) for later
        calls with the same (op, dtype) on contiguous writable NumPy arrays, and on contiguous CPU torch
        tensors of a real dtype (called with the tensor's NumPy view).

        A later call with the same pair skips the adapter, the dtype table and the op checks (two
        dictionary look-ups and a flag read instead; for torch, a few cheap tensor attributes and
        ``.numpy()``), and gives the same bits: ``run`` is what the general path calls. Keyed by the
        array's own dtype object: NumPy and torch dtypes never compare equal. Only exact ``np.ndarray``
        and ``torch.Tensor`` (not subclasses such as ``nn.Parameter``, which keep the general path), and
        only dtypes whose storage view is the array's own dtype (not bfloat16 or the float8s, which are
        widened or reinterpreted; not complex torch tensors, whose lazily conjugated views NumPy cannot
        see). Never filled in checked mode (setting ``check`` empties it). Bounded: a handful of ops times
        the dtypes in use. ``close()`` empties it.

        ``blocks``: the table of reduce_scatter and alltoall, keyed ``("reduce_scatter", op, dtype)`` and
        ``("alltoall", dtype)`` (``op`` is that key: no op of one can find an entry of the other), taking ``run(x, out)``; NumPy arrays only (the block output is a new array).
        """
        global _torch_tensor, _strided
        if self._check or _call.naming_now()[0] is not None:  # (a front end's own op name: not for later calls;
            return  # a bucket's layout is: each hot call reads its own, see _described)
        if a is _arrays.NUMPY and x.__class__ is _ndarray:
            if view.dtype != x.dtype:  # the hot path hands run x itself: not for a reinterpreted view
                return  # (ml_dtypes' bfloat16 and float8 from JAX travel as their storage integers)
        elif a is _arrays.TORCH and info.name == view.dtype.name and view.dtype.kind in "biuf":
            torch = sys.modules["torch"]
            if x.__class__ is not torch.Tensor:
                return
            _torch_tensor, _strided = torch.Tensor, torch.strided  # the hot path hands run x.numpy()
        else:
            return
        if blocks is not None:
            if a is _arrays.NUMPY and op not in blocks:
                reduced = op[1] if op[0] == "reduce_scatter" else None
                run = _described(self._host, run, op[0], reduced, info)
                if reduced is not None and self._check_nan and _finite.checks(info):  # COLLECTIVES_CHECK_NAN
                    run = _finite.guarded(self._host, op[0], info, run, blocks=True)
                self._hot_names.setdefault(run, (op[0], reduced, info.name))
                blocks[op] = run
            return
        table = self._fast_broadcast if op == "broadcast" else self._fast.setdefault(op, {})
        if x.dtype in table:
            return
        collective, reduced = ("broadcast", None) if op == "broadcast" else ("allreduce", op)
        run = _described(self._host, run, collective, reduced, info)
        if reduced is not None and self._check_nan and _finite.checks(info):  # COLLECTIVES_CHECK_NAN: the
            run = _finite.guarded(self._host, collective, info, run)  # scan and the exchange, then the call
        self._hot_names.setdefault(run, (collective, reduced, info.name))
        table.setdefault(x.dtype, run)

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
        header = (*args.items(), ("shape", tuple(getattr(x, "shape", ()))), ("dtype", dtype), ("device", kind))
        _agree.agree(self._transport_for(_arrays.HOST), collective, header)

    @staticmethod
    def _agree(transport, collective, view, info, shape, **args):
        named, structure = _call.naming_now()  # the op as the caller named it (_call), as the fingerprint has it
        if named is not None and "op" in args:
            args["op"] = named
        if structure:
            args["structure"] = structure
        header = (*args.items(), ("shape", tuple(shape)), ("dtype", info.name), ("device", "host"))
        _agree.agree(transport, collective, header)

    # ---- helpers ----
    def close(self) -> None:
        """Release this communicator's resources (its MPI duplicate, its shared-memory window, device
        communicators, the communicators :meth:`split` made). Collective: every rank calls it
        (``finalize()`` and interpreter exit do). Idempotent.

        Asynchronous collectives not yet waited are completed first (their results land where
        ``wait()`` would have put them), for at most ``COLLECTIVES_TIMEOUT`` (else 30) seconds; if some
        cannot complete (a rank never issued the matching call), the rest is released and
        :class:`CollectiveError` names them (the MPI communicator is then left to the end of the process)."""
        failure = None
        pending, self._outstanding = list(self._outstanding.values()), {}
        if pending and self._host is not CLOSED:  # complete them first (their buffers are in use), bounded
            try:
                settle_all(pending, self._host.timeout or CLOSE_WAIT_S, "close()")
            except CollectiveError as exc:
                failure = exc
        subs, self._subs = self._subs, []
        self._derived = {}
        for sub in subs:  # in the order they were made: the same on every rank of each
            sub.close()
        host, self._host = self._host, CLOSED  # every later use raises BackendUnavailableError (_closed)
        self._fast, self._fast_broadcast, self._fast_blocks, self._runners = {}, {}, {}, {}
        self._pool = _buckets.Pool()
        self._scratch = {}
        self._plans.clear()
        devices, self._devices = list(self._devices.values()), {}
        for d in devices:  # device transports first: NCCL communicators were set up over the host one
            d.close()
        if host is not CLOSED and failure is None:  # not under a request still pending on it
            host.close()
        if failure is not None:
            raise failure

    # ---- the tree collectives ----
    def synchronize(self, tree, root: int = 0, *, bucket_bytes: int | None = None):
        """Root's values for every leaf of ``tree``. See :func:`collectives.synchronize`."""
        return self._tree_call("synchronize", _tree.synchronize, tree, root, bucket_bytes)

    @_traced("synchronize", path="tree buckets")
    def _tree_call(self, name, run, *args):
        return run(self._engine, *args)

    def allreduce_tree(self, tree, op: str = "mean", *, bucket_bytes: int | None = None, async_op: bool = False,
                       reproducible: bool | None = None):
        """Reduce every array leaf of ``tree``, fused. See :func:`collectives.allreduce_tree`.

        With ``async_op=True`` every fused host transfer (one per bucket and large leaf) is started as a
        non-blocking collective at the call; ``wait()`` returns the tree. CUDA leaves and Python ints are
        reduced at the call."""
        if async_op:
            return self._async_tree(tree, op, bucket_bytes, reproducible)
        return self._reduce_tree(tree, op, bucket_bytes, reproducible)

    @_traced("allreduce_tree", path="tree buckets")
    def _reduce_tree(self, tree, op, bucket_bytes, reproducible):
        return _tree.allreduce_tree(self._engine, tree, op, bucket_bytes, False, reproducible)


# ---------------------------------------------------------------------------------------------------------
# init / world / finalize

_lock = threading.RLock()
_world: Communicator | None = None
_atexit_registered = False


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
        if backend not in BACKENDS:  # malformed: refused by every rank when the transport is made (agreed)
            backend = "auto"
    with _lock:
        if comm is None and _world is not None:
            existing = _world
        elif comm is not None:
            existing = _registry.lookup(comm)  # by the MPI communicator, not the wrapper (_registry)
        else:
            existing = None
        if existing is not None:
            if backend != "auto" and backend != existing.backend:
                raise ValueError(f"already initialised with backend {existing.backend!r}; "
                                 f"call collectives.finalize() before init(backend={backend!r})")
            if check is not None:
                existing.check = bool(check)
            return existing
        transport = factory.host_transport(backend, comm)
        from . import _failure

        _failure.install(transport)  # an uncaught exception on one rank aborts the job (see _failure)
        result = Communicator(transport, check=_config.check() if check is None else check)
        try:
            from ._backends import cuda

            cuda.initialize_eagerly(result._engine)  # COLLECTIVES_NCCL_EAGER: agreed by every rank, else a no-op
        except BaseException:
            result.close()  # every rank fails alike here (the ranks agreed first), so every rank closes
            raise
        if comm is not None:
            _registry.remember(comm, result)
            _named[0] += 1
            result._name = f"comm{_named[0]}"  # in the order init(comm=...) was called
        if _world is None:
            _world = result
            result._name = "world"
            _start_trace(result)
        if not _atexit_registered:
            atexit.register(finalize)  # runs before mpi4py's MPI_Finalize (registered earlier)
            _atexit_registered = True
        return result


_named = [0]  # communicators made by init(comm=...), for their names in trace dumps


def _start_trace(world_comm: Communicator) -> None:
    """Start the flight recorder's process side (``_trace.start``) with a job id every rank shares (rank
    0's, broadcast: collective, at the first ``init``)."""
    if _config.trace_buffer() == 0:
        return
    import os
    import time

    mine = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    job = world_comm.broadcast_object(mine, 0) if world_comm.size > 1 else mine
    _trace.start(job, world_comm.rank, world_comm.size)


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
        comms = _registry.forget_all()
        if _world is not None:
            comms.append(_world)
        _world = None
    failures = []
    for c in comms:
        try:
            c.close()
        except CollectiveError as exc:  # asynchronous collectives left pending: close the others first
            failures.append(exc)
    if failures:
        raise failures[0]


class Engine:
    """The call engine of one :class:`Communicator`, as the layers built on it see it: trees and buckets
    (``_tree``, ``_buckets``), sharding (``_shard``), ``DistributedOptimizer`` and its gradient buckets
    (``_optim``, ``_overlap``) and the device transports (``_backends``) get this object, with public
    methods only, and reach no private attribute of the Communicator (``tests/unit/test_layers.py`` checks
    it). Everything else they need is the Communicator's public API (:attr:`communicator`).

    Example:
        >>> import collectives as coll
        >>> from collectives._comm import engine_of
        >>> e = engine_of(coll.world())
        >>> e.communicator is coll.world() and e.size == coll.world().size
        True
        >>> e.host is e.transport_for((1, 0))     # host memory (DLPack kDLCPU) goes to the host transport
        True
    """

    __slots__ = ("__weakref__", "communicator")  # weakly held by the flight recorder (_trace)

    def __init__(self, comm: Communicator):
        self.communicator = comm

    @property
    def rank(self) -> int:
        return self.communicator.rank

    @property
    def size(self) -> int:
        return self.communicator.size

    @property
    def local_rank(self) -> int:
        return self.communicator.local_rank

    @property
    def local_size(self) -> int:
        return self.communicator.local_size

    @property
    def check(self) -> bool:
        return self.communicator.check

    @property
    def check_nan(self) -> bool:
        """Whether floating reductions' inputs are checked for NaN and inf (``COLLECTIVES_CHECK_NAN``)."""
        return self.communicator._check_nan

    def check_root(self, root) -> int:
        """``root`` as a valid rank of the communicator, or the TypeError/ValueError of the collectives."""
        return self.communicator._check_root(root)

    def check_blocks(self, collective: str, x) -> None:
        """The ValueError of reduce_scatter and alltoall when ``x`` (anything with a ``shape``) has no
        leading dimension that splits into ``size`` equal blocks."""
        self.communicator._check_blocks(collective, x)

    @property
    def host(self):
        """The host transport (MPI or self): raises if the communicator is closed or failed."""
        return self.communicator._transport_for(_arrays.HOST)

    def transport_for(self, device: tuple[int, int]):
        """The transport for arrays on DLPack ``device`` (made on first use: collective for CUDA)."""
        return self.communicator._transport_for(device)

    def device_transports(self) -> dict:
        """The device transports made so far: ``{(dlpack type, id): transport}`` (a copy)."""
        return dict(self.communicator._devices)

    def runner(self, transport, info, op: str):
        """The call that allreduces a contiguous host buffer of ``info``'s dtype with ``op`` in place under
        the host rules (the one the general path and the hot path use)."""
        return self.communicator._runner(transport, info, op)

    def reducing(self, transport, operation: str, buf, info, op: str, extra: tuple, finish, **kwargs):
        """The asynchronous steps of a reduction of ``buf`` under the host rules (a generator of requests,
        for a :class:`~collectives.Handle`), returning ``finish()``."""
        return self.communicator._reducing(transport, operation, buf, info, op, extra, finish, **kwargs)

    @property
    def reproducible(self) -> bool:
        """The communicator's default of ``reproducible=`` (:attr:`Communicator.reproducible`)."""
        return self.communicator.reproducible

    def summing(self, transport, buf, info, op: str) -> None:
        """Allreduce the contiguous host buffer ``buf`` of ``info``'s storage dtype in place with the
        reproducible ``op`` (sum or mean, ``_reproducible``), blocking."""
        c = self.communicator
        calling = _call.describe("allreduce", f"reproducible {op}", info, _reproducible.elements(buf.size, info))
        for step in c._summing(transport, "allreduce", buf.reshape(1, -1), info, op, False, out=buf,
                               calling=calling):
            transport.caller = calling
            try:
                getattr(transport, step.operation)(*step.args)
            finally:
                transport.caller = None

    def summing_steps(self, transport, buf, info, op: str, finish):
        """:meth:`summing` as the asynchronous steps of a :class:`~collectives.Handle` (a generator of
        requests, started here up to the first), returning ``finish()``."""
        c = self.communicator
        calling = _call.describe("allreduce", f"reproducible {op}", info, _reproducible.elements(buf.size, info))
        for step in c._summing(transport, "allreduce", buf.reshape(1, -1), info, op, True, out=buf,
                               calling=calling):
            yield _started(transport, calling, step.operation, step.args)
        return finish()

    def reduces_on_the_callers_cpus(self) -> bool:
        """Whether a blocking host allreduce is computed by the ranks' own CPUs (every rank on one node):
        then it is the faster choice for a gradient bucket than an asynchronous one."""
        return self.host.reduces_on_the_callers_cpus()

    @property
    def pool(self):
        """The fused collectives' flat buffers (a ``_buckets.Pool``), released by ``close()``."""
        return self.communicator._pool

    @property
    def plans(self):
        """The tree plan cache (structure -> description, digest, plan), emptied by ``close()``."""
        return self.communicator._plans

    def derived(self, key, make):
        """The communicator ``make()`` made from this one for ``key`` (made on first use, again after it
        was closed): kept, and closed, with this communicator (the gradient collectives' split)."""
        table = self.communicator._derived
        hit = table.get(key)
        if hit is None or hit.closed:
            hit = table[key] = make()
        return hit


    # ---- the timeline's view (_timeline: COLLECTIVES_TIMELINE) ----
    def name(self) -> str | None:
        """The communicator's name (``world``, ``world.1``, ``comm1``)."""
        return self.communicator._name

    def seq_reader(self):
        """A callable of the communicator giving the sequence number of its last call (a C-level read: the
        timeline's entries read it after every call)."""
        return operator.attrgetter("_seq")

    def trace_entry(self, p2p: bool = False) -> tuple:
        """``(sequence number, the flight recorder's entry)`` of the last call (the last point-to-point call
        with ``p2p``): a :class:`collectives._trace.Record`, a hot-path entry, or None (record off)."""
        c = self.communicator
        if p2p:
            return c._p2p_seq, (c._p2p_ring[-1] if c._p2p_ring else None)
        return c._seq, (c._ring[c._seq & c._mask] if c._ring is not None else None)

    def trace_ring(self) -> tuple:
        """``(ring, mask, roots)``: the flight recorder's ring of entries (None when off), indexed by the
        sequence number ``& mask``, and the roots of the hot path's broadcasts beside it."""
        c = self.communicator
        return c._ring, c._mask, c._roots

    def hot_name(self, run) -> tuple:
        """``(collective, op, dtype name)`` of a hot-path entry's cached call (Nones if unknown)."""
        return self.communicator._hot_names.get(run, (None, None, None))

    def host_transport(self):
        """The host transport, as it is (the timeline wraps some of its methods on the instance)."""
        return self.communicator._host

    def instrument(self, name: str, wrap) -> None:
        """Replace the communicator's ``_blocking`` (the blocking driver of a call's steps) or ``_async``
        (the asynchronous call) with ``wrap(method)``, on the instance."""
        if name not in ("_blocking", "_async"):
            raise ValueError(f"instrument: {name!r} is not one of _blocking, _async")
        c = self.communicator
        setattr(c, name, wrap(getattr(c, name)))

    def instrument_hot(self, make) -> None:
        """From now on, every call the hot path caches (``_fast_path``) is replaced in its table by
        ``make((collective, op, dtype name), run)``, which the flight recorder names as ``run``."""
        c = self.communicator
        fast_path = c._fast_path

        def caching(*args, **kwargs):
            fast_path(*args, **kwargs)
            for table in (*c._fast.values(), c._fast_broadcast, c._fast_blocks):
                for key, run in list(table.items()):
                    if not getattr(run, "instrumented", False):
                        names = c._hot_names.get(run, (None, None, None))
                        made = table[key] = make(names, run)
                        made.instrumented = True
                        c._hot_names[made] = names

        c._fast_path = caching  # type: ignore[method-assign]

    # ---- the flight recorder's view (_trace) ----
    def trace_name(self) -> str | None:
        """The communicator's name in dumps (``world``, ``world.0``, ...), or None when not recorded."""
        c = self.communicator
        return c._name if c._ring is not None else None

    def trace_seq(self) -> int:
        """The sequence number of the communicator's last call."""
        return self.communicator._seq

    def trace_p2p_seq(self) -> int:
        """The number of the communicator's last point-to-point call (numbered apart from the collectives)."""
        return self.communicator._p2p_seq

    def trace_entries(self, inside: bool = False) -> list[dict]:
        """The record's entries, oldest first, as dicts (the last ``COLLECTIVES_TRACE_BUFFER``). A hot-path
        entry has no site or times; the last one is "started" when ``inside`` (a thread of the process is
        inside a collective), else "completed"."""
        c = self.communicator
        ring, seq = c._ring, c._seq
        if ring is None:
            return []
        out = []
        for n in range(max(1, seq - min(c._kept, len(ring)) + 1), seq + 1):
            entry = ring[n & c._mask]
            if entry is None:
                continue
            if isinstance(entry, _trace.Record):
                out.append(entry.as_dict())
                continue
            # a hot-path entry: its cached call, or (cached call, shape[, error]); a broadcast's root is in
            # _roots at the same index (written with the entry)
            run, shape, error = (*entry, None)[:3] if entry.__class__ is tuple else (entry, None, None)
            collective, op, dtype = c._hot_names.get(run, ("unknown", None, None))
            root = c._roots[n & c._mask] if collective == "broadcast" else None
            nbytes = None
            state = "failed" if error is not None else "started" if inside and n == seq else "completed"
            if shape is None and state == "started":
                shape = _shape_in_progress(c)
            if shape is not None:
                shape = tuple(shape)
                try:
                    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                except TypeError:  # a dtype NumPy does not name (bfloat16 of torch)
                    pass
            out.append({"seq": n, "collective": collective, "op": op, "root": root, "dtype": dtype, "shape": shape,
                        "nbytes": nbytes, "path": "hot path", "site": None, "thread": None, "start": None,
                        "end": None, "state": state, "error": error})
        return out

    def trace_snapshot(self, inside: bool = False) -> dict:
        """The communicator's part of a dump: its name, ranks, sequence number and record."""
        c = self.communicator
        if c._ring is None or c._host is CLOSED:
            return {"name": c._name, "seq": None}
        return {"name": c._name, "rank": c.rank, "size": c.size, "seq": c._seq,
                "world_ranks": getattr(c._host, "world_ranks", None),
                "records": self.trace_entries(inside),
                "p2p": [r.as_dict() for r in (c._p2p_ring or ())]}

    def trace_last(self) -> tuple:
        """``(name, last entry as a dict, when the sequence number last moved on the general path)``: the
        last collective, or the last point-to-point call where it is still in progress and no collective
        was made since it began (then with ``"p2p": True``)."""
        c = self.communicator
        last = c._p2p_ring[-1] if c._p2p_ring else None
        if last is not None and last.state == "started" and c._p2p_at == c._seq:
            return self.trace_name(), dict(last.as_dict(), p2p=True), c._last_activity
        entries = self.trace_entries(True)
        return self.trace_name(), (entries[-1] if entries else None), c._last_activity


# the methods whose hot path keeps no shape in the record (see _shape_in_progress)
_HOT_CODES = frozenset(getattr(Communicator, name).__code__
                       for name in ("allreduce", "broadcast", "reduce_scatter", "alltoall"))


def _shape_in_progress(comm: Communicator):
    """The shape of the array of the call a thread is inside on ``comm``, read from that thread's frame of
    the method (the hot path's record keeps no shape: what a dump or the stall warning of a call in
    progress shows); None when no thread is in one of them."""
    for top in sys._current_frames().values():
        frame: Any = top
        while frame is not None:
            if frame.f_code in _HOT_CODES and frame.f_locals.get("self") is comm:
                return getattr(frame.f_locals.get("x"), "shape", None)
            frame = frame.f_back
    return None


def engine_of(comm: Communicator) -> Engine:
    """The :class:`Engine` of ``comm`` (for the layers built on the Communicator)."""
    return comm._engine


class _Step(NamedTuple):
    """One transfer of a collective's steps: ``operation`` of ``transport`` on ``args`` (host buffers; for
    a device transport, ``device``: ``(x, adapter, *arguments)``). ``run``: the blocking call to make
    instead of ``transport.<operation>(*args)`` (the one the hot path caches); ``rules``: a reduction under
    the host rules, ``(info, op, extra, receives, out)``, which the asynchronous driver runs in steps."""

    transport: Any  # a HostTransport or a DeviceTransport
    operation: str
    args: tuple
    run: object = None
    rules: tuple | None = None
    device: bool = False


def _now(steps, comm):
    """The blocking driver of a collective's steps: each transfer run to completion (``run``, or the
    transport's operation), the call used (or a device transport's result) sent back; the result.
    ``comm._current`` is left holding this call's record (made by the first step's validation), whatever
    calls the transfers made in between (a device transport staged through the host path)."""
    rec = None
    try:
        comm._calling = None
        try:
            step = next(steps)
        finally:
            rec = comm._current
        calling = comm._calling  # the call as the user made it (_call), described by the validation
        while True:
            if step.device:
                got = getattr(step.transport, step.operation)(*step.args)
            else:
                transport = step.transport
                transport.caller = calling  # for a transport that checks its calls beside them (deadline)
                try:
                    if step.run is not None:
                        step.run(*step.args)
                        got = step.run
                    else:
                        getattr(transport, step.operation)(*step.args)
                        got = None
                finally:
                    transport.caller = None
            step = steps.send(got)
    except StopIteration as stop:
        return stop.value
    finally:
        comm._current = rec


def _nothing() -> None:
    return None


_BARRIER = _call.describe("barrier", None, None, 0)
_PLAIN = _call.naming_now()  # no front end's naming


def _described(transport, run, collective: str, op: str | None, info):
    """A hot-path call: ``run`` itself, or, on a transport that checks even its blocking calls beside them
    (the deadline transport's fingerprint), ``run`` with the description of each call (``_call``: the
    collective, op, dtype, root and the array's count) set around it, as the general path sets it. The
    description is the plain call's, cached, unless the call is made inside a :func:`_call.naming` (a
    gradient bucket names its layout): then that call's own."""
    if not transport.checks_beside:
        return run
    with _call.naming():  # the entry serves calls of any naming: cache the plain head
        plain = _call.head(collective, op, info)
    now = _call.naming_now

    if collective == "broadcast":

        def described_broadcast(x, root):
            head = plain if now() is _PLAIN else _call.head(collective, op, info)
            transport.caller = head[:-1] + (root, x.size)  # the root is the call's
            try:
                run(x, root)
            finally:
                transport.caller = None

        return described_broadcast
    if collective in ("reduce_scatter", "alltoall"):

        def described_blocks(x, out):
            transport.caller = (plain if now() is _PLAIN else _call.head(collective, op, info)) + (x.size,)
            try:
                run(x, out)
            finally:
                transport.caller = None

        return described_blocks

    def described(x):
        transport.caller = (plain if now() is _PLAIN else _call.head(collective, op, info)) + (x.size,)
        try:
            run(x)
        finally:
            transport.caller = None

    return described


def _started(transport, calling, operation: str, args: tuple):
    """``transport.start(operation, *args)`` with ``calling`` (the caller's call, ``_call``) beside it."""
    transport.caller = calling
    try:
        return transport.start(operation, *args)
    finally:
        transport.caller = None


def _contiguous(view: np.ndarray) -> np.ndarray:
    """``view`` itself when C-contiguous, else a contiguous copy (for buffers that are only read)."""
    return view if view.flags.c_contiguous else np.array(view, order="C")


def _block_for(wire: np.ndarray, out: np.ndarray, size: int) -> np.ndarray:
    """Where a reduce-scatter of ``wire`` receives this rank's block: ``out``'s own memory when the wire
    dtype has out's item size (the values travel as they are, or as ordered integers, decoded in place),
    else a new array of the wire dtype (widened values, rounded back into ``out`` afterwards)."""
    if wire.dtype.itemsize == out.dtype.itemsize:
        return out.reshape(-1).view(wire.dtype)
    return np.empty(wire.size // size, dtype=wire.dtype)


def _wants_reproducible(reproducible, default: bool, info, op: str) -> bool:
    """Whether a reduction of ``info`` with ``op`` runs reproducibly: the caller's ``reproducible`` (True:
    validated, TypeError/ValueError for a pair without a reproducible sum), else the communicator's
    ``default`` where it applies (float and complex sums and means)."""
    if reproducible is None:
        return default and _reproducible.applies(info, op)
    if not isinstance(reproducible, (bool, np.bool_)):
        raise TypeError(f"reproducible must be True, False or None (the communicator's default), got "
                        f"{type(reproducible).__name__} {reproducible!r}")
    if reproducible:
        _reproducible.check(info, op)
    return bool(reproducible)


def _no_device_reproducible(x, op, reproducible, default: bool) -> None:
    """A reproducible sum of an array outside host memory: not available (ValueError, before anything)."""
    if reproducible is False or (reproducible is None and not default):
        return
    name = str(getattr(x, "dtype", "")).replace("torch.", "")
    if reproducible is None and not (op in _reproducible.OPS and _ops.kind_of(name) in "fc"):
        return
    raise ValueError(f"reproducible sums run on host memory; this {name} array is on "
                     f"{_arrays.device_name(_arrays.adapter(x).device(x))}: copy it to host memory first (x.cpu()), "
                     f"or pass reproducible=False" + (" (COLLECTIVES_REPRODUCIBLE=1 asks for reproducible sums)"
                                                      if reproducible is None else ""))


def _check_units(x) -> None:
    """A stack of units (:meth:`Communicator.allreduce_units`): at least one dimension, the leading one
    counting this rank's units (0 or more, at most ``MAX_TERMS``)."""
    shape = tuple(getattr(x, "shape", ()))
    if not shape:
        raise ValueError("allreduce_units needs a stack of units: an array whose leading dimension counts this "
                         "rank's units (0 or more), got a 0-d array; pass x[None] for one unit")
    if shape[0] > _reproducible.MAX_TERMS:
        raise ValueError(f"allreduce_units: {shape[0]} units on this rank, more than a reproducible sum takes "
                         f"({_reproducible.MAX_TERMS} on all ranks together)")


def _check_timeout(timeout) -> float | None:
    """Validated ``timeout=`` of :meth:`Communicator.split`: None, or positive finite seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"split: timeout must be a number of seconds or None, got {type(timeout).__name__} "
                        f"{timeout!r}")
    if not 0 < float(timeout) < float("inf"):
        raise ValueError(f"split: timeout must be a positive, finite number of seconds (or None), got {timeout}")
    return float(timeout)


def _check_split(color, key) -> tuple[int | None, int]:
    """Validated ``(color, key)`` for :meth:`Communicator.split`."""
    if color is not None:
        if isinstance(color, (bool, np.bool_)) or not isinstance(color, (int, np.integer)):
            raise TypeError(f"split: color must be a non-negative integer or None, got {type(color).__name__} "
                            f"{color!r}")
        color = int(color)
        if not 0 <= color < 2**31:
            raise ValueError(f"split: color must be a non-negative integer below 2**31 (or None: not a member), "
                             f"got {color}")
    if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)):
        raise TypeError(f"split: key must be an integer (it orders the ranks of a group), got "
                        f"{type(key).__name__} {key!r}")
    key = int(key)
    if not -2**31 <= key < 2**31:
        raise ValueError(f"split: key must fit a C int (-2**31 to 2**31-1), got {key}")
    return color, key


def _pickled(obj, collective: str, whose: str) -> tuple[bytes, bool]:
    """``(its pickle, False)``, or ``(the error message, True)`` when ``obj`` cannot be pickled."""
    try:
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - any pickling failure (PicklingError, TypeError, AttributeError) is reported on every rank
        text = (f"{collective}: {whose} of type {type(obj).__module__}.{type(obj).__qualname__} cannot be "
                f"pickled ({type(exc).__name__}: {exc}); send a picklable object (plain data, or an object "
                f"whose class is importable at module level on every rank); nothing was sent")
        return text.encode(), True
    return data, False


class _Unpickled:
    """What a receiver holds where an object could not be unpickled: the message, told to every rank."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _unpickled(data: bytes, collective: str, whose: str, rank: int):
    """``pickle.loads(data)``, or an :class:`_Unpickled` saying why it failed on this rank."""
    try:
        return pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure (AttributeError for a class missing here, ImportError, ...) is reported on every rank
        return _Unpickled(f"{collective}: {whose} cannot be unpickled on rank {rank} ({type(exc).__name__}: {exc}); "
                          f"send plain data, or an object whose class is importable at module level on every "
                          f"rank")


def _agree_unpickled(host, *values) -> None:
    """Every rank learns whether every receiver could unpickle what it got; if some could not, every rank
    (the sender included) raises the same TypeError naming them."""
    if host.size == 1:
        return
    note = next((v.message for v in values if isinstance(v, _Unpickled)), None)
    notes = [n for n in host.objects_allgather(note) if n is not None]
    if notes:
        raise TypeError("; ".join(notes))


def _resolve(comm) -> Communicator:
    if comm is None:
        w = _world
        return w if w is not None else init()
    if isinstance(comm, Communicator):
        return comm
    return init(comm=comm)


# ---------------------------------------------------------------------------------------------------------
# the collectives as functions

def broadcast(x, root: int = 0, *, comm=None, async_op: bool = False):
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
    c = (_world or init()) if comm is None else _resolve(comm)
    if async_op:
        return c.broadcast(x, root, async_op=True)
    return c.broadcast(x, root)


def allreduce(x, op: str = "sum", *, comm=None, async_op: bool = False, reproducible: bool | None = None):
    """Combine ``x`` element-wise over all ranks; every rank gets the result.

    Every rank must call it with the same ``op``, the same ``reproducible`` and an array of the same shape
    and dtype.

    Args:
        x: an array in host memory.
        op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``"mean"``. Legal pairs: sum/prod on integers,
            floating and complex; min/max on integers, floating and bool (max = any, min = all); mean on
            floating and complex only. Other pairs raise ``TypeError`` before any communication.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).
        async_op: return a :class:`Handle` at once instead of the result; ``handle.wait()`` returns the
            result (the same bits). Also on :func:`broadcast`, :func:`reduce`, :func:`allgather`,
            :func:`reduce_scatter`, :func:`alltoall` and :func:`allreduce_tree`; see docs/semantics.md.
        reproducible: ``True``: a sum or mean of float16, bfloat16, float32, float64 or complex whose bits
            are the same at any number of ranks, in any rank order, on any transport (summed in exact
            fixed point: within a documented bound of the exact sum, NaN/inf/-0.0 as IEEE gives them; see
            docs/semantics.md); about 2.25 times the bytes of the ordinary call. Another op or dtype is a
            ValueError/TypeError. ``None`` (default): the communicator's :attr:`Communicator.reproducible`
            (``COLLECTIVES_REPRODUCIBLE``). For several units per rank, see :func:`allreduce_units`.

    Returns:
        The result, in ``x`` itself when it is writable (see :func:`broadcast`), else a new array.
        float16/bfloat16 are accumulated in float32 where MPI cannot reduce them, then rounded back.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> x = np.array([1.0, 2.0]) * (comm.rank + 1)
        >>> coll.allreduce(x, op="mean").tolist() == [(comm.size + 1) / 2, comm.size + 1.0]
        True
        >>> y = np.array([1e8, 1.0, -1e8], dtype=np.float32)[comm.rank % 3:comm.rank % 3 + 1]   # one term per rank
        >>> _ = coll.allreduce(y, op="sum", reproducible=True)    # the same bits at 1, 2, 3 ... ranks
    """
    c = (_world or init()) if comm is None else _resolve(comm)
    if async_op:
        return c.allreduce(x, op, async_op=True, reproducible=reproducible)
    if reproducible is None:
        return c.allreduce(x, op)
    return c.allreduce(x, op, reproducible=reproducible)


def allreduce_units(units, op: str = "sum", *, comm=None, async_op: bool = False):
    """The reproducible sum (or mean) of every rank's units: the same bits for any split of the same units
    among any number of ranks.

    A rank may hold several units of the global data (rows, micro-batches, per-sample gradients): ``units``
    stacks this rank's along its leading dimension (any count, 0 included; it may differ between ranks).
    The result is the sum (``"mean"``: divided by the number of units on all ranks together) of all ranks'
    units, each unit a term of one exact fixed-point sum (see docs/semantics.md): bitwise the same whatever
    the number of ranks, whichever rank holds which unit and in which order. Every rank must call it with
    the same ``op``, dtype and unit shape (``units.shape[1:]``).

    Args:
        units: an array of shape ``(k, *shape)`` in host memory, of float16, bfloat16, float32, float64 or
            complex64/128; left unchanged.
        op: ``"sum"`` or ``"mean"``.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).
        async_op: return a :class:`Handle`; ``wait()`` returns the result.

    Returns:
        A new array of shape ``units.shape[1:]``, of the units' library and dtype, on every rank. No unit on
        any rank: zeros (sum) or NaN (mean).

    Raises:
        TypeError, ValueError: another op or dtype, a 0-d array, more than 65536 units in all.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> rows = np.arange(12.0).reshape(6, 2) / 7           # six units of global data, on every rank
        >>> mine = rows[comm.rank::comm.size]                 # this rank's share (any split will do)
        >>> total = coll.allreduce_units(mine, op="sum")
        >>> alone = comm.split(color=comm.rank)               # every rank a communicator of its own
        >>> solo = coll.allreduce_units(rows, comm=alone)     # all six units on one process
        >>> total.tobytes() == solo.tobytes()
        True
        >>> alone.close()
    """
    return _resolve(comm).allreduce_units(units, op, async_op=async_op)


def reduce(x, op: str = "sum", root: int = 0, *, comm=None, async_op: bool = False,
           reproducible: bool | None = None):
    """Combine ``x`` element-wise over all ranks; only ``root`` gets the result.

    Every rank must call it with the same ``op``, ``root``, ``reproducible``, shape and dtype. Same
    op/dtype rules as :func:`allreduce` (and ``reproducible=True``: the bits of :func:`allreduce`'s
    reproducible sum, on ``root``).

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
    return _resolve(comm).reduce(x, op, root, async_op=async_op, reproducible=reproducible)


def allgather(x, *, comm=None, async_op: bool = False):
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
    return _resolve(comm).allgather(x, async_op=async_op)


def gather(x, root: int = 0, *, comm=None, async_op: bool = False):
    """Every rank's ``x`` stacked along a new leading axis on ``root`` (``MPI_Gather``); None elsewhere.

    Every rank passes an array of the same shape and dtype; ``root`` gets a new array of shape
    ``(size, *x.shape)`` of x's library and device, row r holding rank r's ``x`` bit for bit (every dtype).
    The other ranks get None. ``x`` is never written.

    Args:
        x: an array (any array-API library; any dtype).
        root: the rank that receives (the same on every rank).
        comm: the communicator (default: the one :func:`init` made).
        async_op: return a :class:`Handle` whose ``wait()`` gives the result.

    Returns:
        On ``root``, the stacked array; on every other rank, None.

    Raises:
        TypeError: ``x`` is not an array.
        ValueError: ``root`` is not a rank of ``comm``.
        MismatchError: (checked mode, and on the non-blocking paths) the ranks passed different shapes,
            dtypes or roots.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.init()
        >>> g = coll.gather(np.array([comm.rank, 10 * comm.rank]), root=0)
        >>> g.tolist() == [[r, 10 * r] for r in range(comm.size)] if comm.rank == 0 else g is None
        True
    """
    return _resolve(comm).gather(x, root, async_op=async_op)


def reduce_scatter(x, op: str = "sum", *, comm=None, async_op: bool = False, reproducible: bool | None = None):
    """Reduce ``x`` over all ranks and give each rank one block of the result.

    The leading dimension of ``x`` is split into ``size`` equal blocks; rank r gets block r of the
    element-wise reduction (what ``allreduce(x, op)[r * n : (r + 1) * n]`` would hold, bit for bit, with
    ``n = x.shape[0] // size``). Every rank must call it with the same ``op`` and an array of the same
    shape and dtype. Same op/dtype rules as :func:`allreduce` (mean, float16/bfloat16 accumulated in
    float32, float min/max with NaN winning and -0.0 < +0.0; ``reproducible=True``: the blocks of
    :func:`allreduce`'s reproducible sum, bit for bit).

    Args:
        x: an array (host memory, or CUDA memory of torch/CuPy) whose ``x.shape[0]`` is divisible by the
            communicator's size; left unchanged.
        op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``"mean"``.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).

    Returns:
        A new array of shape ``(x.shape[0] // size, *x.shape[1:])``, of x's library, dtype and device.

    Raises:
        ValueError: ``x`` is 0-d or its leading dimension is not divisible by the size (before any
            communication, on every rank that made such a call).
        TypeError: an illegal op/dtype pair.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> x = np.arange(2 * comm.size, dtype=np.int64).reshape(comm.size, 2)   # the same on every rank
        >>> mine = coll.reduce_scatter(x, op="sum")                            # block comm.rank of the sum
        >>> mine.shape, mine.tolist() == [(comm.size * x[comm.rank]).tolist()]
        ((1, 2), True)
    """
    return _resolve(comm).reduce_scatter(x, op, async_op=async_op, reproducible=reproducible)


def alltoall(x, *, comm=None, async_op: bool = False):
    """Exchange blocks: block j of this rank's ``x`` goes to rank j; block i of the result came from rank i.

    The leading dimension of ``x`` is split into ``size`` equal blocks. Every rank must call it with an
    array of the same shape and dtype. Any dtype, bit for bit.

    Args:
        x: an array whose ``x.shape[0]`` is divisible by the communicator's size; left unchanged.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).

    Returns:
        A new array of x's shape, library, dtype and device.

    Raises:
        ValueError: ``x`` is 0-d or its leading dimension is not divisible by the size.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> x = np.array([10 * comm.rank + j for j in range(comm.size)])   # block j: for rank j
        >>> coll.alltoall(x).tolist() == [10 * i + comm.rank for i in range(comm.size)]
        True
    """
    return _resolve(comm).alltoall(x, async_op=async_op)


def send(x, dst: int, tag: int = 0, *, comm=None, async_op: bool = False):
    """Send ``x`` to rank ``dst`` of ``comm`` (point-to-point: only this rank and ``dst`` take part).

    ``dst`` must post a matching :func:`recv` (this rank, or any rank, as ``src``; the same ``tag``) with
    an array of x's dtype and number of elements. Messages from one rank to another with the same tag
    arrive in the order they were sent. Any dtype, bit for bit; host arrays travel over MPI, CUDA arrays
    of torch and CuPy over NCCL (else the communicator's CUDA transport).

    Args:
        x: the array to send (left unchanged; with ``async_op=True`` leave it alone until ``wait()``).
        dst: the destination rank, ``0 <= dst < size``. A blocking send to this rank itself is refused
            (it could not complete); with ``async_op=True`` it is allowed.
        tag: a non-negative integer up to MPI's ``MPI_TAG_UB`` (at least 32767), matched by the receive.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).
        async_op: return a :class:`Handle` at once; ``wait()`` returns None once ``x`` may be reused.

    Returns:
        None once ``x`` may be reused (the receiver may not have it yet), or a :class:`Handle`.

    Raises:
        TypeError, ValueError: ``x`` is not an array, ``dst`` is not a rank, ``tag`` out of range (before
            anything is sent).
        CollectiveTimeoutError: with ``COLLECTIVES_TIMEOUT``, the receiver did not take the message in
            time (the communicator is then unusable, as after a collective's timeout).

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        >>> h = coll.send(np.full(3, float(comm.rank)), right, tag=5, async_op=True)   # a ring
        >>> got = np.empty(3)
        >>> coll.recv(got, left, tag=5) == left and got.tolist() == [float(left)] * 3
        True
        >>> h.wait()
    """
    return _resolve(comm).send(x, dst, tag, async_op=async_op)


def recv(x, src: int | None = None, tag: int = 0, *, comm=None, async_op: bool = False):
    """Receive into ``x`` the message with ``tag`` from rank ``src`` (None: from any rank).

    The message must hold x's dtype and number of elements (its shape may differ): a message of another
    dtype raises ``TypeError``, of another size ``ValueError``, on this rank, with ``x`` unchanged (the
    message is received and dropped, the communicator stays usable); it is never truncated. The sender is
    told nothing: its send completed.

    Args:
        x: a writable array (NumPy, torch; also a non-contiguous view, a tensor that requires grad).
        src: the source rank, or None for any rank (the first matching message).
        tag: the tag the sender used.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).
        async_op: return a :class:`Handle` at once; ``wait()`` returns the sender's rank once ``x`` holds
            the message.

    Returns:
        The sender's rank (``src`` itself, or the rank an any-source receive matched), or a
        :class:`Handle` whose ``wait()`` returns it.

    Raises:
        TypeError, ValueError: ``x`` is not an array or is read-only (array-api-strict, JAX, a read-only
            NumPy array), ``src`` is not a rank, ``tag`` out of range (before anything is received); the
            message does not fit ``x`` (see above).
        CollectiveTimeoutError: with ``COLLECTIVES_TIMEOUT``, no matching message came in time.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> h = coll.send(np.arange(4) + 10 * comm.rank, (comm.rank + 1) % comm.size, async_op=True)
        >>> x = np.empty(4, dtype=np.int64)
        >>> sender = coll.recv(x, src=None)                  # from any rank: here, the left neighbour
        >>> sender == (comm.rank - 1) % comm.size and x.tolist() == [10 * sender + i for i in range(4)]
        True
        >>> h.wait()
    """
    return _resolve(comm).recv(x, src, tag, async_op=async_op)


def broadcast_object(obj, root: int = 0, *, comm=None):
    """Root's ``obj`` (any picklable object) on every rank.

    Every rank of ``comm`` must call it with the same ``root``; the other ranks' ``obj`` is ignored. The
    root pickles first and tells every rank whether that worked, so an object that cannot be pickled
    raises the same ``TypeError`` on every rank (and nothing else is sent).

    Returns:
        On root: ``obj`` itself. Elsewhere: a new object unpickled from root's bytes.

    Raises:
        TypeError: root's object cannot be pickled (on every rank), or ``root`` is not an integer.
        ValueError: ``root`` is out of range.

    Example:
        >>> import collectives as coll
        >>> comm = coll.world()
        >>> cfg = coll.broadcast_object({"lr": 0.1, "rank": comm.rank}, root=0)
        >>> cfg
        {'lr': 0.1, 'rank': 0}
    """
    return _resolve(comm).broadcast_object(obj, root)


def allgather_object(obj, *, comm=None) -> list:
    """Every rank's ``obj`` (any picklable object), in rank order.

    Every rank of ``comm`` must call it. If some rank's object cannot be pickled, every rank raises the
    same ``TypeError`` naming that rank, and no object is exchanged.

    Returns:
        A list of ``size`` objects: entry r is rank r's (this rank's entry is ``obj`` itself).

    Example:
        >>> import collectives as coll
        >>> comm = coll.world()
        >>> coll.allgather_object(f"rank {comm.rank}") == [f"rank {r}" for r in range(comm.size)]
        True
    """
    return _resolve(comm).allgather_object(obj)


def barrier(*, comm=None) -> None:
    """Return once every rank of ``comm`` has called it.

    Example:
        >>> import collectives as coll
        >>> coll.barrier()
    """
    _resolve(comm).barrier()


def synchronize(tree, root: int = 0, *, comm=None, bucket_bytes: int | None = None):
    """Make every leaf of ``tree`` equal to root's: parameters, buffers, optimizer state, settings.

    Every rank of ``comm`` must call it with the same ``root`` and a tree of the same structure. Before
    any data moves the ranks compare a 16-byte fingerprint of their trees (paths, array shapes, dtypes and
    device kinds; the paths of non-array leaves, not their values); if they differ, every rank raises
    :class:`MismatchError` naming the first differing leaf, and nothing changes anywhere.

    What moves:

    - array leaves (NumPy, torch incl. parameters that require grad, anything with ``__dlpack__``): root's
      values, bit for bit. Host leaves, when every rank is on one node: one pipeline of 1 MiB messages,
      the root packing into at most ``bucket_bytes`` of reused buffers and the others receiving straight
      into their leaves; across nodes (or with ``COLLECTIVES_TIMEOUT``): fused buckets, leaves of 4 MiB
      or more in their own memory. CUDA leaves one by one on their device's transport. In place where the
      library allows (writable NumPy arrays, torch tensors), else a new array in the returned tree
      (read-only NumPy, array-api-strict, JAX);
    - non-array leaves (``None``, Python and NumPy scalars, strings, any picklable object): root's, in
      one pickled broadcast for all of them;
    - a torch ``nn.Module``: its parameters and buffers, in place;
    - a torch ``Optimizer`` (or a :func:`DistributedOptimizer` wrapping one): root's whole ``state_dict``
      (state tensors, step counts and hyper-parameters such as ``lr``), loaded into every other rank's
      optimizer; ranks may hold different, even empty, state before. The parameters themselves are not
      part of an optimizer's state: synchronize the model too. Every rank's optimizer must be of the same
      class, with the same groups of parameters of the same shapes.

    Args:
        tree: a tree (see above) of arrays and other values.
        root: the rank whose values everybody gets.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).
        bucket_bytes: the size bound of one fused buffer, and of the root's pack buffers (default
            ``COLLECTIVES_BUCKET_BYTES``, 25 MiB).

    Returns:
        The tree with root's values. On root: ``tree`` itself. Elsewhere: ``tree`` itself when every leaf
        was updated in place (NumPy, torch, modules, optimizers) and no leaf is a non-array value;
        otherwise a tree of the same structure whose containers are new where a leaf inside changed.

    Raises:
        MismatchError: the ranks' trees or roots differ (on every rank, nothing changed).
        ValueError: ``root`` out of range.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> state = {"w": np.full(3, float(comm.rank)), "step": comm.rank, "name": f"rank{comm.rank}"}
        >>> state = coll.synchronize(state, root=0)
        >>> state["w"].tolist(), state["step"], state["name"]
        ([0.0, 0.0, 0.0], 0, 'rank0')
    """
    return _resolve(comm).synchronize(tree, root, bucket_bytes=bucket_bytes)


def allreduce_tree(tree, op: str = "mean", *, comm=None, bucket_bytes: int | None = None, async_op: bool = False,
                   reproducible: bool | None = None):
    """Reduce every array leaf of ``tree`` over all ranks, fused into few collectives.

    Every rank must call it with the same ``op`` and a tree of the same structure (checked first, with
    one 17-byte Allgather; on a difference every rank raises :class:`MismatchError` and nothing changes).

    Small host leaves are packed into flat buffers per dtype of at most ``bucket_bytes`` each, one
    collective per buffer; a leaf of 256 KiB or more (or a quarter of ``bucket_bytes``) is reduced on its
    own, in its own memory when it is contiguous and writable, so large gradients are never copied.
    Leaves in CUDA memory are reduced on their device by its transport, per device in one call where it
    fuses (NCCL: one group). Results are written back into the caller's arrays where they are writable
    (NumPy, torch), else new arrays are returned in the result tree. Leaves may be of mixed dtypes and
    libraries; leaves that are the same object are reduced once (distinct leaves must not overlap in
    memory, e.g. ``x`` and ``x[:2]``: the overlap would be reduced twice).

    Leaves that are not arrays: Python and NumPy scalars are reduced too (and returned as the same type);
    ``None`` is kept (all ranks must have ``None`` there, e.g. a parameter without gradient); anything
    else is a TypeError.

    Args:
        tree: a tree of arrays (containers as in :func:`synchronize`, also an ``nn.Module``).
        op: ``"mean"`` (default), ``"sum"``, ``"prod"``, ``"min"`` or ``"max"``, with the dtype rules of
            :func:`allreduce` (``"mean"`` on an integer leaf is a TypeError naming the leaf).
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).
        bucket_bytes: the size bound of one fused buffer (default ``COLLECTIVES_BUCKET_BYTES``, 25 MiB);
            must be the same on every rank.
        async_op: return a :class:`Handle` at once; every fused host transfer is started as a
            non-blocking collective at the call, and ``handle.wait()`` returns what the blocking call
            returns. Leave the leaves alone until then. CUDA leaves and Python ints are reduced at the call.
        reproducible: ``True`` (op ``"sum"`` or ``"mean"``): every float and complex leaf is summed as
            :func:`allreduce` with ``reproducible=True`` does, element by element, so the bits do not depend
            on the number of ranks nor on ``bucket_bytes`` (integer leaves are exact anyway; a float leaf
            without a reproducible sum, such as longdouble, is a TypeError). ``None``: the communicator's
            default (:attr:`Communicator.reproducible`). Host leaves only.

    Returns:
        The tree with the reduced values: ``tree`` itself when every leaf was reduced in place.

    Raises:
        TypeError: an illegal op/dtype pair, or a leaf that cannot be reduced (raised on every rank,
            before any data moved).
        MismatchError: the ranks' trees or ops differ.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> grads = {"w": np.full((2, 2), float(comm.rank)), "b": np.ones(2), "loss": float(comm.rank)}
        >>> out = coll.allreduce_tree(grads, op="mean")
        >>> mean = (comm.size - 1) / 2
        >>> bool((out["w"] == mean).all()) and out["b"].tolist() == [1.0, 1.0] and out["loss"] == mean
        True
    """
    return _resolve(comm).allreduce_tree(tree, op, bucket_bytes=bucket_bytes, async_op=async_op,
                                         reproducible=reproducible)

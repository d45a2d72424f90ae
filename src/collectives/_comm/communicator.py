"""``Communicator``: a group of processes that call collectives together, and its methods.

The class holds the communicator's state (its transports, the hot path's tables, the flight recorder's
ring, the handles in flight) and its identity, and writes out in full only what must run in the method's
own frame: the hot path of ``allreduce``, ``broadcast``, ``reduce``, ``reduce_scatter``, ``alltoall`` and ``allgather`` (a cached
call on a contiguous NumPy array or CPU torch tensor: two dictionary look-ups and a flag read, no further
Python frame). Every other method is a front end of a few lines: the thread guard (``_threads``), then
the collective's steps from the module of its job (``reductions``, ``movement``, ``p2p``, ``objects``,
``split``, ``trees``) run by one of the two drivers (``call``). The engine's own entries that the timeline
or a test may replace on one communicator (``_transport_for``, ``_blocking``, ``_async``) are bound from
``call`` as class attributes, so an instance attribute can stand in for them; none adds a frame.
"""

from __future__ import annotations

import functools
import sys
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from .. import _arrays, _buckets, _call, _config, _threads, _trace
from .._backends.base import HostTransport
from .._backends.closed import CLOSED
from .._errors import reraise
from .._records import _hinting
from .._threads import collective
from .._threads import enter as _enter, leave as _leave, refuse as _refuse_thread
from . import call, movement, objects, p2p, record, reductions, summing, trees
from . import split as splitting
from .engine import Engine

_ndarray = np.ndarray  # one global look-up on the hot path instead of two
_empty = np.empty
_may_share_memory = np.may_share_memory  # (bounds only: cheap)
_torch_tensor = None  # torch.Tensor, once a torch tensor's call has been cached (torch is never imported here)
_NONE: dict = {}  # read-only by convention: what the hot path looks in for an op with no cached calls


def _torch_plain(t) -> bool:
    """A CPU torch tensor whose ``.numpy()`` is its own memory, in order: strided, contiguous, not lazily
    negated (``z.conj().imag``). Only called for exact ``torch.Tensor`` of a cached real dtype."""
    return t.is_cpu and t.layout is _strided and t.is_contiguous() and not t.is_neg()


_strided = None  # torch.strided, set with _torch_tensor
_from_numpy: Any = None  # torch.from_numpy, set with _torch_tensor


def _numpy_of(t):
    """A plain CPU tensor's NumPy view (``_torch_plain``), also of one that requires grad. (The hot paths
    of allreduce and broadcast write the same expression inline: no call of its own per call there.)"""
    return t.detach().numpy() if t.requires_grad else t.numpy()


def _hot_blocks(self, run, x, out):
    """The hot path's call of reduce_scatter, alltoall and allgather (a cached call from ``x`` into ``out``),
    kept by the flight recorder as the cached call and ``x``'s shape (read anyway)."""
    ring = self._ring
    if ring is not None:
        n = self._seq = self._seq + 1
        ring[n & self._mask] = run, x.shape
    run(x, out)
    return out


def _hot_into(self, kind: str, x, out):
    """Where the hot path of reduce_scatter, alltoall or allgather (``kind``) of ``x`` (a NumPy array, or a
    plain CPU tensor, ``_torch_plain``, of a dtype the hot path has cached) writes its result:
    ``(v, w, result, written)``, ``x``'s NumPy view ``v`` (C-contiguous: read only), the NumPy array ``w``
    the call writes, what the call returns (a new array, a tensor over it made as the general path wraps
    it: the caching took only dtypes whose view is their own, ``_fast_path``; or ``out``) and the tensor
    ``out`` to give a new version once written (else None). ``out``: of x's class and dtype, writable in
    place, of the result's shape, apart from x's memory. None where it does not apply: the general path
    (which raises what is wrong, or copies)."""
    if x.__class__ is _ndarray:
        if not x.flags.c_contiguous:
            return None
        v = x
    elif _torch_plain(x):
        v = _numpy_of(x)
    else:
        return None
    size = self._size
    if kind == "allgather":
        shape = (size,) + v.shape
    elif not v.ndim or v.shape[0] % size:  # (the general path's error)
        return None
    else:
        shape = v.shape if kind == "alltoall" else (v.shape[0] // size,) + v.shape[1:]
    if out is None:
        w = _empty(shape, v.dtype)
        return v, w, (w if v is x else _from_numpy(w)), None
    if out.__class__ is not x.__class__ or out.dtype != x.dtype:
        return None
    if v is x:
        if not out.flags.carray or out.shape != shape or _may_share_memory(v, out):
            return None
        return v, out, out, None
    if not _torch_plain(out):
        return None
    w = _numpy_of(out)
    if w.shape != shape or _may_share_memory(v, w):
        return None
    return v, w, out, out


def _async_blocks(self, kind: str, x, op, out):
    """The asynchronous hot path of allgather and reduce_scatter (``kind``; ``op``: reduce_scatter's, else
    None): a Handle over the cached steps of ``x``'s dtype (``call.hot_async``: no validation; their table in
    ``_fast_async``: ``call.cache_start``), into what :func:`_hot_into` says; None where it does not apply
    (the general path)."""
    cls = x.__class__
    if cls is not _ndarray and cls is not _torch_tensor:
        return None
    try:
        steps = self._fast_async.get(call.async_key(kind, op), _NONE).get(x.dtype)
    except TypeError:  # an unhashable op: the general path says what is wrong with it
        return None
    if steps is None or _hinting[0] or (into := _hot_into(self, kind, x, out)) is None:
        return None  # (a site hint: a jitted call's record keeps its site)
    return call.hot_async(self, steps, into[0], x, op, kind, into[1:])


def _torch_blocks(self, kind: str, op, x, out=None):
    """The hot path of reduce_scatter, alltoall and allgather (``kind``; ``op``: reduce_scatter's, else None)
    for a plain CPU tensor ``x`` of a cached (op, dtype): the NumPy arrays' hot path on its NumPy view, into
    what :func:`_hot_into` says; None where it does not apply (the general path)."""
    try:
        run = self._fast_blocks.get((kind, x.dtype) if op is None else (kind, op, x.dtype))
    except TypeError:  # an unhashable op: the general path says what is wrong with it
        return None
    if run is None or (into := _hot_into(self, kind, x, out)) is None:
        return None
    v, w, result, written = into
    _hot_blocks(self, run, v, w)
    if written is not None:
        _arrays.bump_versions((written,))  # written behind autograd's back: as under no_grad
    return result


def _hot_reduce(self, run, x, v, root) -> None:
    """The hot path's call of reduce: ``run(v, root)`` (``v``: ``x`` or a tensor's NumPy view), kept by the
    flight recorder as the cached call and ``x``'s shape, the root beside it."""
    ring = self._ring
    if ring is not None:
        n = self._seq = self._seq + 1
        i = n & self._mask
        ring[i] = run, x.shape
        self._roots[i] = root
    run(v, root)  # written at the root, read elsewhere


def _torch_reduce(self, op, root, x) -> bool:
    """The hot path of ``reduce`` for a plain CPU tensor ``x`` of a cached (op, dtype), as for a NumPy array
    (its NumPy view written at the root, read elsewhere; the root's tensor then has a new version, as the
    general path gives it); False where it does not apply (the general path)."""
    try:
        run = self._fast_blocks.get(("reduce", op, x.dtype))
    except TypeError:  # an unhashable op: the general path says what is wrong with it
        return False
    if run is None or root.__class__ is not int or not 0 <= root < self._size or not _torch_plain(x):
        return False
    _hot_reduce(self, run, x, _numpy_of(x), root)
    if root == self._host.rank:
        _arrays.bump_versions((x,))  # written behind autograd's back: as under no_grad
    return True


def _fast_path(self, op, x, a, view, info, run, blocks: dict | None = None, starts=None) -> None:
    """Cache ``run`` (the call the general path has just chosen for a fully validated call) for later
    calls with the same (op, dtype) on contiguous writable NumPy arrays, and on contiguous CPU torch
    tensors of a real dtype (called with the tensor's NumPy view): the hot path of the Communicator's
    methods (``Communicator._fast_path``, bound from here). Here, which arrays the hot path may take (the
    rules: ``call.cache``, which fills the tables); written in this module because it sets
    ``_torch_tensor``, a global the hot path reads.
    ``starts``: the transport of a completed asynchronous allreduce, allgather or reduce_scatter, whose steps the
    asynchronous hot path may repeat (``call.cache_start``; ``run`` is then None)."""
    global _torch_tensor, _strided, _from_numpy
    if self._check or _call.naming_now()[0] is not None:  # (a front end's own op name: not for later calls;
        return  # a bucket's layout is: each hot call reads its own, see steps.described)
    if a is _arrays.NUMPY and x.__class__ is _ndarray:
        if view.dtype != x.dtype:  # the hot path hands run x itself: not for a reinterpreted view
            return  # (ml_dtypes' bfloat16 and float8 from JAX travel as their storage integers)
    elif a is _arrays.TORCH and info.name == view.dtype.name and view.dtype.kind in "biuf":
        torch = sys.modules["torch"]
        if x.__class__ is not torch.Tensor:
            return
        # the hot path hands run x.numpy() (and wraps a new result with torch.from_numpy)
        _torch_tensor, _strided, _from_numpy = torch.Tensor, torch.strided, torch.from_numpy
    else:
        return
    if starts is not None:
        call.cache_start(self, op, x, a, info, starts)
        return
    call.cache(self, op, x, a, info, run, blocks)


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

    SCRATCH_BYTES = summing.SCRATCH_BYTES  # (read through the instance: see summing)
    SPLIT_BYTES = summing.SPLIT_BYTES

    def __init__(self, host: HostTransport, *, check: bool = False):
        self._host = host
        self._devices: dict = {}  # (dlpack device type, id) -> device transport
        self._fast: dict = {}  # op -> {array dtype: the call the general path chose} (hot path); see _fast_path
        self._fast_broadcast: dict = {}  # the same for broadcast (one look-up less)
        self._fast_blocks: dict = {}  # ("reduce_scatter", op, dtype), ("alltoall", dtype), ("allgather", dtype) or
        # ("reduce", op, dtype) -> the same
        self._fast_async: dict = {}  # op -> {array dtype: an asynchronous allreduce's steps} (call.cache_start)
        self._runners: dict = {}  # (op, DType) -> (transport, reduction call); see rules.runner
        self._pool = _buckets.Pool()  # the fused collectives' flat buffers (_buckets)
        self._scratch: dict = {}  # what -> a buffer the blocking reproducible sums reuse (summing.reused)
        self._plans: OrderedDict = OrderedDict()  # tree structure -> (description, digest, plan) (_tree)
        self._size = host.size  # a plain attribute for the hot path
        self._subs: list = []  # communicators made by split(), closed with this one
        self._outstanding: dict = {}  # id -> Handle: asynchronous collectives not yet complete
        self._derived: dict = {}  # key -> a communicator the layers above made from this one (Engine.derived)
        self._engine = Engine(self)  # what the layers built on this communicator may use of it
        # The flight recorder (_trace): the last calls, a ring indexed by the sequence number. A hot-path
        # call stores its cached call (and a broadcast its root in _roots, at the same index), or (cached
        # call, shape) (reduce_scatter, alltoall, allgather, reduce: its root in _roots too): see record.entries; the
        # others a record (_records: a list).
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
        self._repro = False  # whether the call being validated is a reproducible sum (validate.prepare), for its steps
        self._staging = False  # running a device call's host copy (call.staged): validated without a record or agreement
        self._last_activity = 0.0  # when the sequence number last moved (the stall inspector's choice)
        self._name: str | None = None  # "world", "world.2" (a split), "comm1" (init(comm=...)): for dumps
        self._splits = 0  # split() calls made on this communicator (names its children alike on every rank)
        _trace.register(self._engine)
        # COLLECTIVES_CHECK_NAN (agreed by the transport): floating reductions' inputs are scanned before they
        # move (_finite): in validate.prepare, and by the hot path's cached call (_fast_path caches it guarded)
        self._check_nan = bool(host.check_nan)
        self._reproducible = _config.reproducible()  # the default of reproducible= (see the property)
        self.check = bool(check)
        host.on_failure(self._forget_fast_paths)  # a failed transport: every later call takes the checks
        if _config.timeline() is not None:  # COLLECTIVES_TIMELINE: instrumented entries in place of the methods
            from .. import _timeline

            _timeline.install(self, self._engine)

    def _forget_fast_paths(self) -> None:
        self._fast, self._fast_broadcast, self._fast_blocks, self._fast_async, self._runners = {}, {}, {}, {}, {}

    @property
    def check(self) -> bool:
        """Whether a cross-rank agreement check runs before every collective (settable)."""
        return self._check

    @check.setter
    def check(self, value) -> None:
        self._check = bool(value)
        self._fast, self._fast_broadcast, self._fast_blocks, self._fast_async = {}, {}, {}, {}  # the hot path skips the
        # check: empty it (unchecked calls refill it, see _fast_path)

    @property
    def reproducible(self) -> bool:
        """Whether float and complex sums and means default to ``reproducible=True`` (settable; initially
        ``COLLECTIVES_REPRODUCIBLE``; a communicator made by :meth:`split` starts with its parent's). Other
        pairs (integer sums, min, max) give the same bits at any number of ranks anyway."""
        return self._reproducible

    @reproducible.setter
    def reproducible(self, value) -> None:
        self._reproducible = bool(value)
        self._fast, self._fast_blocks, self._fast_async = {}, {}, {}  # cached ordinary calls: not for calls that are
        # now reproducible

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

    # ---- the engine's entries, bound from ``call`` (an instance attribute may stand in for one: the timeline
    # times them, tests replace the transport choice) ----
    _transport_for = call.transport_for  # the one place a transport is chosen (from the array's device)
    _blocking = call.blocking  # the blocking driver of a call's steps
    _async = call.asynchronous  # async_op=True: the steps in a Handle

    # ---- the methods that only hand the call to their module (bound: no frame of their own) ----
    split = splitting.split  # sub-communicators (its example: split.py)
    broadcast_object = objects.broadcast_object
    allgather_object = objects.allgather_object
    barrier = movement.barrier
    synchronize = trees.synchronize
    close = call.close  # releases what this communicator owns (collective)

    # ---- the array collectives ----
    # Each collective is written once, as its steps (``movement.broadcast``, ``reductions.allreduce``, ...: a
    # generator that validates, yields each transfer as a steps.Step and finishes with the result); the
    # blocking call runs them to completion (_blocking), async_op=True runs them in a Handle (_async). The
    # methods below add the thread guard and, for four of them, the hot path of the blocking call (the
    # cached call of the steps' last run with the same dtype), written here: no frame between.
    def broadcast(self, x, root: int = 0, *, async_op: bool = False):
        """Root's ``x`` on every rank. See :func:`collectives.broadcast`."""
        if async_op:
            return self._async("broadcast", movement.broadcast, self, x, root)
        if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
            _threads.settle()
        if not _enter(False):  # another thread is inside a collective: refused (_threads)
            _refuse_thread("broadcast")
        try:
            cls = x.__class__
            # the hot path (see _fast_path): a cached call, no validation; a NumPy array or a plain CPU tensor
            numpy = cls is _ndarray
            if numpy or cls is _torch_tensor:
                run = self._fast_broadcast.get(x.dtype)
                if run is not None and root.__class__ is int and 0 <= root < self._size and (
                        x.flags.carray if numpy else _torch_plain(x)):
                    ring = self._ring
                    if ring is not None:  # the flight recorder (_trace): the cached call; the root beside it
                        n = self._seq = self._seq + 1
                        i = n & self._mask
                        ring[i] = run
                        self._roots[i] = root
                    if numpy:
                        run(x, root)
                        return x
                    run(x.detach().numpy() if x.requires_grad else x.numpy(), root)
                    _arrays.bump_versions((x,))  # written behind autograd's back: as under no_grad
                    return x
            return self._blocking(movement.broadcast(self, x, root, False))
        except Exception as exc:  # noqa: BLE001 - re-raised; costs nothing unless raised: MPI's own errors become CollectiveError
            record.note_failure(self, exc, x)
            reraise(exc, "broadcast")
        finally:
            _leave()

    def allreduce(self, x, op: str = "sum", *, async_op: bool = False, reproducible: bool | None = None):
        """Reduce ``x`` over all ranks, result on every rank. See :func:`collectives.allreduce`."""
        if async_op:
            cls = x.__class__  # the asynchronous hot path (call.hot_async): the cached steps, no validation
            if (cls is _ndarray or cls is _torch_tensor) and reproducible is None:
                try:
                    steps = self._fast_async.get(op, _NONE).get(x.dtype)
                except TypeError:  # an unhashable op: the general path says what is wrong with it
                    steps = None
                if steps is not None and not _hinting[0]:  # (a site hint: a jitted call's record keeps its site)
                    if cls is _ndarray:
                        if x.flags.carray:
                            return call.hot_async(self, steps, x, x, op)
                    elif _torch_plain(x):
                        return call.hot_async(self, steps, x.detach().numpy() if x.requires_grad else x.numpy(), x,
                                              op)
            return self._async("allreduce", reductions.allreduce, self, x, op, reproducible)
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
            return self._blocking(reductions.allreduce(self, x, op, reproducible, False))
        except Exception as exc:  # noqa: BLE001 - re-raised (MPI errors as CollectiveError)
            record.note_failure(self, exc, x)
            reraise(exc, "allreduce")
        finally:
            _leave()

    @collective("allreduce_units")
    def allreduce_units(self, units, op: str = "sum", *, async_op: bool = False):
        """The reproducible sum or mean of every rank's units. See :func:`collectives.allreduce_units`."""
        if async_op:
            return self._async("allreduce", reductions.allreduce_units, self, units, op)
        return self._blocking(reductions.allreduce_units(self, units, op, False))

    def reduce(self, x, op: str = "sum", root: int = 0, *, async_op: bool = False, reproducible: bool | None = None):
        """Reduce ``x`` over all ranks, result on ``root``. See :func:`collectives.reduce`."""
        if async_op:
            return self._async("reduce", reductions.reduce, self, x, op, root, reproducible)
        if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
            _threads.settle()
        if not _enter(False):  # another thread is inside a collective: refused (_threads)
            _refuse_thread("reduce")
        try:
            if x.__class__ is _ndarray and reproducible is None:  # the hot path (see _fast_path)
                try:
                    run = self._fast_blocks.get(("reduce", op, x.dtype))
                except TypeError:  # an unhashable op: the general path says what is wrong with it
                    run = None
                if run is not None and root.__class__ is int and 0 <= root < self._size and x.flags.carray:
                    _hot_reduce(self, run, x, x, root)
                    return x
            elif x.__class__ is _torch_tensor and reproducible is None and _torch_reduce(self, op, root, x):
                return x
            return self._blocking(reductions.reduce(self, x, op, root, reproducible, False))
        except Exception as exc:  # noqa: BLE001 - re-raised (MPI errors as CollectiveError)
            record.note_failure(self, exc, x)
            reraise(exc, "reduce")
        finally:
            _leave()

    def allgather(self, x, *, out=None, async_op: bool = False):
        """Every rank's ``x``, stacked along a new leading axis (into ``out`` where given). See
        :func:`collectives.allgather`."""
        if async_op:  # the asynchronous hot path (a Handle), else the general path's
            return _async_blocks(self, "allgather", x, None, out) or self._async(
                "allgather", movement.allgather if out is None else functools.partial(movement.allgather, out=out), self, x)
        if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
            _threads.settle()
        if not _enter(False):  # another thread is inside a collective: refused (_threads)
            _refuse_thread("allgather")
        try:
            if x.__class__ is _ndarray:  # the hot path (see _fast_path): read only, so read-only arrays too
                run = self._fast_blocks.get(("allgather", x.dtype))
                if run is not None and x.flags.c_contiguous:
                    if out is None:
                        return _hot_blocks(self, run, x, _empty((self._size,) + x.shape, x.dtype))
                    if (into := _hot_into(self, "allgather", x, out)) is not None:  # (a fitting out: out itself)
                        return _hot_blocks(self, run, x, into[1])
            elif x.__class__ is _torch_tensor and (got := _torch_blocks(self, "allgather", None, x, out)) is not None:
                return got
            return self._blocking(movement.allgather(self, x, False, out))
        except Exception as exc:  # noqa: BLE001 - re-raised (MPI errors as CollectiveError)
            record.note_failure(self, exc, x)
            reraise(exc, "allgather")
        finally:
            _leave()

    @collective("gather")
    def gather(self, x, root: int = 0, *, async_op: bool = False):
        """Every rank's ``x`` stacked on ``root``; None elsewhere. See :func:`collectives.gather`."""
        if async_op:
            return self._async("gather", movement.gather, self, x, root)
        return self._blocking(movement.gather(self, x, root, False))

    def reduce_scatter(self, x, op: str = "sum", *, out=None, async_op: bool = False,
                       reproducible: bool | None = None):
        """This rank's block of the reduction of ``x`` (into ``out`` where given). See
        :func:`collectives.reduce_scatter`."""
        if async_op:  # the asynchronous hot path (a Handle), else the general path's
            return (reproducible is None and _async_blocks(self, "reduce_scatter", x, op, out)) or self._async(
                "reduce_scatter", reductions.reduce_scatter if out is None else
                functools.partial(reductions.reduce_scatter, into=out), self, x, op, reproducible)
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
                    if out is None:
                        return _hot_blocks(self, run, x, _empty((x.shape[0] // self._size,) + x.shape[1:], x.dtype))
                    if (into := _hot_into(self, "reduce_scatter", x, out)) is not None:  # (a fitting out: out itself)
                        return _hot_blocks(self, run, x, into[1])
            elif x.__class__ is _torch_tensor and reproducible is None and (
                    got := _torch_blocks(self, "reduce_scatter", op, x, out)) is not None:
                return got
            return self._blocking(reductions.reduce_scatter(self, x, op, reproducible, False, out))
        except Exception as exc:  # noqa: BLE001 - re-raised (MPI errors as CollectiveError)
            record.note_failure(self, exc, x)
            reraise(exc, "reduce_scatter")
        finally:
            _leave()

    def alltoall(self, x, *, async_op: bool = False):
        """Block j of ``x`` to rank j, block i of the result from rank i. See :func:`collectives.alltoall`."""
        if async_op:
            return self._async("alltoall", movement.alltoall, self, x)
        if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
            _threads.settle()
        if not _enter(False):  # another thread is inside a collective: refused (_threads)
            _refuse_thread("alltoall")
        try:
            if x.__class__ is _ndarray:  # the hot path (see _fast_path)
                run = self._fast_blocks.get(("alltoall", x.dtype))
                if run is not None and x.flags.c_contiguous and x.ndim and not x.shape[0] % self._size:
                    return _hot_blocks(self, run, x, _empty(x.shape, x.dtype))
            elif x.__class__ is _torch_tensor and (out := _torch_blocks(self, "alltoall", None, x)) is not None:
                return out
            return self._blocking(movement.alltoall(self, x, False))
        except Exception as exc:  # noqa: BLE001 - re-raised (MPI errors as CollectiveError)
            record.note_failure(self, exc, x)
            reraise(exc, "alltoall")
        finally:
            _leave()

    # ---- point-to-point: send and recv (only the two ranks concerned call them) ----
    @collective("send")
    def send(self, x, dst: int, tag: int = 0, *, async_op: bool = False):
        """Send ``x`` to rank ``dst``. See :func:`collectives.send`."""
        if async_op:
            return self._async("send", p2p.send, self, x, dst, tag)
        return self._blocking(p2p.send(self, x, dst, tag, False))

    @collective("recv")
    def recv(self, x, src: int | None = None, tag: int = 0, *, async_op: bool = False):
        """Receive into ``x`` from rank ``src`` (None: any rank); the sender's rank. See
        :func:`collectives.recv`."""
        if async_op:
            return self._async("recv", p2p.recv, self, x, src, tag)
        return self._blocking(p2p.recv(self, x, src, tag, False))

    # ---- the tree collectives (``_tree``, on this communicator's Engine) ----
    def allreduce_tree(self, tree, op: str = "mean", *, bucket_bytes: int | None = None, async_op: bool = False,
                       reproducible: bool | None = None):
        """Reduce every array leaf of ``tree``, fused. See :func:`collectives.allreduce_tree`.

        With ``async_op=True`` every fused host transfer (one per bucket and large leaf) is started as a
        non-blocking collective at the call; ``wait()`` returns the tree. CUDA leaves and Python ints are
        reduced at the call."""
        if async_op:
            return trees.allreduce_tree_async(self, tree, op, bucket_bytes, reproducible)
        return trees.allreduce_tree(self, tree, op, bucket_bytes, reproducible)

    # ---- the hot path's tables ----
    _fast_path = _fast_path  # (a function of this module: the class stays within its size)

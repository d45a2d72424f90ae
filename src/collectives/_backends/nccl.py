"""The NCCL transport: CUDA arrays reduced and moved by NCCL, on the array library's current stream.

One NCCL communicator per (Communicator, CUDA device), made collectively by ``factory.device_transport`` the
first time a collective meets an array on that device (or at ``init()`` with
``COLLECTIVES_NCCL_EAGER=1``). Rank 0 makes the 128-byte unique id; it travels over the host transport.

Stream order, no host synchronisation: every call is enqueued on the current stream of the array's
library (``torch.cuda.current_stream(device)``, ``cupy.cuda.get_current_stream()``), after whatever
produced the array and before whatever uses the result; temporaries (for non-contiguous arrays, and the
``allgather`` result) are allocated by the library on that same stream.

Asynchronous calls (``async_op=True``, ``DeviceTransport.start``) are enqueued on this transport's own
stream after the caller's current stream, and every blocking call is ordered after those still running:
one communicator, one order (docs/semantics.md, "CUDA arrays: streams, not the host").

Never hangs forever: the communicator is non-blocking (``ncclConfig_t.blocking = 0``). A call that
returns ``ncclInProgress`` is polled with ``ncclCommGetAsyncError`` until it is done, for at most
``COLLECTIVES_TIMEOUT`` (default 300 s); then the communicator is aborted and that rank raises
:class:`~collectives.CollectiveTimeoutError`. An asynchronous NCCL error aborts it too and raises
:class:`~collectives.NcclError`. After an abort, CUDA collectives on that communicator raise
:class:`~collectives.BackendUnavailableError` until ``finalize()`` and ``init()``.

What this cannot see: a collective that NCCL accepted but that never completes on the GPU (a rank that
never made the matching call) blocks the *stream*, not this process; whoever next waits for that stream
waits too. Checked mode (``COLLECTIVES_CHECK=1``) catches mismatched calls before they are enqueued.
"""

from __future__ import annotations

import time

from .. import _dtypes
from .._errors import BackendUnavailableError, CollectiveTimeoutError, NcclError
import numpy as np

from . import _libnccl
from .._p2p import HEADER_WORDS, p2p_fields, p2p_header, p2p_mismatch
from .device import NCCL, DeviceTransport

CLOSE_TIMEOUT = 30.0  # seconds close() waits for ncclCommFinalize before aborting (never hangs at exit)
_SPINS = 200  # polls without sleeping before backing off (a call in progress usually ends within µs)

# The dtypes NCCL reduces with the host rules' bits itself (integers modulo 2**n; float32/float64 and complex
# parts with sum/prod, and the ordered integers of float min/max). Not float16 and bfloat16: NCCL rounds
# every partial sum to 16 bits, in an order its algorithm picks, so they are widened to float32 on the device
# (as the host path does where MPI cannot reduce float16); int16/uint16 are no NCCL type (refused).
_REDUCES = frozenset(["int8", "uint8", "int32", "uint32", "int64", "uint64", "float32", "float64", "complex64",
                      "complex128"])


def reduces(dtype, op: str) -> bool:
    """What NCCL reduces itself, for :func:`collectives._dtypes.wire` (the host rules' plan)."""
    return dtype.name in _REDUCES


class NCCLTransport(DeviceTransport):
    """CUDA arrays over one NCCL communicator on one device. Made by ``factory.device_transport``.

    Args:
        engine: the Communicator's :class:`~collectives._comm.Engine` (its host transport carries the
            unique id; its host path the descriptions of point-to-point messages).
        index: the CUDA device index.
        lib: the loaded :class:`~collectives._backends._libnccl.NCCLLibrary`.
        api: the device helper (``cuda.device_api()``) used to make ``index`` current during init.
        timeout: seconds a NCCL call may stay in progress.
    """

    name = NCCL
    fuses = True  # allreduce_many: one NCCL group

    def __init__(self, engine, index: int, lib, api, *, timeout: float):
        super().__init__(engine, index)
        self._lib = lib
        self._timeout = float(timeout)
        self._handle = 0
        self._dead: str | None = None  # why the communicator can no longer be used
        self._rules: dict = {}
        self._described: list = []  # the host handles of the descriptions of sends, until sent
        self._create(api)

    # ---- life cycle ----
    def _create(self, api) -> None:
        uid = None
        if self.rank == 0:
            try:
                uid = self._lib.get_unique_id()
            except NcclError as exc:  # sent as text, so no rank waits for an id that will never come
                uid = f"rank 0 could not make a NCCL unique id: {exc}"
        uid = self._host.broadcast_object(uid, 0)
        if isinstance(uid, str):
            raise BackendUnavailableError(uid)
        deadline = time.monotonic() + self._timeout
        with api.using(self.device_index):  # NCCL binds the communicator to the current device
            self._handle = self._lib.comm_init_rank_config(self.size, uid, self.rank,
                                                           _libnccl.make_config(blocking=False))
        self._settle("ncclCommInitRankConfig", deadline)

    def close(self) -> None:
        """Flush and destroy the NCCL communicator; abort it if that fails or takes over 30 s. Idempotent."""
        handle, self._handle = self._handle, 0
        if not handle:
            return
        self._dead = self._dead or "it was closed"
        lib = self._lib
        try:
            lib.comm_finalize(handle)
            deadline = time.monotonic() + min(self._timeout, CLOSE_TIMEOUT)
            state = lib.comm_get_async_error(handle)
            while state == _libnccl.ncclInProgress and time.monotonic() < deadline:
                time.sleep(1e-3)
                state = lib.comm_get_async_error(handle)
            if state != _libnccl.ncclSuccess:
                raise TimeoutError(f"ncclCommFinalize ended in state {state}")
            lib.comm_destroy(handle)
        except Exception:  # noqa: BLE001 - closing must not raise or hang; abort is the way out
            try:
                lib.comm_abort(handle)
            except Exception:  # noqa: BLE001
                pass

    def _abort(self, why: str) -> None:
        self._dead = why
        handle, self._handle = self._handle, 0
        if handle:
            try:
                self._lib.comm_abort(handle)
            except Exception:  # noqa: BLE001 - we are already reporting the real failure
                pass

    # ---- waiting (non-blocking communicator) ----
    def _error(self, state: int, what: str) -> NcclError:
        return self._lib.error(state, what)

    def _settle(self, what: str, deadline: float | None = None, state: int | None = None) -> None:
        """Poll until the call just issued is no longer in progress; abort and raise on error or timeout."""
        lib, handle = self._lib, self._handle
        if state is None:
            state = lib.comm_get_async_error(handle)
        spins = 0
        while state == _libnccl.ncclInProgress:
            now = time.monotonic()
            if deadline is None:
                deadline = now + self._timeout
            elif now > deadline:
                self._abort(f"{what} timed out after {self._timeout:g} s")
                raise CollectiveTimeoutError(
                    f"{what} on cuda:{self.device_index} (rank {self.rank} of {self.size}) did not complete "
                    f"within {self._timeout:g} s (COLLECTIVES_TIMEOUT): another rank probably did not make "
                    f"the same call, or failed. The NCCL communicator was aborted on this rank; call "
                    f"collectives.finalize() and collectives.init() to use CUDA arrays again")
            spins += 1
            if spins > _SPINS:
                time.sleep(min(1e-2, 1e-5 * (spins - _SPINS)))
            state = lib.comm_get_async_error(handle)
        if state != _libnccl.ncclSuccess:
            err = self._error(state, what)
            self._abort(f"{what} failed: {err}")
            raise err

    def _after_error(self, what: str) -> None:
        """A call raised NcclError: if the communicator itself is broken, abort it."""
        try:
            state = self._lib.comm_get_async_error(self._handle)
        except Exception:  # noqa: BLE001
            state = _libnccl.ncclInternalError
        if state not in (_libnccl.ncclSuccess, _libnccl.ncclInProgress):
            self._abort(f"{what} failed with NCCL state {state}")

    def _issue(self, what: str, fn, *args) -> None:
        try:
            status = fn(*args)
        except NcclError:
            self._after_error(what)
            raise
        if status != _libnccl.ncclSuccess:
            self._settle(what)

    # ---- validation (all before anything is enqueued) ----
    def _prepare(self, x):
        if self._dead is not None or not self._handle:
            raise BackendUnavailableError(
                f"the NCCL communicator for cuda:{self.device_index} cannot be used: {self._dead or 'closed'}; "
                f"call collectives.finalize() and collectives.init() to start again")
        state = self._lib.comm_get_async_error(self._handle)
        if state != _libnccl.ncclSuccess:  # raises for an asynchronous error (e.g. a peer died)
            self._settle("an earlier NCCL call", state=state)
        xp, info = super()._prepare(x)
        self._after_async(xp, x)  # one communicator, one order: after the asynchronous calls still running
        return xp, info

    def _reduction(self, info: _dtypes.DType, op: str):
        """``(plan, nccl dtype, nccl op, count multiplier)``, or TypeError (cached: it is on every call's
        path). ``plan`` is the host rules' (``_dtypes.wire``): float16/bfloat16 widened to float32, float
        min/max as ordered integers (NCCL's integer MIN/MAX), mean as a sum divided once (never ncclAvg,
        which multiplies by 1/n); the NCCL dtype and op are those of the encoded values."""
        key = (info, op)
        hit = self._rules.get(key)
        if hit is None:
            _dtypes.check_reduction(info, op)  # the host path's words first
            _libnccl.supported_dtype_op(info.name, op)  # then NCCL's (int16, complex prod, ...)
            plan = _dtypes.wire(info, op, reduces)
            travels = "bool" if info.kind == "b" else (plan.ordered if plan.ordered is not None else plan.dtype).name
            hit = self._rules[key] = (plan, *_libnccl.supported_dtype_op(travels, plan.op))
        return hit

    # ---- the collectives ----
    def allreduce(self, x, a, op):
        xp, info = self._prepare(x)
        plan, dtype, nop, mult = self._reduction(info, op)
        buf, in_place = xp.contiguous(x)
        wire, fresh = self._encode(xp, buf, info, plan)
        count = xp.numel(x) * mult
        if count:
            p = xp.ptr(wire)
            self._issue("ncclAllReduce", self._lib.all_reduce, p, p, count, dtype, nop, self._handle,
                        xp.stream(x))
        self._decode(xp, wire, plan, buf, fresh)
        if not in_place:
            xp.copy_back(x, buf)
        return x

    def reduce(self, x, a, op, root):
        xp, info = self._prepare(x)
        plan, dtype, nop, mult = self._reduction(info, op)
        receives = self.rank == root
        buf, in_place = xp.contiguous(x)
        wire, fresh = self._encode(xp, buf, info, plan, keep=not receives)
        count = xp.numel(x) * mult
        if count:  # recvbuff is only written on root: other ranks' x stays as it was
            p = xp.ptr(wire)
            self._issue("ncclReduce", self._lib.reduce, p, p, count, dtype, nop, root, self._handle,
                        xp.stream(x))
        if receives:
            self._decode(xp, wire, plan, buf, fresh)
            if not in_place:
                xp.copy_back(x, buf)
        return x

    def broadcast(self, x, a, root):
        xp, _ = self._prepare(x)
        is_root = self.rank == root
        buf, in_place = xp.contiguous(x, copy=is_root)
        nbytes = xp.numel(x) * xp.itemsize(x)
        if nbytes:  # bytes: every dtype, bit for bit
            p = xp.ptr(buf)
            self._issue("ncclBroadcast", self._lib.broadcast, p, p, nbytes, _libnccl.ncclUint8, root,
                        self._handle, xp.stream(x))
        if not in_place and not is_root:
            xp.copy_back(x, buf)
        return x

    def allgather(self, x, a):
        xp, send, out, nbytes = self._allgather_buffers(x)
        if nbytes:
            self._issue("ncclAllGather", self._lib.all_gather, xp.ptr(send), xp.ptr(out), nbytes,
                        _libnccl.ncclUint8, self._handle, xp.stream(x))
        return out

    def allreduce_many(self, arrays, a, op):
        """Reduce every array of ``arrays`` in place, in one NCCL group (one launch for all of them).

        The arrays must be on this transport's device; any dtype/op pair :meth:`allreduce` accepts, also
        non-contiguous views, with the same rules (widening, float min/max, mean). Every rank must pass the
        same number of arrays, shapes and dtypes, in order. Everything is validated before anything is
        enqueued.
        """
        plans = []
        for i, x in enumerate(arrays):
            xp, info = self._prepare(x)
            if xp.index(x) != self.device_index:
                raise ValueError(f"allreduce_many: array {i} is on cuda:{xp.index(x)}, but this transport "
                                 f"serves cuda:{self.device_index}; group arrays by device")
            plan, dtype, nop, mult = self._reduction(info, op)
            plans.append((x, xp, info, plan, dtype, nop, xp.numel(x) * mult))
        if not any(count for *_, count in plans):
            return arrays
        bufs = [xp.contiguous(x) for x, xp, *_ in plans]
        wires = [self._encode(xp, buf, info, plan) for (_, xp, info, plan, *_), (buf, _) in zip(plans, bufs)]
        lib = self._lib

        def issue():
            for (x, xp, _, _, dtype, nop, count), (wire, _) in zip(plans, wires):
                if count:
                    p = xp.ptr(wire)
                    lib.all_reduce(p, p, count, dtype, nop, self._handle, xp.stream(x))

        self._group(issue)
        for (x, xp, _, plan, *_), (buf, in_place), (wire, fresh) in zip(plans, bufs, wires):
            self._decode(xp, wire, plan, buf, fresh)
            if not in_place:
                xp.copy_back(x, buf)
        return arrays

    def reduce_scatter(self, x, a, op):
        xp, info = self._prepare(x)
        plan, dtype, nop, mult = self._reduction(info, op)
        shape = xp.shape(x)
        send, _ = xp.contiguous(x)
        out = xp.empty((shape[0] // self.size,) + shape[1:], like=x)
        wire, fresh = self._encode(xp, send, info, plan, keep=True)  # x stays as it was
        n = xp.numel(x) // self.size  # elements of one rank's block
        recv = xp.empty((n,), like=wire) if fresh else xp.flat(out)  # encoded: a temporary of the wire's dtype
        count = n * mult
        if count:
            self._issue("ncclReduceScatter", self._lib.reduce_scatter, xp.ptr(wire), xp.ptr(recv), count, dtype,
                        nop, self._handle, xp.stream(x))
        self._decode(xp, recv, plan, out, fresh)
        return out

    def alltoall(self, x, a):
        """One NCCL group of a ``ncclSend`` and a ``ncclRecv`` per peer (NCCL has no alltoall call)."""
        xp, _ = self._prepare(x)
        send, _ = xp.contiguous(x)
        out = xp.empty(xp.shape(x), like=x)
        block = xp.numel(x) * xp.itemsize(x) // self.size
        if block:
            lib, handle, stream, s, r = self._lib, self._handle, xp.stream(x), xp.ptr(send), xp.ptr(out)

            def issue():
                for peer in range(self.size):
                    lib.send(s + peer * block, block, _libnccl.ncclUint8, peer, handle, stream)
                    lib.recv(r + peer * block, block, _libnccl.ncclUint8, peer, handle, stream)

            self._group(issue)
        return out

    # ---- point-to-point: the data by ncclSend/ncclRecv, its description over the host path first ----
    # NCCL cannot tell a receive that the message is of another size or dtype (it would hang or write past
    # the buffer), nor receive from any rank. So each send first sends a description (p2p_header) by the
    # host path (Engine.staged: send's steps, asynchronous: it never waits for the receiver), then enqueues
    # ncclSend; the receiver receives the description (bounded by COLLECTIVES_TIMEOUT: it waits for the
    # sender to have *called* send, not for its data), checks it, then enqueues ncclRecv from that rank:
    # into the array, or, for a message that does not fit, into scratch memory of the sender's size (so the
    # sender's stream completes) before raising the host path's TypeError/ValueError, the array untouched.
    def send(self, x, a, dst, tag):
        self._not_itself("send", dst)
        xp, info = self._prepare(x)
        buf, _ = xp.contiguous(x)
        nbytes = xp.numel(x) * xp.itemsize(x)
        header = p2p_header(xp.numel(x), nbytes, info.name, 0, nbytes)
        self._described = [h for h in self._described if not h.done()]
        self._described.append(self._engine.staged("send", header, dst, tag, async_op=True))
        if nbytes:
            lib, handle, stream, p = self._lib, self._handle, xp.stream(x), xp.ptr(buf)
            self._group(lambda: lib.send(p, nbytes, _libnccl.ncclUint8, dst, handle, stream))

    def recv(self, x, a, src, tag, box):
        if src is None:
            raise ValueError("recv of a CUDA array from any rank: NCCL has no any-source receive (nor has "
                             "torch's NCCL backend); pass src, or receive into a host array")
        self._not_itself("recv", src)
        xp, info = self._prepare(x)
        header = np.empty(HEADER_WORDS, dtype=np.int64)
        self._engine.staged("recv", header, src, tag)
        nbytes = xp.numel(x) * xp.itemsize(x)
        error = p2p_mismatch(header, xp.numel(x), nbytes, info.name, src, tag, self.rank)
        if error is None:
            buf, in_place = xp.contiguous(x, copy=False)
            count = nbytes
        else:  # scratch of at least the sender's bytes, on x's device
            count = p2p_fields(header)[0]
            buf, in_place = xp.empty((-(-count // max(xp.itemsize(x), 1)) or 1,), like=x), True
        if count:
            lib, handle, stream, p = self._lib, self._handle, xp.stream(x), xp.ptr(buf)
            self._group(lambda: lib.recv(p, count, _libnccl.ncclUint8, src, handle, stream))
        if error is not None:
            raise error
        if not in_place:
            xp.copy_back(x, buf)
        box[0] = src

    def _not_itself(self, what: str, peer: int) -> None:
        if peer == self.rank:
            raise ValueError(f"{what} of a CUDA array to or from this rank itself: a lone ncclSend/ncclRecv to "
                             f"itself never completes; copy the array on the device instead")

    def _group(self, issue) -> None:
        """Run ``issue()`` (NCCL calls) between ``ncclGroupStart`` and ``ncclGroupEnd``; settle the group."""
        lib = self._lib
        try:
            lib.group_start()
            try:
                issue()
            finally:
                status = lib.group_end()
        except NcclError:
            self._after_error("ncclGroupEnd")
            raise
        if status != _libnccl.ncclSuccess:
            self._settle("ncclGroupEnd")

"""The MPI transport's hot path: for a (collective, op, dtype, size) key, a closure made once that calls
the lane's bound mpi4py method directly (the Communicator's 8-byte latency path), made from the
operation's row (:meth:`~collectives._backends.mpi.ops.Operation.bind`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._dtypes import divide, wire_op
from ..base import HostTransport
from .library import DEFAULT_MAX_COUNT
from .ops import OPERATIONS
from .requests import _MPIRequest


class HotPath(HostTransport):
    """The part of :class:`~collectives._backends.mpi.transport.MPITransport` that makes the hot path's
    closures (the state is the transport's, set in its ``__init__``)."""

    MPI: Any
    _lanes: dict
    _types: dict
    _ops: dict
    _in_place: Any
    _max_count: int
    _large_counts: bool
    _shm_threshold: int
    _shm_allreduce: Any
    _at_start: Any
    _fingerprint_beside: Any
    failed: Any

    def _bind(self, name: str, dtype: np.dtype, op: str | None, at: float | None, slow):
        """The row ``name``'s hot-path closure on its lane (made now if it is not: collective, as the
        general path's first call of the kind), for ``dtype`` and ``op`` (:meth:`Operation.bind`)."""
        row = OPERATIONS[name]
        method = row.method(self._lanes[row.lane])
        datatype = self._types[dtype] if row.reduces else self.MPI.BYTE
        return row.bind(method, datatype, None if op is None else self._ops[op], self._in_place, at, slow)

    def fast_call(self, op: str, dtype: np.dtype, size: int):
        """A direct call for contiguous writable NumPy arrays of ``dtype`` (the Communicator's hot path),
        or None when this pair needs the general path (widening, chunking). ``op`` "broadcast" means
        broadcast; the returned callable then takes ``(x, root)``."""
        max_count = self._max_count
        if op == "broadcast":
            if max_count < DEFAULT_MAX_COUNT:  # the user asked for pieces: honour it on every call
                return self._bind("broadcast", dtype, None, max_count + 1, self.broadcast)
            if self._typed_from_buffer(dtype) and self._large_counts:
                row = OPERATIONS["broadcast"]  # the MPI call itself: no Python in between (mpi4py types it
                return row.method(self._lanes[row.lane])  # from the buffer)
            if not self._large_counts:  # counts past 2**31-1 in pieces (Open MPI 5.0 refuses them: MPI_ERR_ARG)
                return self._bind("broadcast", dtype, None, DEFAULT_MAX_COUNT + 1, self.broadcast)
            bcast = self._bind("broadcast", dtype, None, None, None)

            def run_bcast_any_size(x, root):  # no size test: mpi4py moves a count past 2**31-1 in one
                try:                          # call (MPI-4 large-count routines, or its own fallback)...
                    bcast(x, root)
                except OverflowError:  # ...or, an older mpi4py, refuses it before any communication
                    self.broadcast(x, root)

            return run_bcast_any_size
        if not self._direct(op, dtype):
            return None
        if op == "mean":
            shm_at, n = self._shm_threshold, float(size)
            summed = self._bind("allreduce", dtype, "sum", (max_count + 1) * dtype.itemsize,
                                lambda x: self.allreduce(x, "sum"))

            def run_mean(x):
                if x.nbytes >= shm_at and self._shm_allreduce(x, "mean"):
                    return  # summed and divided in shared memory
                summed(x)
                divide(x, n)

            return run_mean
        slow_at = min(self._shm_threshold, (max_count + 1) * dtype.itemsize)  # past max_count, or shared memory
        return self._bind("allreduce", dtype, op, slow_at, lambda x: self.allreduce(x, op))

    def fast_start(self, op: str, dtype: np.dtype):
        """The non-blocking allreduce's start (``MPITransport.start`` of ``"allreduce"``: ``Iallreduce`` in
        place on its lane, the fingerprint beside it) bound once for ``dtype`` and the wire op ``op``: the
        same request, without the row's dispatch per call. Any call the bound start does not take (a
        failed transport, a count past ``COLLECTIVES_MAX_COUNT``, the shared-memory allreduce at the call)
        goes to ``start`` itself. None until the lane is made (the general path's first call makes it)."""
        row = OPERATIONS["allreduce"]
        if row.lane not in self._lanes or dtype not in self._types or op not in self._ops:
            return None
        istart = row.method(self._lanes[row.lane], False)
        datatype, mop, in_place, max_count = self._types[dtype], self._ops[op], self._in_place, self._max_count
        general, beside, request = self.start, self._fingerprint_beside, _MPIRequest

        def start(buf):
            if self.failed is not None or self._at_start is not None or buf.size > max_count:
                return general("allreduce", buf, op)
            check = beside("allreduce", buf, op)
            return request(self, istart(in_place, [buf, datatype], mop), ("allreduce", (buf, op)), check)

        return start

    def _direct(self, op: str, dtype: np.dtype) -> bool:
        """Whether :meth:`fast_call` has a direct call for ``op`` (not "broadcast": it always has) on ``dtype``,
        asking makes no lane. Not for a pair this MPI cannot reduce or reduces wrongly (widened instead), a
        mean of a non-float, nor floats' min and max (the NaN-propagating mapping, _reduction.to_ordered)."""
        if dtype not in self._types or not self.reduces(dtype, wire_op(op)):
            return False
        return dtype.kind in "fc" if op == "mean" else not (op in ("min", "max") and dtype.kind == "f")

    def fast_blocks(self, operation, op, dtype, size):
        """MPI's own ``Reduce_scatter_block`` / ``Alltoall`` / ``Allgather`` on the whole buffers, the
        piecewise method past the count one MPI call takes (``_blocks``, ``allgather``'s broadcasts)."""
        max_count = self._max_count
        if operation == "alltoall":
            return self._bind("alltoall", dtype, None, max_count * size + 1, self.alltoall)
        if operation == "allgather":  # its pieces (past max_count bytes a rank) take the (size, n) layout
            return self._bind("allgather", dtype, None, max_count + 1,
                              lambda send, recv: self.allgather(send, recv.reshape(size, -1)))
        if dtype not in self._types or op not in self._ops or not self.reduces(dtype, op):
            return None
        return self._bind("reduce_scatter", dtype, op, (max_count + 1) * dtype.itemsize,
                          lambda send, recv: self.reduce_scatter(send, recv, op))

    def fast_reduce(self, op: str, dtype: np.dtype):
        """MPI's own ``Reduce`` on the whole buffer (in place at the root), the pieces of :meth:`reduce`
        past the count one MPI call takes; None where :meth:`_direct` has no direct call or for ``mean``
        (the general rules divide at the root)."""
        if op == "mean" or not self._direct(op, dtype):
            return None
        row = OPERATIONS["reduce"]
        return row.bind(row.method(self._lanes[row.lane]), self._types[dtype], self._ops[op], self._in_place,
                        (self._max_count + 1) * dtype.itemsize, lambda x, root: self.reduce(x, op, root),
                        rank=self.rank)

    def _typed_from_buffer(self, dtype: np.dtype) -> bool:
        """Whether ``comm.Bcast(x, root)`` on a bare array of ``dtype`` is right at any size: mpi4py 4 or
        later (counts past 2**31-1 in one call) and a buffer format it maps to an MPI type of the same
        size. Then the broadcast hot path is the MPI call itself."""
        import mpi4py

        if int(mpi4py.__version__.split(".")[0]) < 4 or not dtype.isnative or dtype.kind not in "biufc":
            return False
        try:
            datatype = self.MPI.Datatype.fromcode(np.empty(1, dtype).data.format)
            return datatype != self.MPI.DATATYPE_NULL and datatype.Get_size() == dtype.itemsize
        except Exception:  # noqa: BLE001 - a format mpi4py does not know: the closure below then
            return False

"""The MPI transport (mpi4py), for host memory.

The library never talks on the user's communicator: it works on its own duplicate. MPI is initialised
here only if nobody did it before, at the thread level chosen in ``COLLECTIVES_MPI_THREAD_LEVEL``.
"""

from __future__ import annotations

import sys

import numpy as np

from .. import _config
from .._errors import BackendUnavailableError
from .base import Transport


def import_mpi():
    """Import mpi4py.MPI, choosing the thread level if MPI is not initialised yet."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.thread_level = _config.mpi_thread_level()
    from mpi4py import MPI

    return MPI


_OPS_CACHE: dict = {}
_TYPES_CACHE: dict = {}


def _tables(MPI):
    if not _OPS_CACHE:
        _OPS_CACHE.update(sum=MPI.SUM, prod=MPI.PROD, min=MPI.MIN, max=MPI.MAX)
        pairs = {
            np.int8: MPI.INT8_T, np.uint8: MPI.UINT8_T, np.int16: MPI.INT16_T, np.uint16: MPI.UINT16_T,
            np.int32: MPI.INT32_T, np.uint32: MPI.UINT32_T, np.int64: MPI.INT64_T, np.uint64: MPI.UINT64_T,
            np.float32: MPI.FLOAT, np.float64: MPI.DOUBLE, np.longdouble: MPI.LONG_DOUBLE,
            np.complex64: MPI.C_FLOAT_COMPLEX, np.complex128: MPI.C_DOUBLE_COMPLEX,
            np.clongdouble: MPI.C_LONG_DOUBLE_COMPLEX, np.bool_: MPI.UINT8_T,
        }
        f16 = getattr(MPI, "FLOAT16_T", MPI.DATATYPE_NULL)
        if f16 != MPI.DATATYPE_NULL and _reduces_locally(MPI, f16):
            pairs[np.float16] = f16
        for k, v in pairs.items():
            if v != MPI.DATATYPE_NULL:
                _TYPES_CACHE[np.dtype(k)] = v
    return _OPS_CACHE, _TYPES_CACHE


def _reduces_locally(MPI, datatype) -> bool:
    """Detect (not assume) that this MPI library can reduce float16: try it locally."""
    a = np.array([1.0, 2.0], dtype=np.float16)
    b = np.array([3.0, 4.0], dtype=np.float16)
    try:
        for op in (MPI.SUM, MPI.PROD, MPI.MAX, MPI.MIN):
            c = b.copy()
            op.Reduce_local([a, datatype], [c, datatype])
    except Exception:
        return False
    return True


class MPITransport(Transport):
    name = "mpi"

    def __init__(self, comm=None):
        try:
            MPI = import_mpi()
        except Exception as exc:  # ImportError, or a RuntimeError from a broken libmpi
            raise BackendUnavailableError(f"MPI is not usable: {exc}") from exc
        self.MPI = MPI
        base = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(base, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py intra-communicator, got {type(base).__name__}")
        self.comm = base.Dup()  # never talk on the user's communicator
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = node.Get_rank()
        self.local_size = node.Get_size()
        node.Free()
        self._ops, self._types = _tables(MPI)
        self._float16 = np.dtype(np.float16) in self._types
        self._max_count = _config.max_count()
        self._in_place = MPI.IN_PLACE

    # ---- data ----
    def fast_call(self, op: str, dtype: np.dtype, size: int):
        """A direct call for contiguous writable NumPy arrays of ``dtype`` (the Communicator's hot path),
        or None when this pair needs the general path (widening, chunking). ``op`` "broadcast" means
        broadcast; the returned callable then takes ``(x, root)``."""
        comm, in_place, max_count = self.comm, self._in_place, self._max_count
        if op == "broadcast":
            bcast, byte = comm.Bcast, self.MPI.BYTE

            def run_bcast(x, root):
                if x.nbytes > max_count:
                    return self.broadcast(x, root)
                bcast([x, byte], root)

            return run_bcast
        datatype = self._types.get(dtype)
        if datatype is None or (dtype == np.float16 and not self._float16):
            return None
        allreduce = comm.Allreduce
        if op == "mean":
            if dtype.kind not in "fc":
                return None
            mop, n = self._ops["sum"], float(size)

            def run_mean(x):
                if x.size > max_count:
                    self.allreduce(x, "sum")
                else:
                    allreduce(in_place, [x, datatype], mop)
                np.divide(x, n, out=x)

            return run_mean
        mop = self._ops[op]

        def run(x):
            if x.size > max_count:
                return self.allreduce(x, op)
            allreduce(in_place, [x, datatype], mop)

        return run

    def _chunks(self, buf: np.ndarray, datatype_size: int = 1):
        """Yield 1-d pieces of ``buf`` no longer than the largest count one MPI call takes."""
        flat = buf.reshape(-1)
        n = flat.shape[0]
        step = self._max_count
        if n <= step:
            yield flat
            return
        for lo in range(0, n, step):
            yield flat[lo:lo + step]

    def allreduce(self, buf, op):
        datatype = self._types[buf.dtype]
        mop = self._ops[op]
        for piece in self._chunks(buf):
            self.comm.Allreduce(self._in_place, [piece, datatype], mop)

    def reduce(self, buf, op, root):
        datatype = self._types[buf.dtype]
        mop = self._ops[op]
        root_rank = self.rank == root
        for piece in self._chunks(buf):
            if root_rank:
                self.comm.Reduce(self._in_place, [piece, datatype], mop, root)
            else:
                self.comm.Reduce([piece, datatype], None, mop, root)

    def broadcast(self, buf, root):
        raw = buf.reshape(-1).view(np.uint8)
        for piece in self._chunks(raw):
            self.comm.Bcast([piece, self.MPI.BYTE], root)

    def allgather(self, send, recv):
        nbytes = send.nbytes
        if nbytes <= self._max_count:
            self.comm.Allgather([send.reshape(-1).view(np.uint8), self.MPI.BYTE],
                                [recv.reshape(-1).view(np.uint8), self.MPI.BYTE])
            return
        # Past the count limit: every rank broadcasts its part, chunk by chunk, into its row.
        for r in range(self.size):
            row = recv[r]
            if r == self.rank:
                row[...] = send.reshape(-1)
            self.broadcast(row, r)

    def allgather_object(self, obj):
        return self.comm.allgather(obj)

    def broadcast_object(self, obj, root):
        return self.comm.bcast(obj, root)

    def barrier(self):
        self.comm.Barrier()

    def close(self):
        comm, self.comm = getattr(self, "comm", None), None
        if comm is not None and not self.MPI.Is_finalized():
            comm.Free()

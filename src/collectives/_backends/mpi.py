"""The MPI transport (mpi4py), for host memory.

The library never talks on the user's communicator: it works on its own duplicate. MPI is initialised
here only if nobody did it before, at the thread level chosen in ``COLLECTIVES_MPI_THREAD_LEVEL``.

With ``COLLECTIVES_TIMEOUT`` set (read once, when the transport is made), the factory
(``factory.host_transport``) makes a :class:`DeadlineMPITransport` instead: the same operations through
MPI's non-blocking collectives, polled until they complete or the deadline passes (then
:class:`CollectiveTimeoutError`). Without it the plain blocking calls run and nothing is added per call.
"""

from __future__ import annotations

import heapq
import os
import pickle
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _config, _trace
from .. import _call
from .._dtypes import divide, wire_op
from .._errors import BackendUnavailableError, CollectiveError, CollectiveTimeoutError, MismatchError
from .._poll import poll
from . import shm  # large allreduces through a node-shared window (made at first use), issue 7
from .._p2p import HEADER_WORDS, p2p_fields, p2p_header, p2p_mismatch
from .base import DONE, P2P_OPERATIONS, HostTransport, Request
from ._fingerprint import EAGER_LANES, FIELDS, LANE_CODE as _LANE_CODE, LANES, NO_CALLER as _NO_CALLER
from ._fingerprint import describe as _describe, fingerprint_message as _fingerprint_message
from ._fingerprint import making_what as _making_what, wire_fields as _wire_fields


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))



def import_mpi():
    """Import mpi4py.MPI, choosing the thread level if MPI is not initialised yet."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        try:
            mpi4py.rc.thread_level = _config.mpi_thread_level()
        except ValueError:  # malformed: refused on every rank once MPI is up (MPITransport.__init__)
            pass
    from mpi4py import MPI

    return MPI


DEFAULT_MAX_COUNT = 2**31 - 1  # COLLECTIVES_MAX_COUNT's default: what an MPI int count holds
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


# The pairs :func:`faulty_ops` checks: every integer dtype and float16 with sum and prod (the ops that can
# overflow or round), and the integers with min and max too. Float min/max never reach MPI as floats (they
# travel as ordered integers, _dtypes.float_to_ordered); bool travels as uint8 0/1, which cannot overflow.
PROBED_OPS = tuple((np.dtype(t), op) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
                                               np.int64, np.uint64) for op in ("sum", "prod", "min", "max")
                   ) + ((np.dtype(np.float16), "sum"), (np.dtype(np.float16), "prod"))
PROBE_COUNT = 1031  # elements: many vector widths (AVX-512 holds 64 int8) and a ragged tail
_NUMPY_OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
_warned: set = set()  # process-wide: the MPI library is


def _probe_values(dtype: np.dtype, salt: int) -> np.ndarray:
    """PROBE_COUNT values of ``dtype`` spread over its whole range (integers wrap into it), so that sums
    and products overflow in both directions; finite and exactly representable for float16."""
    k = np.arange(PROBE_COUNT, dtype=np.int64)
    if dtype.kind == "f":
        return ((k * (37 + salt)) % 4001 / 16.0 - 125.0).astype(dtype)
    return (k * (7919 + 104_722 * salt) + 12_345 * (salt + 1)).astype(dtype)  # astype wraps


def faulty_ops(MPI, ops: dict, types: dict) -> list:
    """The ``(dtype, op)`` pairs of :data:`PROBED_OPS` that this MPI library reduces differently from
    NumPy, found (not assumed) with ``MPI_Reduce_local`` on a probe of :data:`PROBE_COUNT` overflowing
    values per pair. Local: no communication.

    An MPI may not wrap integers: Open MPI 5.0's AVX op component saturates int8/uint8/int16/uint16 sums
    past a vector width (``np.full(100, 100, np.int8)`` summed over 2 ranks gives 127, NumPy gives -56).
    The op component an allreduce uses is the one ``MPI_Reduce_local`` uses, so one local call per pair
    tells. A pair that fails is reduced in a wider dtype instead (:meth:`MPITransport.reduces`).
    """
    bad = []
    for dtype, op in PROBED_OPS:
        datatype = types.get(dtype)
        if datatype is None:
            continue
        a, b = _probe_values(dtype, 0), _probe_values(dtype, 1)
        with np.errstate(all="ignore"):
            want = _NUMPY_OPS[op](a, b)
        got = b.copy()
        try:
            ops[op].Reduce_local([a, datatype], [got, datatype])
        except Exception:  # noqa: BLE001 - an MPI that cannot reduce the pair at all fails the probe too
            bad.append((dtype, op))
            continue
        if not np.array_equal(got, want):
            bad.append((dtype, op))
    return bad


def _warn_faulty(MPI, bad: list) -> None:
    """Say once per process, on the rank that calls it, which pairs the MPI gets wrong and what to do."""
    pairs = ", ".join(f"{op} of {dtype.name}" for dtype, op in bad)
    if not pairs or pairs in _warned:
        return
    _warned.add(pairs)
    library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split(",")[0].split())
    fix = ("Open MPI's AVX op component does this: run with `mpiexec --mca op ^avx` (or set "
           "OMPI_MCA_op=^avx) to use its plain, wrapping ops. " if "Open MPI" in library else "")
    widest = [f"{op} of {dtype.name}" for dtype, op in bad if dtype.itemsize == 8]
    caveat = (f"There is no wider type for {', '.join(widest)}: those results may be wrong. " if widest else "")
    warnings.warn(
        f"collectives: this MPI ({library}) gets {pairs} wrong (checked with MPI_Reduce_local: its result "
        f"differs from NumPy's wrapping arithmetic). collectives reduces these pairs in 64-bit integers "
        f"(float32 for float16) instead: the same bits, more bytes on the wire. {caveat}{fix}"
        f"To silence this warning, filter RuntimeWarning messages starting with 'collectives: this MPI'.",
        RuntimeWarning, stacklevel=4)


def _agreed_settings(comm, local_size: int, faulty: Sequence = ()) -> tuple[int, bool, frozenset, bool]:
    """What every rank must share, agreed in one allreduce when the MPI transport is made (collective):
    ``(shared-memory threshold in bytes, or shm.NEVER when the path is off; whether synchronize may use the
    point-to-point pipeline; the (dtype, op) pairs of PROBED_OPS that some rank's MPI reduces wrongly;
    whether floating reductions are checked for NaN/inf, COLLECTIVES_CHECK_NAN)``.

    A pair any rank's probe failed (:func:`faulty_ops`) is faulty on every rank: the dtype a buffer travels
    in must be the same everywhere.

    Every rank must take the same path for the same call. The shared-memory allreduce is off if any rank
    has ``COLLECTIVES_SHM=0`` or if no node holds more than one rank (nothing to share), else it starts at
    the largest threshold any rank asked for; the pipeline of ``synchronize`` is off if any rank has
    ``COLLECTIVES_SYNC_PIPELINE=0``; the NaN check is on if any rank has ``COLLECTIVES_CHECK_NAN=1`` (it is
    one more collective before each checked call: every rank must make it).
    """
    from mpi4py import MPI

    flags = [1 if pair in faulty else 0 for pair in PROBED_OPS]
    mine = np.array([0 if _config.shm() else 1, _config.shm_threshold(), local_size,
                     0 if _config.sync_pipeline() else 1, 1 if _config.check_nan() else 0, *flags], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, mine, MPI.MAX)
    disabled, threshold, max_local, no_pipeline, check_nan = (int(v) for v in mine[:5])
    agreed = frozenset(pair for pair, flag in zip(PROBED_OPS, mine[5:]) if flag)
    return (shm.NEVER if disabled or max_local < 2 else threshold), not no_pipeline, agreed, bool(check_nan)


def _reduces_locally(MPI, datatype) -> bool:
    """Detect (not assume) that this MPI library can reduce float16: try it locally."""
    a = np.array([1.0, 2.0], dtype=np.float16)
    b = np.array([3.0, 4.0], dtype=np.float16)
    try:
        for op in (MPI.SUM, MPI.PROD, MPI.MAX, MPI.MIN):
            c = b.copy()
            op.Reduce_local([a, datatype], [c, datatype])
    except Exception:  # noqa: BLE001 - any failure means "cannot": the caller then widens to float32
        return False
    return True


class _Lanes(dict):
    """A transport's lanes (MPI communicators) by name, each kind's made at its first use.

    Making a lane (``MPI_Comm_dup``) is collective, and MPI matches the duplications of one communicator
    by their order alone: if one rank made its allreduce lane at the same time as another made its barrier
    lane, the two would be one communicator, and the two collectives would meet on it (what the lanes
    exist to prevent). A program whose ranks make the same calls in the same order reaches the first use of
    a kind at the same call on every rank; so that a program whose ranks do not is caught there, every
    rank first reduces a fingerprint of the lane it is about to make on the fingerprint lane, in the order
    of the calls, as the non-blocking calls reduce theirs (``MPITransport._begin_making``): a rank making
    another lane, or calling a collective whose lane it has, meets it there, and every rank raises
    :class:`MismatchError` before anything is duplicated."""

    __slots__ = ("_make",)

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, name):
        lane = self[name] = self._make(name)
        return lane


class MPITransport(HostTransport):
    name = "mpi"
    fingerprints = True  # reduce a fingerprint beside every non-blocking call (_begin); off only in benchmarks
    timeout: float | None = None  # seconds; set only on a DeadlineMPITransport
    timeout_setting = "COLLECTIVES_TIMEOUT"  # what set the bound (named when it expires)

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
        try:  # a malformed variable on any rank: every rank refuses here, before anything else talks
            _config.refuse_malformed(self.comm.allgather)
        except ValueError:
            self.comm.Free()
            self.comm = None
            raise
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        per_node = _config.simulate_nodes()  # COLLECTIVES_SIMULATE_NODES: smaller "nodes" in the real ones
        self._node_color = None if per_node is None else self.rank // per_node
        node = shm.node_communicator(self.comm, self._node_color)
        self.local_rank = node.Get_rank()
        self.local_size = node.Get_size()
        node.Free()
        self._ops, self._types = _tables(MPI)
        self._float16 = np.dtype(np.float16) in self._types
        self._max_count = _config.max_count()
        # one call past 2**31-1 elements (MPI-4 large counts through mpi4py): measured to work on MPICH;
        # Open MPI 5.0 refuses it with MPI_ERR_ARG, so elsewhere such broadcasts go in pieces
        self._large_counts = "MPICH" in MPI.Get_library_version()
        self._in_place = MPI.IN_PLACE
        self._shm = None
        group, world = self.comm.Get_group(), MPI.COMM_WORLD.Get_group()
        try:  # this communicator's ranks as ranks of COMM_WORLD (for the flight recorder's dumps); local
            self.world_ranks = [int(r) for r in MPI.Group.Translate_ranks(group, list(range(self.size)), world)]
        finally:
            group.Free()
            world.Free()
        faulty = faulty_ops(MPI, self._ops, self._types)  # per transport: local, 1-2 ms (42 small reductions)
        (self._shm_threshold, self._pipeline, self._faulty,
         self.check_nan) = _agreed_settings(self.comm, self.local_size, faulty)
        if self._faulty and self.rank == 0:
            _warn_faulty(MPI, sorted(self._faulty, key=PROBED_OPS.index))
        # One MPI communicator per kind of collective (a "lane"), so that MPI can never match one collective
        # with another (an allreduce on one rank with a barrier or an allgather on another: MPI leaves that
        # undefined, and MPICH matches non-blocking collectives by their order alone); self.comm carries the
        # agreement protocol and the library's own metadata. A kind's lane is made at its first use, agreed
        # first (_Lanes); the fingerprint and point-to-point lanes here.
        self._lanes: dict = _Lanes(self._make_lane)  # closing empties it (a plain dict: no lane made again)
        self._making: dict[str, _Making] = {}  # lane name -> its making, begun by a non-blocking call
        for name in EAGER_LANES:
            self._lanes[name] = self.comm.Dup()
        self._fingerprints: dict = {}  # call key -> (fields and negations, their bytes), see _fingerprint
        self._max_op = MPI.MAX
        self._pipe_ring = None  # broadcast_many's pack buffers (root only, made at first use)
        self._pipe_plans: dict = {}  # (lengths, message size) -> messages
        self._pipe_typesets: dict = {}  # (addresses, plan key) -> (datatypes, spares), least recently used first
        tag_ub = self.comm.Get_attr(MPI.TAG_UB)
        self.max_tag = int(tag_ub) if tag_ub else 32767  # MPI guarantees at least 32767
        self._p2p_seq: dict = {}  # destination rank -> the tag of the next message's data (see send)
        self._receives: list = []  # started receives whose header has not arrived yet (see _progress)
        self._to_itself: dict = {}  # tag -> messages this rank sent itself not yet received (_from_itself)

    def reduces(self, dtype: np.dtype, op: str) -> bool:
        """True if this MPI reduces ``dtype`` with ``op`` right: not a pair :func:`faulty_ops` caught on
        some rank (those are widened to 64-bit integers, float16 to float32, by the caller)."""
        return super().reduces(dtype, op) and (dtype, op) not in self._faulty

    _faulty: frozenset = frozenset()
    _receives: list | tuple = ()  # (a list of its own from __init__)

    def reduces_on_the_callers_cpus(self) -> bool:
        """Every rank on one node: an allreduce of any size is computed by the ranks themselves, in the
        node-shared window (``shm``) from the shared-memory threshold and by MPI's own shared-memory
        transport below it, which moves a non-blocking one only inside the ranks' MPI calls."""
        return 1 < self.size == self.local_size

    # ---- data ----
    def fast_call(self, op: str, dtype: np.dtype, size: int):
        """A direct call for contiguous writable NumPy arrays of ``dtype`` (the Communicator's hot path),
        or None when this pair needs the general path (widening, chunking). ``op`` "broadcast" means
        broadcast; the returned callable then takes ``(x, root)``."""
        in_place, max_count = self._in_place, self._max_count
        if op == "broadcast":
            bcast, byte = self._lanes["broadcast"].Bcast, self.MPI.BYTE
            if max_count < DEFAULT_MAX_COUNT:  # the user asked for pieces: honour it on every call

                def run_bcast(x, root):
                    if x.nbytes > max_count:
                        return self.broadcast(x, root)
                    bcast([x, byte], root)

                return run_bcast

            if self._typed_from_buffer(dtype) and self._large_counts:
                return bcast  # the MPI call itself: no Python in between (mpi4py types it from the buffer)
            if not self._large_counts:  # counts past 2**31-1 in pieces (Open MPI 5.0 refuses them: MPI_ERR_ARG)

                def run_bcast_pieces(x, root):
                    if x.nbytes > DEFAULT_MAX_COUNT:
                        return self.broadcast(x, root)
                    bcast([x, byte], root)

                return run_bcast_pieces

            def run_bcast_any_size(x, root):  # no size test: mpi4py moves a count past 2**31-1 in one
                try:                          # call (MPI-4 large-count routines, or its own fallback)...
                    bcast([x, byte], root)
                except OverflowError:  # ...or, an older mpi4py, refuses it before any communication
                    self.broadcast(x, root)

            return run_bcast_any_size
        if not self._direct(op, dtype):
            return None
        datatype = self._types[dtype]
        allreduce, shm_at = self._lanes["allreduce"].Allreduce, self._shm_threshold
        if op == "mean":
            mop, n = self._ops["sum"], float(size)

            def run_mean(x):
                if x.nbytes >= shm_at and self._shm_allreduce(x, "mean"):
                    return  # summed and divided in shared memory
                if x.size > max_count:
                    self.allreduce(x, "sum")
                else:
                    allreduce(in_place, [x, datatype], mop)
                divide(x, n)

            return run_mean
        mop = self._ops[op]
        slow_at = min(shm_at, (max_count + 1) * dtype.itemsize)  # x.size > max_count, or shared memory

        def run(x):
            if x.nbytes >= slow_at:
                return self.allreduce(x, op)
            allreduce(in_place, [x, datatype], mop)

        return run

    def _direct(self, op: str, dtype: np.dtype) -> bool:
        """Whether :meth:`fast_call` has a direct call for ``op`` (not "broadcast": it always has) on ``dtype``,
        asking makes no lane. Not for a pair this MPI cannot reduce or reduces wrongly (widened instead), a
        mean of a non-float, nor floats' min and max (the NaN-propagating mapping, _reduction.to_ordered)."""
        if dtype not in self._types or not self.reduces(dtype, wire_op(op)):
            return False
        return dtype.kind in "fc" if op == "mean" else not (op in ("min", "max") and dtype.kind == "f")

    def fast_blocks(self, operation, op, dtype, size):
        """MPI's own ``Reduce_scatter_block`` / ``Alltoall`` on the whole buffers, the piecewise method
        past the count one MPI call takes (``_blocks``)."""
        max_count = self._max_count
        if operation == "alltoall":
            alltoall, byte = self._lanes["alltoall"].Alltoall, self.MPI.BYTE

            def run_alltoall(send, recv):
                if send.nbytes > max_count * size:
                    return self.alltoall(send, recv)
                alltoall([send, byte], [recv, byte])

            return run_alltoall
        datatype = self._types.get(dtype)
        if datatype is None or op not in self._ops or not self.reduces(dtype, op):
            return None
        scatter, mop = self._lanes["reduce_scatter"].Reduce_scatter_block, self._ops[op]

        def run_scatter(send, recv):
            if recv.size > max_count:
                return self.reduce_scatter(send, recv, op)
            scatter([send, datatype], [recv, datatype], mop)

        return run_scatter

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
        if buf.nbytes >= self._shm_threshold and self._shm_allreduce(buf, op):
            return
        datatype = self._types[buf.dtype]
        mop = self._ops[op]
        if buf.size <= self._max_count:  # one piece (the usual case: no generator)
            self._allreduce_piece(buf.reshape(-1), datatype, mop, op)
            return
        for piece in self._chunks(buf):
            self._allreduce_piece(piece, datatype, mop, op)

    def _shm_allreduce(self, buf, op, wait=None) -> bool:
        """Reduce ``buf`` through node-shared memory (``op`` may also be "mean"); False if it cannot.
        ``wait``: how to complete each node barrier (shm.Reducer.allreduce; the deadline transport's)."""
        reducer = self._reducer(wait)
        if not reducer.supports(buf.dtype, op, bounded=wait is not None):
            return False
        reducer.allreduce(buf, op, wait)
        return True

    def _reducer(self, wait=None) -> shm.Reducer:
        """The node-shared window, made at first use: collective, and safe where every rank is in the same
        allreduce (``wait``: as in :meth:`_shm_allreduce`)."""
        if self._shm is None:
            if wait is not None and "allreduce" not in self._lanes:  # its making bounded as this call is
                self._make_lane("allreduce", lambda what, req: wait(req))
            lane = self._lanes["allreduce"]  # made on the allreduce lane: only an allreduce can meet it
            if wait is not None:  # every rank has arrived (within the deadline) before the blocking setup
                wait(lane.Ibarrier())
            self._shm = shm.Reducer(lane, slot_bytes=_config.shm_slot_bytes(), types=self._types,
                                    node_color=self._node_color, ops=self._ops, reduces=self.reduces)
        return self._shm

    def allreduce_fused(self, bufs, op) -> bool:
        """On one node, buffers that each go through the node-shared window (every one from the threshold
        up): one pass of the window for all (``shm.Reducer.allreduce_many``: the same bits, the barriers
        of one message)."""
        if not self._fusing(bufs, op):
            return False
        reducer = self._reducer()
        if not reducer.supports(bufs[0].dtype, op, bounded=True):
            return False  # (the same answer on every rank)
        reducer.allreduce_many(bufs, op)
        return True

    def _fusing(self, bufs, op) -> bool:
        if len(bufs) < 2 or not self.reduces_on_the_callers_cpus():
            return False
        threshold, dtype = self._shm_threshold, bufs[0].dtype
        if any(b.nbytes < threshold or b.dtype != dtype for b in bufs):
            return False
        return self._shm is None or self._shm.supports(dtype, op, bounded=True)

    def reduce(self, buf, op, root):
        datatype = self._types[buf.dtype]
        mop = self._ops[op]
        for piece in self._chunks(buf):
            self._reduce_piece(piece, datatype, mop, op, root)

    def broadcast(self, buf, root):
        raw = buf.reshape(-1).view(np.uint8)
        for piece in self._chunks(raw):
            self._broadcast_piece(piece, root)

    # ---- each MPI call, once blocking (here) and once non-blocking (the _i<operation> starts below) ----
    def _allreduce_piece(self, piece, datatype, mop, op) -> None:
        self._lanes["allreduce"].Allreduce(self._in_place, [piece, datatype], mop)

    def _reduce_piece(self, piece, datatype, mop, op, root) -> None:
        if self.rank == root:
            self._lanes["reduce"].Reduce(self._in_place, [piece, datatype], mop, root)
        else:
            self._lanes["reduce"].Reduce([piece, datatype], None, mop, root)

    def _broadcast_piece(self, piece, root) -> None:
        self._lanes["broadcast"].Bcast([piece, self.MPI.BYTE], root)

    # ---- non-blocking starts (async_op=True; every operation of the deadline transport) ----
    def start(self, operation, *args):
        """Begin ``operation`` as MPI's non-blocking collective (``Iallreduce``, ``Ireduce``, ``Ibcast``,
        ``Iallgather``, ``Igather``, ``Ireduce_scatter_block``, ``Ialltoall``, ``Ibarrier``) with its fingerprint beside
        it (:meth:`_begin`), and return its request. Never the shared-memory allreduce (synchronous by
        design: it would finish here, with nothing to overlap; see docs/semantics.md). Counts past the limit
        of one MPI call run blocking now (a completed request): the piecewise loops need each piece's result
        before the next. ``send`` and ``recv`` start their point-to-point messages (no fingerprint: only two
        ranks take part)."""
        self.usable()
        if operation in P2P_OPERATIONS:
            return self._start_send(*args) if operation == "send" else _Receive(self, *args)
        if self._at_start is not None and operation == "allreduce" and self._allreduce_at_start(*args):
            return DONE
        if not self._fits(operation, *args):
            getattr(self, operation)(*args)
            return DONE
        return self._begin(operation, *args)

    _at_start: tuple | None = None  # (seconds or None, the bound's name): see allreduce_at_start

    def allreduce_at_start(self, seconds: float | None, setting: str) -> None:
        """From now on, an asynchronous allreduce that the ranks' own CPUs compute (every rank on one node,
        from the shared-memory threshold: :meth:`reduces_on_the_callers_cpus`) runs through the node-shared
        window at the call, its request complete when it returns, each of its waits for the other ranks
        bounded by ``seconds`` or ``COLLECTIVES_TIMEOUT``, the smaller (None: unbounded; ``setting`` names
        the bound in the timeout's message).
        The torch backend's groups ask for it: torch's callers wait for every Work (DDP at once, through
        ``get_future``), and MPI's ``Iallreduce`` moves large messages at a fraction of the window's speed.
        Collective in effect: every rank of the transport must ask alike (the group's creation does)."""
        variable = _config.timeout()  # read here, once (as the torch backend's group reads it for its Works)
        if variable is not None and (seconds is None or variable < seconds):
            seconds, setting = variable, "COLLECTIVES_TIMEOUT"
        self._at_start = (seconds, setting)

    def _allreduce_at_start(self, buf, op) -> bool:
        return self._bounded_shm(buf, op, self._wait_at_start)

    def _wait_at_start(self, what, req) -> None:
        """A wait of :meth:`_allreduce_at_start`: bounded as :meth:`allreduce_at_start` was asked."""
        seconds, setting = self._at_start  # type: ignore[misc]  # set: only _allreduce_at_start waits here
        self._wait_within(what, req, seconds, setting)

    def _bounded_shm(self, buf, op, wait) -> bool:
        """On one node, from the shared-memory threshold: ``buf`` reduced through the shared window, each of
        its barriers an ``MPI_Ibarrier`` completed by ``wait(what, request)`` (the window is made after a
        rendezvous of every rank waited for the same way). False where that path does not apply. The
        fingerprint of the call is reduced first (a node barrier cannot tell an allreduce of 4 elements from
        one of 8)."""
        if buf.nbytes < self._shm_threshold or not self.reduces_on_the_callers_cpus():
            return False
        self.usable()
        what = ("allreduce", buf, f"op={op}, node-shared memory")
        if self._shm is not None and not self._shm.supports(buf.dtype, op, bounded=True):
            return False
        if self.size > 1:
            req, check = self._fingerprint("allreduce", buf, wire_op(op))
            wait(what, req)
            self._verify(check, what)
        return self._shm_allreduce(buf, op, lambda req: wait(what, req))

    SPIN_S = 0.25
    MAX_PAUSE_S = 1e-3

    def _wait_within(self, what, req, seconds: float | None, setting: str) -> None:
        """Wait for ``req`` until it completes or ``seconds`` from now have passed (then fail the transport
        and raise :class:`CollectiveTimeoutError`), polling as :func:`collectives._poll.poll` does."""
        test = self._progressing(req) if self._receives else req.Test
        if test():  # already complete (a small call often is): no clock read
            return
        t0 = time.monotonic()
        if not poll(test, seconds, spin_s=self.SPIN_S, max_pause_s=self.MAX_PAUSE_S):
            self.abandon(req)  # pending for good: it and its buffers live to the end of the process
            self._expire(what, time.monotonic() - t0, seconds, setting)

    def _expire(self, what, waited: float, seconds, setting: str = "COLLECTIVES_TIMEOUT"):
        """Declare the collective described by ``what`` (``(name, buffer, detail)``, or a function that
        makes it: :meth:`_MPIRequest._what`) hung after ``seconds`` (``setting``: the bound's name):
        record, print, raise."""
        name, buf, detail = what() if callable(what) else what
        desc = name
        if buf is not None:
            desc += f" of {buf.size} x {buf.dtype}"
        if detail:
            desc += f" ({detail})"
        where = f"rank {self.rank} of {self.size}"
        self.fail(f"{desc} timed out on {where}")
        msg = (f"{desc} did not complete on {where} within {setting}={seconds:g} s "
               f"(waited {waited:.1f} s): some rank never entered it (it failed, exited, is stuck, or "
               f"called a different collective). The job cannot continue; unless caught, this exception "
               f"aborts every rank. If the collective is legitimately slow, raise {setting}; "
               f"to find a divergent rank, run with COLLECTIVES_CHECK=1")
        try:
            sys.stderr.write(f"collectives: {self.failed} after {waited:.1f} s ({setting}={seconds:g})\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a closed stderr must not hide the timeout itself
            pass
        _trace.failure(f"CollectiveTimeoutError: {desc} did not complete on {where} within {seconds:g} s")
        raise CollectiveTimeoutError(msg)

    def _fits(self, operation, *args) -> bool:
        """Whether ``operation`` on these buffers is one MPI call (within ``COLLECTIVES_MAX_COUNT``), and
        one whose non-blocking form gives the blocking form's bits."""
        if not args:
            return True
        buf = args[0]
        if operation == "reduce":
            op = args[1]
            if op == "prod" and buf.dtype.kind == "c":
                return False  # complex products: MPICH's Ireduce multiplies in another order than Reduce, and
                # the sign of a zero part depends on that order (tests/mpi/test_paths.py); blocking instead
            return buf.size <= self._max_count
        if operation == "allreduce":
            return buf.size <= self._max_count
        if operation == "reduce_scatter":
            return args[1].size <= self._max_count
        if operation == "alltoall":
            return buf.nbytes // self.size <= self._max_count
        return buf.nbytes <= self._max_count  # broadcast, allgather, gather

    def _begin(self, operation, *args) -> Request:
        """Start one MPI call of ``operation`` and, before it, the reduction of its fingerprint
        (:meth:`_fingerprint`) on the fingerprint lane: when the call's request completes, every rank
        has learnt whether every rank made the same call, and raises :class:`MismatchError` if not."""
        if operation not in self._lanes:  # its first call: started once its lane is made (never blocks here)
            return _FirstCall(self, operation, args)
        check = self._fingerprint(operation, *args) if self.size > 1 and self.fingerprints else None
        return _MPIRequest(self, getattr(self, "_i" + operation)(*args), (operation, args), check)

    def _fingerprint(self, operation, *args):
        """Start the fingerprint of a call: ``(request, buffer)``. The fields (:data:`FIELDS`: the
        caller's call as the engine described it in ``self.caller``, then the MPI call's collective, element
        count, wire dtype, wire op and root) travel with their negations in one ``MPI_Iallreduce`` with
        ``MPI_MAX`` of 22 int64: every rank gets each field's largest and smallest value, so every rank
        knows alike whether the ranks agree, without a second step. It runs on a lane of its own, in the
        order of the calls: the fingerprints of ranks that called different collectives meet each other,
        so a different collective is a MismatchError too, not a hang."""
        caller = self.caller
        if args:
            buf, extra = args[0], args[1:]
            if extra and extra[0].__class__ is np.ndarray:  # a receive buffer: the send buffer says it all
                extra = extra[1:]
            key = (operation, buf.size, buf.dtype, caller) + extra
        else:
            key = (operation, caller)
        hit = self._fingerprints.get(key)
        if hit is None:
            v = np.zeros(2 * len(FIELDS), dtype=np.int64)
            v[:len(FIELDS)] = (caller or _NO_CALLER) + _wire_fields(operation, args)
            v[len(FIELDS):] = -v[:len(FIELDS)]
            hit = (v, v.tobytes())
            if len(self._fingerprints) < 4096:  # a few per (collective, count, dtype, op, root) in use
                self._fingerprints[key] = hit
        v = hit[0].copy()
        return self._lanes["fingerprint"].Iallreduce(self._in_place, v, self._max_op), (v, hit[1])

    def _make_lane(self, name: str, wait=None):
        """The lane ``name`` at its first use (``_Lanes``), made now: its making (:meth:`_begin_making`, or
        the one a non-blocking call began) completed with ``wait(what, request)`` (default: this transport's
        wait, under the deadline of a :class:`DeadlineMPITransport`)."""
        making = self._making.get(name) or self._begin_making(name)
        self._advance(making, wait or self._wait)
        return making.lane

    def _begin_making(self, name: str) -> _Making:
        """Begin making the lane ``name``: the fingerprint of its making reduced on the fingerprint lane (in
        the order of the calls: it meets whatever the other ranks reduce there now); ``_advance`` begins its
        duplicate. The lane is used only once the fingerprint shows every rank making it."""
        if name in EAGER_LANES or name not in LANES:
            raise KeyError(name)  # closed (its lanes are gone), or not a lane
        self.usable()
        check = None
        if self.size > 1:
            v = np.zeros(2 * len(FIELDS), dtype=np.int64)
            # the caller's call (as in _fingerprint: a mismatch names both calls), else the lane's collective
            caller = self.caller or (_call.COLLECTIVES.index(name) if name in _call.COLLECTIVES else -1,) + _NO_CALLER[1:]
            v[:len(FIELDS)] = caller + (_LANE_CODE + LANES.index(name), 0, 0, -1, -1)
            v[len(FIELDS):] = -v[:len(FIELDS)]
            mine = v.tobytes()
            check = (self._lanes["fingerprint"].Iallreduce(self._in_place, v, self._max_op), (v, mine))
        making = self._making[name] = _Making(name, check, _making_what(name, self.caller))
        return making

    def _advance(self, making: _Making, wait=None) -> bool:
        """Move the making of a lane on, those begun before it first: with ``wait`` until complete, else as far
        as it goes without blocking; True once complete. Each duplicate (``MPI_Comm_idup`` of the "lanes"
        communicator) is begun once the one before it is made, the same order on every rank (several in flight,
        waited in another order, hung Open MPI 5.0.11: test_async.py's many-outstanding test)."""
        for earlier in list(self._making.values()):
            if not self._advance_one(earlier, wait):
                return False
            if earlier is making:
                break
        return True

    def _advance_one(self, making: _Making, wait) -> bool:
        """:meth:`_advance` for one making. Complete: the fingerprint checked (MismatchError on every rank
        if the ranks are not all making this lane), the duplicate made, the lane in use, and the calls that
        waited for it started, in the order they were made."""
        what = making.what
        try:
            if making.check is not None:
                if wait is not None:
                    wait(what, making.check[0])
                elif not making.check[0].Test():
                    return False
                check, making.check = making.check, None
                self._verify(check[1], what)
            if making.dup is None:
                making.lane, making.dup = self._lanes["lanes"].Idup()
            if wait is not None:
                wait(what, making.dup)
            elif not making.dup.Test():
                return False
        except BaseException:
            self.abandon(making)  # pending for good (its duplicate, its fingerprint): MPI may still write
            raise
        del self._making[making.name]
        self._lanes[making.name] = making.lane
        waiting, making.waiting = making.waiting, []
        for call in waiting:
            call.start()
        return True

    def _verify(self, check, what) -> None:
        """Raise :class:`MismatchError` (and fail this transport) unless the reduced fingerprint shows
        every rank with the same fields: this rank's fields are then the largest and the smallest of all
        (``check``: the reduced buffer and this rank's own, as bytes)."""
        v, mine = check
        if v.tobytes() == mine:
            return
        n = len(FIELDS)
        message = _fingerprint_message(what, np.frombuffer(mine, np.int64)[:n], v[:n], -v[n:], self.rank, self.size)
        self.fail(message)
        _trace.dump(f"MismatchError: {message}")  # every rank raises (and dumps) alike
        raise MismatchError(message)

    def _iallreduce(self, buf, op):
        return self._lanes["allreduce"].Iallreduce(self._in_place, [buf, self._types[buf.dtype]], self._ops[op])

    def _ireduce(self, buf, op, root):
        spec = [buf, self._types[buf.dtype]]
        if self.rank == root:
            return self._lanes["reduce"].Ireduce(self._in_place, spec, self._ops[op], root)
        return self._lanes["reduce"].Ireduce(spec, None, self._ops[op], root)

    def _ibroadcast(self, buf, root):
        return self._lanes["broadcast"].Ibcast([buf.reshape(-1).view(np.uint8), self.MPI.BYTE], root)

    def _iallgather(self, send, recv):
        return self._lanes["allgather"].Iallgather([send.reshape(-1).view(np.uint8), self.MPI.BYTE],
                                                   [recv.reshape(-1).view(np.uint8), self.MPI.BYTE])

    def _igather(self, send, recv, root):
        return self._lanes["gather"].Igather([send.reshape(-1).view(np.uint8), self.MPI.BYTE],
                                             None if recv is None else [recv.reshape(-1).view(np.uint8), self.MPI.BYTE],
                                             root)

    def _ireduce_scatter(self, send, recv, op):
        datatype = self._types[send.dtype]
        return self._lanes["reduce_scatter"].Ireduce_scatter_block([send, datatype], [recv, datatype],
                                                                   self._ops[op])

    def _ialltoall(self, send, recv):
        return self._lanes["alltoall"].Ialltoall([send.reshape(-1).view(np.uint8), self.MPI.BYTE],
                                                 [recv.reshape(-1).view(np.uint8), self.MPI.BYTE])

    def _ibarrier(self):
        return self._lanes["barrier"].Ibarrier()

    def _wait(self, what, req) -> None:
        """Wait for ``req`` (no deadline on this transport); while receives are pending, polling, each
        poll moving them on (:meth:`_progress`)."""
        pending = self._receives
        if pending and (len(pending) > 1 or req.__class__ is not _Head or pending[0] is not req.receive):
            poll(self._progressing(req), None, spin_s=self.SPIN_S, max_pause_s=self.MAX_PAUSE_S)
        else:
            req.Wait()

    def _progress(self) -> None:
        """Move on every started receive of this transport whose header has arrived: post its data's
        receives. A receive posts them only once it knows the message (its sender, its data's tag, whether
        it fits), so without this a rank waiting for its send would never post the receive its peer's send
        waits for, where MPI (whose receives are posted at the call) completes: every wait and test of
        the transport calls it while receives are pending, as MPI's progress moves every request."""
        for r in tuple(self._receives):
            r.head_arrived()

    def _progressing(self, req):
        """``req.Test``, moving the pending receives on before each test."""
        def test() -> bool:
            self._progress()
            return req.Test()
        return test

    # ---- point-to-point: send/recv ----
    # A message is two: its header (p2p_header: bytes, elements, dtype name, the data's tag, the piece size)
    # on the "p2p" lane under the user's tag, then its data on the "p2p_data" lane, from the sender
    # only, under a tag of its own (the sender's count of messages to that rank, modulo max_tag + 1). The
    # receiver takes the header first (from src, or from any rank), checks it against its buffer, then
    # receives the data from the header's sender under the data's tag: a receive matched by any source
    # can only meet the data of its own header, whatever other receives are pending, and a message that
    # does not fit is received into scratch memory and dropped (p2p_mismatch), never truncated.
    def _header(self, buf: np.ndarray, name: str, dst: int, tag: int) -> np.ndarray:
        if dst == self.rank:
            self._to_itself[tag] = self._to_itself.get(tag, 0) + 1
        seq = self._p2p_seq.get(dst, 0)
        self._p2p_seq[dst] = seq + 1 if seq < self.max_tag else 0
        return p2p_header(buf.size, buf.nbytes, name, seq, self._max_count)

    @staticmethod
    def _pieces(raw: np.ndarray, piece: int):
        """``raw`` (1-d uint8) in the messages of at most ``piece`` bytes its data travels in (one for
        an empty buffer)."""
        if raw.size <= piece:
            return [raw]
        return [raw[lo:lo + piece] for lo in range(0, raw.size, piece)]

    def send(self, buf, name, dst, tag):
        """MPI_Send of the header, then of the data (in pieces past ``COLLECTIVES_MAX_COUNT`` bytes); while
        receives of this rank are pending, the non-blocking form, waited moving them on (:meth:`_progress`)."""
        if self._receives:
            return self._start_send(buf, name, dst, tag).wait()
        header = self._header(buf, name, dst, tag)
        self._lanes["p2p"].Send([header, self.MPI.INT64_T], dst, tag)
        data, byte, seq = self._lanes["p2p_data"], self.MPI.BYTE, int(header[2])
        for piece in self._pieces(buf.reshape(-1).view(np.uint8), self._max_count):
            data.Send([piece, byte], dst, seq)

    def recv(self, buf, name, src, tag, box):
        """MPI_Recv of a header (from ``src`` or any rank), checked, then of its data; while other receives
        are pending, the non-blocking form, waited moving them on (:meth:`_progress`)."""
        MPI = self.MPI
        header, status = np.empty(HEADER_WORDS, dtype=np.int64), MPI.Status()
        self._from_itself(src, tag)
        if self._receives:
            return _Receive(self, buf, name, src, tag, box).wait()
        self._lanes["p2p"].Recv([header, MPI.INT64_T], MPI.ANY_SOURCE if src is None else src, tag, status)
        source = status.Get_source()
        target, error = _receiving(self, buf, name, header, source, tag)
        data, byte, seq, piece = self._lanes["p2p_data"], MPI.BYTE, int(header[2]), int(header[3])
        for part in self._pieces(target, piece):
            data.Recv([part, byte], source, seq)
        if error is not None:
            raise error
        box[0] = source

    def _from_itself(self, src, tag) -> None:
        """A blocking receive that only this rank could send to (src is this rank, or any rank of one):
        refused unless the message is already there (this rank is blocked here: it could never come)."""
        if (src == self.rank or (src is None and self.size == 1)) and not self._to_itself.get(tag):
            raise CollectiveError(f"recv from rank {self.rank} (this rank) with tag {tag}: no message with that tag "
                                  f"was sent, and none can come while this rank waits; send(..., async_op=True) to "
                                  f"itself first")

    def _start_send(self, buf, name, dst, tag) -> _Sending:
        header = self._header(buf, name, dst, tag)
        data, byte, seq = self._lanes["p2p_data"], self.MPI.BYTE, int(header[2])
        reqs = [self._lanes["p2p"].Isend([header, self.MPI.INT64_T], dst, tag)]
        reqs += [data.Isend([piece, byte], dst, seq) for piece in self._pieces(buf.reshape(-1).view(np.uint8),
                                                                              self._max_count)]
        return _Sending(self, reqs, ("send", buf, f"dst={dst}, tag={tag}"), (header, buf))

    # ---- many buffers, one broadcast (synchronize) ----
    PIPE_CHUNK = 1 << 20  # bytes per message of broadcast_many
    MIN_PIPE_CHUNK = 4096  # ... and the least, for a tiny bucket_bytes
    PIPE_TAG = 7  # on the library's private communicator, used only by broadcast_many
    MAX_TYPE_SETS = 4  # receive datatypes kept per transport (for that many different sets of buffers)

    @property
    def can_broadcast_many(self) -> bool:
        """Whether :meth:`broadcast_many` may be used: more than one rank, all of them on this node, and
        no rank set ``COLLECTIVES_SYNC_PIPELINE=0``."""
        return self._pipeline and 1 < self.size == self.local_size

    def broadcast_many(self, bufs: list, root: int, ring_bytes: int) -> None:
        """Root's bytes into every rank's ``bufs`` (1-d contiguous uint8 arrays; writable except on root).

        Every rank passes buffers of the same lengths in the same order, and the same ``ring_bytes``. A
        pipeline of point-to-point messages of ``PIPE_CHUNK`` bytes: the root packs the next piece of the
        byte stream (every buffer end to end) into its pack buffers (a ring of at most ``ring_bytes``,
        reused across calls) while the others receive the last pieces, each straight into its own buffers
        through an MPI datatype that lists their addresses (``MPI_Type_create_hindexed``, cached per set
        of addresses). So every byte is copied once on the root (packing) and once on each receiver (by
        MPI, which between processes of one node reads the root's pack buffer directly where it can:
        MPICH and Open MPI use Linux cross-memory attach), and the two copies overlap. One broadcast per
        buffer would instead pay a rendezvous per buffer, and packing for ``MPI_Bcast`` adds an unpacking
        copy on every receiver. Sending each buffer in place, unpacked, would save the root's copy but is
        slower: buffers under 4 MiB sit in 4 KiB pages (NumPy asks for huge pages only from 4 MiB), and
        the kernel pins a sender's pages one by one (53 MiB in 1 MiB messages: 12.4 ms from 65 leaves,
        5.3 ms from one large array, here).

        The ring should be large (tens of MiB): the root rewrites a pack buffer only once every receiver
        has read it, and a buffer another core has just read is slow to rewrite (its cache lines must be
        taken back); with 2 ranks on this project's test machine a 57 MiB tree took 7.0 ms through a
        24 MiB ring, 11 ms through 16 MiB and 14 ms through 4 MiB (one flat ``MPI_Bcast``: 4.9 ms).

        Only for ranks of one node (:attr:`can_broadcast_many`): the root sends to every other rank.
        """
        lengths = tuple(b.nbytes for b in bufs)
        # Messages of PIPE_CHUNK bytes, smaller when the ring could not hold two of them: the ring (the
        # only memory this adds) stays within ring_bytes, the same on every rank (bucket_bytes is agreed).
        step = min(self.PIPE_CHUNK, max(ring_bytes // 2, self.MIN_PIPE_CHUNK))
        chunks = self._pipe_chunks(lengths, step)
        if not chunks:
            return
        MPI, comm, tag = self.MPI, self.comm, self.PIPE_TAG
        if self.rank == root:
            depth = max(2, ring_bytes // step)
            need = sum(lengths) if len(chunks) <= depth else depth * step
            ring = self._pipe_ring
            if ring is None or ring.size < need or ring.size > 2 * need:
                ring = self._pipe_ring = None  # drop the old ring before making the new one
                ring = self._pipe_ring = np.empty(need, dtype=np.uint8)
            others = [r for r in range(self.size) if r != root]
            pending: list = [None] * depth
            isend, byte, testall, waitall = comm.Isend, MPI.BYTE, MPI.Request.Testall, MPI.Request.Waitall
            for k, (pieces, total) in enumerate(chunks):
                slot = k % depth
                if pending[slot] is not None:
                    waitall(pending[slot])  # every receiver has taken what this buffer held
                seg = ring[slot * step:slot * step + total]
                for i, off, at, n in pieces:
                    seg[at:at + n] = bufs[i][off:off + n]
                pending[slot] = reqs = [isend([seg, byte], r, tag) for r in others]
                testall(reqs)  # lets MPI start the transfer now, while the next piece is packed
            for reqs in pending:
                if reqs is not None:
                    waitall(reqs)
            return
        recv, bottom = comm.Recv, MPI.BOTTOM
        types, spares = self._pipe_types(bufs, (lengths, step), chunks)
        for datatype in types:
            recv([bottom, 1, datatype], root, tag)
        for i, spare in spares:  # buffers that overlap an earlier one (tied weights), in order
            bufs[i][...] = spare

    def _pipe_chunks(self, lengths: tuple, size: int) -> list:
        """The byte stream of buffers of ``lengths``, cut into messages: ``[(pieces, total), ...]`` with
        ``pieces`` ``[(buffer index, offset in it, offset in the message, bytes), ...]``. Cached."""
        key = (lengths, size)
        hit = self._pipe_plans.get(key)
        if hit is not None:
            return hit
        chunks, pieces, used = [], [], 0
        for i, length in enumerate(lengths):
            off = 0
            while off < length:
                n = min(length - off, size - used)
                pieces.append((i, off, used, n))
                off += n
                used += n
                if used == size:
                    chunks.append((pieces, used))
                    pieces, used = [], 0
        if pieces:
            chunks.append((pieces, used))
        if len(self._pipe_plans) >= 16:
            self._pipe_plans.pop(next(iter(self._pipe_plans)))
        self._pipe_plans[key] = chunks
        return chunks

    def _pipe_types(self, bufs: list, plan_key: tuple, chunks: list) -> tuple[list, list]:
        """One committed MPI datatype per message, addressing this rank's ``bufs`` (absolute addresses, for
        ``MPI.BOTTOM``), and the spare buffers ``[(index, array), ...]`` received into instead of a buffer
        that overlaps an earlier one (the same tensor twice in a tree, tied weights: MPI forbids a receive
        datatype whose entries overlap), to be copied into it afterwards. Cached by the buffers'
        addresses: a model's parameters keep theirs."""
        get_address = self.MPI.Get_address
        addresses = tuple(get_address(b) for b in bufs)
        key = (addresses, plan_key)
        hit = self._pipe_typesets.pop(key, None)
        if hit is None:
            spares = [(i, np.empty(bufs[i].nbytes, dtype=np.uint8)) for i in _overlapping(addresses, plan_key[0])]
            where = list(addresses)
            for i, spare in spares:
                where[i] = get_address(spare)
            byte = self.MPI.BYTE
            types = []
            for pieces, _ in chunks:
                t = byte.Create_hindexed([n for _, _, _, n in pieces], [where[i] + off for i, off, _, _ in pieces])
                types.append(t.Commit())
            while len(self._pipe_typesets) >= self.MAX_TYPE_SETS:
                for t in self._pipe_typesets.pop(next(iter(self._pipe_typesets)))[0]:
                    t.Free()
            hit = (types, spares)
        self._pipe_typesets[key] = hit  # most recently used last
        return hit

    def allgather(self, send, recv):
        nbytes = send.nbytes
        if nbytes <= self._max_count:
            self._allgather_piece(send, recv)
            return
        # Past the count limit: every rank broadcasts its part, chunk by chunk, into its row.
        for r in range(self.size):
            row = recv[r]
            if r == self.rank:
                row[...] = send.reshape(-1)
            self.broadcast(row, r)

    def gather(self, send, recv, root):
        raw_s = send.reshape(1, -1).view(np.uint8)
        raw_r = None if recv is None else recv.reshape(self.size, -1).view(np.uint8)
        m, step = raw_s.shape[1], self._max_count
        if m <= step:
            self._gather_piece(raw_s, raw_r, root)
            return
        # Past the count limit: one gather per column piece, which the root copies into place.
        for lo in range(0, m, step):
            piece = np.ascontiguousarray(raw_s[:, lo:lo + step])
            out = None if raw_r is None else np.empty((self.size, piece.shape[1]), np.uint8)
            self._gather_piece(piece, out, root)
            if raw_r is not None:
                raw_r[:, lo:lo + step] = out

    def _blocks(self, send, recv):
        """Pieces ``(send part, recv part, write back)`` of a reduce-scatter or alltoall whose per-rank
        block is longer than one MPI call takes: column slices of the ``(size, n)`` layout, copied to be
        contiguous (``write back`` copies a received piece into place). One piece, no copy, otherwise.
        ``send`` is ``(size, n)``, ``recv`` ``(rows, n)``."""
        n, step = send.shape[1], self._max_count
        if n <= step:
            yield send, recv, None
            return
        s2, r2 = send, recv
        for lo in range(0, n, step):
            piece = np.ascontiguousarray(s2[:, lo:lo + step])
            out = np.empty((r2.shape[0], piece.shape[1]), dtype=recv.dtype)
            yield piece, out, (r2[:, lo:lo + step], out)

    def reduce_scatter(self, send, recv, op):
        datatype = self._types[send.dtype]
        mop = self._ops[op]
        for s, r, back in self._blocks(send.reshape(self.size, -1), recv.reshape(1, -1)):
            self._reduce_scatter_piece(s, r, datatype, mop, op)
            if back is not None:
                back[0][...] = back[1]

    def alltoall(self, send, recv):
        raw_s = send.reshape(self.size, -1).view(np.uint8)
        raw_r = recv.reshape(self.size, -1).view(np.uint8)
        for s, r, back in self._blocks(raw_s, raw_r):
            self._alltoall_piece(s, r)
            if back is not None:
                back[0][...] = back[1]

    def _allgather_piece(self, send, recv) -> None:
        """The one MPI call of :meth:`allgather` (the deadline transport polls a non-blocking one)."""
        self._lanes["allgather"].Allgather([send.reshape(-1).view(np.uint8), self.MPI.BYTE],
                                           [recv.reshape(-1).view(np.uint8), self.MPI.BYTE])

    def _gather_piece(self, send, recv, root) -> None:
        """The one MPI call of :meth:`gather` on uint8 ``send`` (and ``recv`` on root; None elsewhere)."""
        self._lanes["gather"].Gather([send.reshape(-1), self.MPI.BYTE],
                                     None if recv is None else [recv.reshape(-1), self.MPI.BYTE], root)

    def _reduce_scatter_piece(self, s, r, datatype, mop, op) -> None:
        """One MPI call of :meth:`reduce_scatter` (the deadline transport polls a non-blocking one)."""
        self._lanes["reduce_scatter"].Reduce_scatter_block([s, datatype], [r, datatype], mop)

    def _alltoall_piece(self, s, r) -> None:
        """One MPI call of :meth:`alltoall` (the deadline transport polls a non-blocking one)."""
        self._lanes["alltoall"].Alltoall([s, self.MPI.BYTE], [r, self.MPI.BYTE])

    def allgather_object(self, obj):
        return self.comm.allgather(obj)

    def broadcast_object(self, obj, root):
        return self.comm.bcast(obj, root)

    def agree_allgather(self, send, recv) -> None:
        self.comm.Allgather([send, self.MPI.BYTE], [recv, self.MPI.BYTE])

    def objects_allgather(self, obj) -> list:
        return self._lanes["objects"].allgather(obj)

    def objects_broadcast(self, obj, root):
        return self._lanes["objects"].bcast(obj, root)

    def barrier(self):
        self._lanes["barrier"].Barrier()

    # ---- the lanes, and communicators of their own ----
    def lane(self, name: str):
        """The MPI communicator of one kind of collective (a name in :data:`LANES`), for a transport that
        runs that kind's MPI calls itself (CUDA-aware MPI). Collective at a kind's first use (made then,
        agreed first: see ``_Lanes``): every rank calls it for the same kind at the same point."""
        return self._lanes[name]

    def mpi_type(self, dtype: np.dtype):
        """The MPI datatype of NumPy ``dtype`` (KeyError where this MPI has none, e.g. float16 on some)."""
        return self._types[dtype]

    def mpi_op(self, op: str):
        """The MPI op of the library's ``op`` ("sum", "prod", "min", "max", ...)."""
        return self._ops[op]

    def create_group(self, ranks):
        """An mpi4py communicator of exactly ``ranks`` (ranks of this transport), made by those ranks
        alone (``MPI_Comm_create_group`` on the "groups" lane); None on a rank not among them. The lane is
        made collectively: every rank calls ``lane("groups")`` first, at one point."""
        lane = self._lanes.get("groups")
        if lane is None:
            raise RuntimeError("create_group: every rank must first call lane('groups') (collectively)")
        group = lane.Get_group().Incl(sorted(ranks))
        try:
            sub = lane.Create_group(group, tag=0)
        finally:
            group.Free()
        return None if sub == self.MPI.COMM_NULL else sub

    def _like(self, comm) -> MPITransport:
        """A transport of this kind on ``comm`` (collective over it)."""
        return MPITransport(comm)

    def split(self, color, key, timeout=None):
        """``MPI_Comm_split`` of this transport's communicator, then a transport of the same kind (a
        deadline too, with the same ``timeout``) on a duplicate of the part; a deadline transport where
        ``timeout`` is given (bounded by the smaller of it and this one's); None for ``color`` None."""
        part = self.comm.Split(self.MPI.UNDEFINED if color is None else color, key)
        if part == self.MPI.COMM_NULL:
            return None
        child: MPITransport
        try:
            if timeout is not None and (self.timeout is None or timeout < self.timeout):
                child = DeadlineMPITransport(part, timeout)  # collective over the part, as _like
                child.timeout_setting = "timeout"
            else:
                child = self._like(part)  # collective over the part: its own duplicate, node communicator, settings
        finally:
            part.Free()
        child.check_nan = child.check_nan or self.check_nan  # on if on for the parent (agreed there) or here
        return child

    def close(self):
        for making in getattr(self, "_making", {}).values():
            self.abandon(making)  # a lane whose making was never waited for: left to the end of the process
        self._making = {}
        if self.failed is not None:  # a request may still be pending on it: freeing could block; leave it
            self.comm, self._lanes, self._shm = None, {}, None  # (to the end of the process)
            return
        reducer, self._shm = getattr(self, "_shm", None), None
        if reducer is not None:
            reducer.close()  # the window before the communicator it was made on
        typesets, self._pipe_typesets = getattr(self, "_pipe_typesets", {}), {}
        self._pipe_ring = None
        if not self.MPI.Is_finalized():
            for types, _ in typesets.values():
                for t in types:
                    t.Free()
        lanes, self._lanes = getattr(self, "_lanes", {}), {}
        comm, self.comm = getattr(self, "comm", None), None
        if not self.MPI.Is_finalized():
            for lane in lanes.values():
                lane.Free()
            if comm is not None:
                comm.Free()


def _overlapping(addresses: tuple, lengths: tuple) -> list[int]:
    """Indices of the byte ranges ``[address, address + length)`` that overlap a range of lower index.

    O(n log n) in the number of ranges (a fresh tree of 100k leaves pays this on its first synchronize):
    one sweep in address order keeps the ranges still open at the current start in two heaps, one by
    lowest index (does the current range overlap a lower-index one?) and one of the not yet marked by
    highest index (which open ranges overlap the current, lower-index one?); each range enters and leaves
    each heap at most once. Empty ranges overlap nothing.
    """
    order = sorted((a, i) for i, a in enumerate(addresses) if lengths[i])
    lowest: list = []  # (index, end) of the open ranges, lowest index on top
    unmarked: list = []  # (-index, end) of the open ranges not marked yet, highest index on top
    later = set()
    for a, i in order:
        while lowest and lowest[0][1] <= a:  # closed before a: closed for every later start too
            heapq.heappop(lowest)
        while unmarked and (unmarked[0][1] <= a or -unmarked[0][0] > i):
            neg_j, end = heapq.heappop(unmarked)
            if end > a:  # open, and of higher index than i: it overlaps i
                later.add(-neg_j)
        if lowest and lowest[0][0] < i:
            later.add(i)
        end = a + lengths[i]
        heapq.heappush(lowest, (i, end))
        if i not in later:
            heapq.heappush(unmarked, (-i, end))
    return sorted(later)


class _MPIRequest(Request):
    """An MPI request of a transport, with the fingerprint reduced beside it (``check``: ``(request,
    buffer)``, or None): :meth:`test` is ``MPI_Test`` (which also lets MPI progress it); :meth:`wait` is the
    transport's wait (``MPI_Wait``, or polling under the deadline). The fingerprint is looked at first: a
    call that the ranks made differently raises :class:`MismatchError` (and fails the transport) before
    its data is waited for, and its request is kept, never completed (its buffers stay alive)."""

    def __init__(self, transport, req, call, check=None):
        self._transport, self._req, self._call, self._check = transport, req, call, check
        self._done = False

    def _what(self):
        """What this request is, for messages (:func:`_describe`): made only when a message needs it."""
        return _describe(*self._call)

    def _checked(self) -> None:
        check = self._check[1]
        self._check = None
        try:
            self._transport._verify(check, self._what())
        except MismatchError:
            self._transport.abandon(self._req)
            self._req = None
            raise

    def test(self) -> bool:
        if not self._done:
            if self._transport.failed is not None:  # a mismatch or timeout of another call: never completes
                self._transport.usable(self)  # (keeping this request: it never completes)
            if self._transport._receives:
                self._transport._progress()
            if self._check is not None:
                if not self._check[0].Test():
                    return False
                self._checked()
            self._done = self._req.Test()
        return self._done

    def wait(self) -> None:
        if not self._done:
            if self._transport.failed is not None:  # (as in test: raised at once, never waited for)
                self._transport.usable(self)  # (keeping this request: it never completes)
            try:
                if self._check is not None:
                    self._transport._wait(self._what, self._check[0])
                    self._checked()
                self._transport._wait(self._what, self._req)
            except BaseException:  # a timeout: MPI may still write into the buffers: keep them alive
                self._transport.abandon(self)
                raise
            self._done = True


class _Making:
    """A lane being made (``MPITransport._begin_making``): its name, the fingerprint of its making
    (``(request, (buffer, this rank's bytes))``, None once checked or at one rank), the new communicator
    and its ``MPI_Comm_idup`` request (None until begun; usable once it completes), the non-blocking
    calls waiting for it (:class:`_FirstCall`), and what a timeout of the making names (the caller's call
    it is made for, where the engine described one: :func:`_making_what`)."""

    __slots__ = ("check", "dup", "lane", "name", "waiting", "what")

    def __init__(self, name, check, what: tuple):
        self.name, self.check, self.what = name, check, what
        self.lane: Any = None
        self.dup: Any = None
        self.waiting: list[_FirstCall] = []


class _FirstCall(Request):
    """A non-blocking call of a kind whose lane is not made yet: its fingerprint is reduced at once (in the
    order of the calls), its MPI call started when the lane is made, which any test or wait of a call
    waiting for that lane moves on (``MPITransport._advance``); from then on it is that call's
    :class:`_MPIRequest`. Starting it never blocks, as MPI's non-blocking calls do not. (So a rank that
    gives up waiting for a kind's first call, a timeout, never posted its MPI call: a late rank's
    matching call then times out too, where one on a made lane could still complete.)"""

    def __init__(self, transport, operation, args):
        self._transport, self._operation, self._args = transport, operation, args
        making = transport._making.get(operation) or transport._begin_making(operation)
        self._making = making
        making.waiting.append(self)
        self._check = (transport._fingerprint(operation, *args) if transport.size > 1 and transport.fingerprints
                       else None)
        self._request: _MPIRequest | None = None

    def start(self) -> None:
        t = self._transport
        self._request = _MPIRequest(t, getattr(t, "_i" + self._operation)(*self._args), (self._operation, self._args),
                                    self._check)

    def test(self) -> bool:
        if self._request is None:
            self._transport.usable(self)  # (failed: its fingerprint may be pending for good; kept)
            if not self._transport._advance(self._making):
                return False
        assert self._request is not None  # started by _advance
        return self._request.test()

    def wait(self) -> None:
        if self._request is None:
            self._transport.usable(self)
            try:
                self._transport._advance(self._making, self._transport._wait)
            except BaseException:  # its fingerprint may be pending for good: kept, with its buffer
                self._transport.abandon(self)
                raise
        assert self._request is not None  # started by _advance
        self._request.wait()


class _Status:
    """An MPI request tested and waited with a status (the source of a header received from any rank):
    what :meth:`MPITransport._wait` and the deadline's polling take."""

    __slots__ = ("_req", "_status")

    def __init__(self, req, status):
        self._req, self._status = req, status

    def Test(self) -> bool:
        return self._req.Test(self._status)

    def Wait(self) -> None:
        self._req.Wait(self._status)


def _receiving(transport, buf, name, header, source, tag):
    """``(where the data goes, error)``: ``buf``'s bytes and None when the message fits it, else scratch
    bytes of the sender's size and the error to raise once they are received (``p2p_mismatch``)."""
    if source == transport.rank:
        transport._to_itself[tag] -= 1
    error = p2p_mismatch(header, buf.size, buf.nbytes, name, source, tag, transport.rank)
    if error is None:
        return buf.reshape(-1).view(np.uint8), None
    return np.empty(p2p_fields(header)[0], dtype=np.uint8), error


class _Sending(Request):
    """A started send: its header's and its data's MPI requests (the buffers kept alive with them)."""

    def __init__(self, transport, reqs, what, keep):
        self._transport, self._reqs, self._what, self._keep = transport, reqs, what, keep
        self._done = False

    def test(self) -> bool:
        if not self._done:
            if self._transport.failed is not None:  # a mismatch or timeout of another call: never completes
                self._transport.usable(self)  # (keeping this request: it never completes)
            if self._transport._receives:
                self._transport._progress()
            self._done = self._transport.MPI.Request.Testall(self._reqs)
        return self._done

    def wait(self) -> None:
        if not self._done:
            for req in self._reqs:
                self._transport._wait(self._what, req)  # bounded on the deadline transport (it fails it)
            self._done = True


class _Receive(Request):
    """A started receive: the header's receive first; once it has arrived (in :meth:`test` or
    :meth:`wait`), checked against the buffer, the data's receives from its sender."""

    def __init__(self, transport, buf, name, src, tag, box):
        MPI = transport.MPI
        self._transport, self._buf, self._name, self._tag, self._box = transport, buf, name, tag, box
        self._header = np.empty(HEADER_WORDS, dtype=np.int64)
        self._status = MPI.Status()
        self._what = ("recv", buf, f"src={'any' if src is None else src}, tag={tag}")
        self._head = _Status(transport._lanes["p2p"].Irecv([self._header, MPI.INT64_T],
                                                           MPI.ANY_SOURCE if src is None else src, tag),
                             self._status)
        self._data: list | None = None
        self._error: Exception | None = None
        self._done = False
        transport._receives.append(self)  # moved on by every wait and test of the transport (_progress)

    def head_arrived(self) -> bool:
        """Whether the header has arrived, its data's receives then posted (once)."""
        if self._data is None:
            if not self._head.Test():
                return False
            self._arrived()
        return True

    def _arrived(self) -> None:
        t = self._transport
        t._receives.remove(self)
        source = self._status.Get_source()
        target, self._error = _receiving(t, self._buf, self._name, self._header, source, self._tag)
        seq, piece = int(self._header[2]), int(self._header[3])
        lane, byte = t._lanes["p2p_data"], t.MPI.BYTE
        self._scratch = target
        self._data = [lane.Irecv([part, byte], source, seq) for part in t._pieces(target, piece)]
        self._box[0] = source

    def _finish(self) -> None:
        self._done = True
        if self._error is not None:
            raise self._error

    def test(self) -> bool:
        if self._done:
            return True
        t = self._transport
        if t._receives:
            t._progress()  # this receive's header too
        if self._data is None or not t.MPI.Request.Testall(self._data):
            return False
        self._finish()
        return True

    def wait(self) -> None:
        if self._done:
            return
        t = self._transport
        if self._data is None:
            t._wait(self._what, _Head(self))
        for req in self._data or ():
            t._wait(self._what, req)
        self._finish()


class _Head:
    """The header of a started receive as a request the transport's waits take: complete once it has
    arrived and the data's receives are posted (:meth:`_Receive.head_arrived`)."""

    __slots__ = ("receive",)

    def __init__(self, receive):
        self.receive = receive

    def Test(self) -> bool:
        return self.receive.head_arrived()

    def Wait(self) -> None:  # (only when no other receive is pending: MPITransport._wait)
        r = self.receive
        if r._data is None:
            r._head.Wait()
            r._arrived()


class DeadlineMPITransport(MPITransport):
    """:class:`MPITransport` with a deadline on every collective (``COLLECTIVES_TIMEOUT`` seconds).

    Every operation is started as a non-blocking MPI collective and polled with ``MPI_Test``. MPI makes
    progress on a non-blocking collective only inside such calls, so for the first ``SPIN_S`` seconds the
    rank polls continuously, as a blocking MPI call would (yielding the core every few polls, for ranks
    that share cores); a wait that lasts longer is a rank waiting for a straggler, and it then sleeps
    between polls with a backoff of up to ``MAX_PAUSE_S``, so a long wait does not burn a core. When the
    deadline passes, the rank prints which collective it was waiting in and raises
    :class:`CollectiveTimeoutError`; uncaught, that ends the job (``collectives._failure``). The pending
    request cannot be cancelled, so the transport is unusable afterwards: later calls raise
    :class:`CollectiveError` at once, and ``close`` leaves the MPI communicator to the end of the process.

    Between ranks of one node, allreduces from the shared-memory threshold on go through the node-shared
    window (``shm``) as on :class:`MPITransport`, each of its node barriers an ``MPI_Ibarrier`` polled
    the same way, so they too are bounded; ``mean`` of floats is the one hot-path call (the window
    divides while copying out).

    Made by the factory (``factory.host_transport``) when ``COLLECTIVES_TIMEOUT`` is set.
    """

    checks_beside = True  # every call is non-blocking with its fingerprint (the hot path's too)
    timeout: float

    def __init__(self, comm, timeout: float):
        self.timeout = timeout
        super().__init__(comm)

    def _like(self, comm) -> MPITransport:
        child = DeadlineMPITransport(comm, self.timeout)
        child.timeout_setting = self.timeout_setting
        return child

    @property
    def can_broadcast_many(self) -> bool:
        return False  # broadcast_many's blocking pipeline has no deadline: buckets instead

    def fast_call(self, op, dtype, size):
        """Where the plain transport has a direct call, this transport's polled operation itself (below:
        the fingerprint and the deadline stay on every call; the hot path only skips the validation it did
        once); ``mean`` of floats sums and divides (so the shared-memory allreduce can divide while
        copying out)."""
        if op != "mean":
            if op == "broadcast":
                return self.broadcast
            if not self._direct(op, dtype):
                return None  # widened, ordered integers, ...: the general path
            allreduce = self.allreduce

            def run(x):
                allreduce(x, op)

            return run
        if not self._direct(op, dtype):
            return None
        n = float(size)

        def run_mean(x):
            if not self._bounded_shm(x, "mean", self._wait):
                self.allreduce(x, "sum")
                divide(x, n)

        return run_mean

    def fast_blocks(self, operation, op, dtype, size):
        return None  # the same

    # ---- waiting ----
    def _wait(self, what, req) -> None:
        """Wait for ``req`` under the deadline (:meth:`MPITransport._wait_within`)."""
        self._wait_within(what, req, self.timeout, self.timeout_setting)

    def _now(self, operation, *args) -> None:
        """One MPI call of ``operation``, non-blocking with its fingerprint, waited under the deadline."""
        if self.failed is not None:
            self.usable()
        self._begin(operation, *args).wait()

    # ---- data: the blocking operations' MPI calls, each the non-blocking one waited under the deadline ----
    def allreduce(self, buf, op):
        if self._bounded_shm(buf, op, self._wait):
            return
        super().allreduce(buf, op)

    def allreduce_fused(self, bufs, op) -> bool:
        """As the plain transport's, under the deadline: one fingerprint for the pass (an allreduce of
        every element of ``bufs``), then each node barrier an ``MPI_Ibarrier`` waited under the deadline."""
        if not self._fusing(bufs, op):
            return False
        self.usable()
        dtype = bufs[0].dtype
        whole = np.lib.stride_tricks.as_strided(np.zeros(1, dtype), (sum(b.size for b in bufs),), (0,))
        what = ("allreduce", whole, f"op={op}, node-shared memory, {len(bufs)} buffers in one pass")
        req, check = self._fingerprint("allreduce", whole, wire_op(op))
        self._wait(what, req)
        self._verify(check, what)

        def wait(req):
            self._wait(what, req)

        reducer = self._reducer(wait)
        if not reducer.supports(dtype, op, bounded=True):
            return False  # (the same answer on every rank; each buffer then has a fingerprint of its own)
        reducer.allreduce_many(bufs, op, wait)
        return True

    def _allreduce_piece(self, piece, datatype, mop, op) -> None:
        self._now("allreduce", piece, op)

    def reduce(self, buf, op, root):
        if op == "prod" and buf.dtype.kind == "c":  # Ireduce's order of complex products gives other signs
            # of zero parts than Reduce's (see MPITransport._fits); Iallreduce's agrees with Reduce's
            return self.allreduce(buf if self.rank == root else buf.copy(), op)
        super().reduce(buf, op, root)

    def _reduce_piece(self, piece, datatype, mop, op, root) -> None:
        self._now("reduce", piece, op, root)

    def _broadcast_piece(self, piece, root) -> None:
        self._now("broadcast", piece, root)

    def _allgather_piece(self, send, recv) -> None:
        self._now("allgather", send, recv)

    def _gather_piece(self, send, recv, root) -> None:
        self._now("gather", send, recv, root)

    def _reduce_scatter_piece(self, s, r, datatype, mop, op) -> None:
        self._now("reduce_scatter", s, r, op)

    def _alltoall_piece(self, s, r) -> None:
        self._now("alltoall", s, r)

    def barrier(self):
        self._now("barrier")

    def send(self, buf, name, dst, tag):
        self.usable()
        self._start_send(buf, name, dst, tag).wait()

    def recv(self, buf, name, src, tag, box):
        self.usable()
        self._from_itself(src, tag)
        _Receive(self, buf, name, src, tag, box).wait()

    # ---- objects and agreement: bounded too (no fingerprint: pickled sizes differ by design) ----
    def _allgather_bytes(self, comm, data: np.ndarray, what) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every rank's uint8 ``data`` over ``comm``: ``(table, sizes, offsets)``, each wait bounded."""
        self.usable()
        sizes = np.empty(self.size, dtype=np.int64)
        self._wait(what, comm.Iallgather([np.array([data.size], dtype=np.int64), self.MPI.INT64_T],
                                         [sizes, self.MPI.INT64_T]))
        table = np.empty(int(sizes.sum()), dtype=np.uint8)
        offsets = np.zeros(self.size, dtype=np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        self._wait(what, comm.Iallgatherv([data, self.MPI.BYTE], [table, (sizes, offsets), self.MPI.BYTE]))
        return table, sizes, offsets

    def _allgather_object_on(self, comm, obj, what) -> list:
        data = np.frombuffer(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        table, sizes, offsets = self._allgather_bytes(comm, data, what)
        return [pickle.loads(table[o:o + n].tobytes()) for o, n in zip(offsets, sizes)]

    def _broadcast_object_on(self, comm, obj, root, what):
        self.usable()
        n = np.zeros(1, dtype=np.int64)
        if self.rank == root:
            data = np.frombuffer(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
            n[0] = data.size
        self._wait(what, comm.Ibcast([n, self.MPI.INT64_T], root))
        if self.rank != root:
            data = np.empty(int(n[0]), dtype=np.uint8)
        self._wait(what, comm.Ibcast([data, self.MPI.BYTE], root))
        return obj if self.rank == root else pickle.loads(data.tobytes())

    def allgather_object(self, obj):
        return self._allgather_object_on(self.comm, obj, ("the agreement step (allgather of call descriptions)",
                                                          None, None))

    def broadcast_object(self, obj, root):
        return self._broadcast_object_on(self.comm, obj, root, ("broadcast of the library's metadata", None,
                                                                f"root={root}"))

    def agree_allgather(self, send, recv) -> None:
        self.usable()
        self._wait(("the agreement step (allgather of fingerprints)", None, None),
                   self.comm.Iallgather([send, self.MPI.BYTE], [recv, self.MPI.BYTE]))

    def objects_allgather(self, obj) -> list:
        return self._allgather_object_on(self._lanes["objects"], obj, ("allgather_object", None, None))

    def objects_broadcast(self, obj, root):
        return self._broadcast_object_on(self._lanes["objects"], obj, root, ("broadcast_object", None,
                                                                             f"root={root}"))



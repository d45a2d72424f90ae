"""The MPI transport (mpi4py), for host memory: the collectives in pieces within the count one MPI call
takes, each piece one call made from its operation's row (``ops``), blocking here, non-blocking with its
fingerprint beside it (``start``), and the node-shared-memory allreduce."""

from __future__ import annotations

import sys
import time

import numpy as np

from ... import _agree, _config, _trace
from ..._errors import BackendUnavailableError, CollectiveTimeoutError
from ..._poll import poll
from .. import shm  # large allreduces through a node-shared window (made at first use), issue 7
from ..base import DONE, P2P_OPERATIONS, Request
from .._fingerprint import EAGER_LANES
from . import library
from .fast import HotPath
from .lanes import LaneMaking, _Lanes, _Making
from .library import PROBED_OPS, _agreed_settings, faulty_ops, import_mpi
from .ops import OPERATIONS
from .p2p import PointToPoint, _Head, _Receive
from .pipeline import BroadcastPipeline
from .requests import _FirstCall, _MPIRequest
from .shared import SharedWindow


class MPITransport(HotPath, SharedWindow, LaneMaking, PointToPoint, BroadcastPipeline):
    """Host collectives over MPI. Its parts, each a base class of its own module: the hot path
    (``fast``), the node-shared window (``shared``), the lanes and fingerprints (``lanes``),
    point-to-point (``p2p``), ``broadcast_many`` (``pipeline``). Each MPI call is made from its row of
    ``ops.OPERATIONS`` (:meth:`_call`, :meth:`_start_call`, :meth:`call`), so that it is written once."""

    name = "mpi"
    fingerprints = True  # reduce a fingerprint beside every non-blocking call (_begin); off only in benchmarks
    timeout: float | None = None  # seconds; set only on a DeadlineMPITransport
    timeout_setting = "COLLECTIVES_TIMEOUT"  # what set the bound (named when it expires)
    deadline_kind: type | None = None  # DeadlineMPITransport, which split makes (deadline.py sets it: that
    # module imports this one, not the reverse)

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
            _agree.refuse_together(self.comm, _config.problems(), _config.malformed)
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
        self._ops, self._types = library._tables(MPI)
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
            library._warn_faulty(MPI, sorted(self._faulty, key=PROBED_OPS.index))
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
        allreduce = OPERATIONS["allreduce"]  # the fingerprint's Iallreduce(IN_PLACE, v, MAX), bound once
        self._reduce_fingerprint = allreduce.bind_in_place(allreduce.method(self._lanes["fingerprint"], False),
                                                           MPI.MAX, MPI.IN_PLACE)
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
        if buf.size <= self._max_count:  # one piece (the usual case: no generator)
            self._call("allreduce", buf.reshape(-1), op)
            return
        for piece in self._chunks(buf):
            self._call("allreduce", piece, op)

    def reduce(self, buf, op, root):
        for piece in self._chunks(buf):
            self._call("reduce", piece, op, root)

    def broadcast(self, buf, root):
        raw = buf.reshape(-1).view(np.uint8)
        for piece in self._chunks(raw):
            self._call("broadcast", piece, root)

    # ---- each MPI call, made from its row (ops.OPERATIONS) ----
    def _arguments(self, row, args) -> list:
        """mpi4py's arguments for ``row`` from the transport's ``args``: a reduction's buffers typed by
        their elements' datatype, data movement's as raw bytes (``MPI.BYTE``)."""
        bufs, op, root = row.parts(args)
        if row.reduces:
            types = self._types
            specs = [None if b is None else [b, types[b.dtype]] for b in bufs]
        else:
            byte = self.MPI.BYTE
            specs = [None if b is None else [b.reshape(-1).view(np.uint8), byte] for b in bufs]
        return row.arguments(specs, None if op is None else self._ops[op], root, self.rank, self._in_place)

    def _call(self, operation, *args) -> None:
        """One MPI call of ``operation``, blocking (the deadline transport: the non-blocking one, with its
        fingerprint, waited under the deadline)."""
        row = OPERATIONS[operation]
        row.method(self._lanes[row.lane])(*self._arguments(row, args))

    def _start_call(self, operation, *args):
        """One MPI call of ``operation``, non-blocking: its request (:meth:`_begin` reduces the fingerprint)."""
        row = OPERATIONS[operation]
        return row.method(self._lanes[row.lane], False)(*self._arguments(row, args))

    def call(self, operation: str, *args, lane: str | None = None) -> None:
        """One blocking MPI call of ``operation`` on buffers already in MPI's terms: ``[memory, count,
        datatype]`` or ``[memory, MPI.BYTE]`` (CUDA-aware MPI: device memory), then the op's name and the
        root where the operation takes them; on ``operation``'s lane, or on ``lane`` (an allgather's pieces
        broadcast on the allgather lane). Collective at a kind's first use (its lane is made then)."""
        row = OPERATIONS[operation]
        specs, op, root = row.parts(args)
        row.call(self._lanes[lane or row.lane], specs, None if op is None else self._ops[op], root, rank=self.rank,
                 in_place=self._in_place)

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

    SPIN_S = 0.25
    MAX_PAUSE_S = 1e-3

    def _wait_within(self, what, req, seconds: float | None, setting: str, keep=None) -> None:
        """Wait for ``req`` until it completes or ``seconds`` from now have passed (then fail the transport
        and raise :class:`CollectiveTimeoutError`), polling as :func:`collectives._poll.poll` does.
        ``keep``: what MPI reads or writes for ``req`` beyond ``what``'s buffer (a fingerprint's buffer,
        a size's array), kept with it if it stays pending: mpi4py's non-blocking calls hold no reference
        to their buffers, so once the caller's frame lets them go, MPI would read and write freed memory."""
        test = self._progressing(req) if self._receives else req.Test
        if test():  # already complete (a small call often is): no clock read
            return
        t0 = time.monotonic()
        if not poll(test, seconds, spin_s=self.SPIN_S, max_pause_s=self.MAX_PAUSE_S):
            self.abandon((req, what, keep))  # pending for good: it and its buffers live to the end of the process
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
        one whose non-blocking form gives the blocking form's bits (``Operation.fits``)."""
        return OPERATIONS[operation].fits(args, self.size, self._max_count)

    def _begin(self, operation, *args) -> Request:
        """Start one MPI call of ``operation`` and, before it, the reduction of its fingerprint
        (:meth:`_fingerprint`) on the fingerprint lane: when the call's request completes, every rank
        has learnt whether every rank made the same call, and raises :class:`MismatchError` if not."""
        if operation not in self._lanes:  # its first call: started once its lane is made (never blocks here)
            return _FirstCall(self, operation, args)
        check = self._fingerprint_beside(operation, *args)
        return _MPIRequest(self, self._start_call(operation, *args), (operation, args), check)


    def _wait(self, what, req, keep=None) -> None:
        """Wait for ``req`` (no deadline on this transport); while receives are pending, polling, each
        poll moving them on (:meth:`_progress`). ``keep``: as in :meth:`_wait_within` (a wait without a
        deadline returns once ``req`` is complete)."""
        pending = self._receives
        if pending and (len(pending) > 1 or req.__class__ is not _Head or pending[0] is not req.receive):
            poll(self._progressing(req), None, spin_s=self.SPIN_S, max_pause_s=self.MAX_PAUSE_S)
        else:
            req.Wait()

    def allgather(self, send, recv):
        nbytes = send.nbytes
        if nbytes <= self._max_count:
            self._call("allgather", send, recv)
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
            self._call("gather", raw_s, raw_r, root)
            return
        # Past the count limit: one gather per column piece, which the root copies into place.
        for lo in range(0, m, step):
            piece = np.ascontiguousarray(raw_s[:, lo:lo + step])
            out = None if raw_r is None else np.empty((self.size, piece.shape[1]), np.uint8)
            self._call("gather", piece, out, root)
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
        for s, r, back in self._blocks(send.reshape(self.size, -1), recv.reshape(1, -1)):
            self._call("reduce_scatter", s, r, op)
            if back is not None:
                back[0][...] = back[1]

    def alltoall(self, send, recv):
        raw_s = send.reshape(self.size, -1).view(np.uint8)
        raw_r = recv.reshape(self.size, -1).view(np.uint8)
        for s, r, back in self._blocks(raw_s, raw_r):
            self._call("alltoall", s, r)
            if back is not None:
                back[0][...] = back[1]

    def allgather_object(self, obj):
        return self.comm.allgather(obj)

    def broadcast_object(self, obj, root):
        return self.comm.bcast(obj, root)

    def agree_allgather(self, send, recv) -> None:
        byte = self.MPI.BYTE  # on the agreement communicator (self.comm), not the allgather lane
        OPERATIONS["allgather"].call(self.comm, ([send, byte], [recv, byte]))

    def objects_allgather(self, obj) -> list:
        return self._lanes["objects"].allgather(obj)

    def objects_broadcast(self, obj, root):
        return self._lanes["objects"].bcast(obj, root)

    def barrier(self):
        self._call("barrier")

    # ---- the lanes, and communicators of their own ----
    def lane(self, name: str):
        """The MPI communicator of one kind of collective (a name in :data:`LANES`), made now if it is not
        (the torch backend makes its ``groups`` lane so, before :meth:`create_group`). Collective at a kind's
        first use (made then, agreed first: see ``_Lanes``): every rank calls it for the same kind at the
        same point."""
        return self._lanes[name]

    def mpi_type(self, dtype: np.dtype):
        """The MPI datatype of NumPy ``dtype`` (KeyError where this MPI has none, e.g. float16 on some)."""
        return self._types[dtype]

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
                child = self.deadline_kind(part, timeout)  # type: ignore[misc]  # collective over the part, as _like
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
        self._reduce_fingerprint = _closed
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


def _closed(buf):
    """A closed transport's fingerprint reduction: its lanes are gone (as ``_lanes["fingerprint"]`` was)."""
    raise KeyError("fingerprint")

"""Allreduce of large host buffers through node-shared memory (an MPI-3 shared window), NumPy kernels.

Between the processes of one node, MPI's own allreduce moves the bytes through small shared cells and
reduces them piecemeal; for large messages it runs at a fraction of memory bandwidth. Here the ranks of a
node share one window (``MPI.Win.Allocate_shared``) and reduce in it with NumPy ufuncs:

1. every rank copies its chunk into its slot of the window (all but its own slice, see below);
2. node barrier; at a call's first chunk every rank then compares what each rank's call is (count, dtype,
   op, written after its regions before the barrier): where they differ every rank of the node raises the
   same ``MismatchError`` before any result is written (``_check_calls``);
3. rank ``p`` reduces slice ``p`` of the chunk (1/local_size of it) over every rank's data, in rank order,
   into its own buffer and into the result region of its slot;
4. node barrier;
5. every rank copies the other ranks' result slices into its buffer.

Each element is computed by exactly one rank, always in the same order (``((x0 op x1) op x2) ...``), so
every rank gets bit-identical results, run after run. Messages larger than one chunk go through in
chunk-sized pieces; the window is never larger than ``COLLECTIVES_SHM_SLOT_BYTES`` per rank, whatever
the message size. Two barriers per chunk suffice (no barrier before a slot is reused): a slot is laid out
as ``local_size`` fixed regions, region ``q`` of rank ``p``'s slot holding p's input for slice ``q`` and
region ``p`` holding p's result; a rank rewrites its input regions only after every reader has passed
the first barrier of the same chunk, and its result region only after every rank has entered the next
chunk (so has finished copying the last one out).

Across nodes (ranks that do not share memory) the reduction is hierarchical: node-local reduce as above,
then an MPI allreduce among the node leaders (local rank 0) on the node's result, then a node barrier
after which every rank copies the global result out of the leader-written regions.

Only for dtypes NumPy reduces natively (bool, int*, uint*, float*, complex*); ``op`` is ``sum``, ``prod``,
``min``, ``max`` or ``mean`` (a sum, divided by the number of ranks as each rank writes the result slices
into its own buffer, so the division costs no pass of its own; every rank divides the same sums, so the
results stay bit-identical).
``min``/``max`` only ever see integers here: floats reach every transport as ordered integers
(``collectives._reduction``).

Made lazily, collectively, by :class:`~collectives._backends.mpi.MPITransport` on the first allreduce
at or above ``COLLECTIVES_SHM_THRESHOLD`` (every rank calls that allreduce, so every rank gets here).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _agree, _native
from .._dtypes import divide, wire_op
from .._errors import MismatchError

KERNELS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "mean": np.add}
_ADDS = ("sum", "mean")  # the ops whose slice a compiled pass may compute (_native.adder: float32, float64)
EXACT = ("reproducible sum", "reproducible mean")  # the sums of allreduce_exact (a kernel of every rank's data)
_OPS = (*KERNELS, *EXACT)
_KINDS = "biufc"  # NumPy reduces these natively on the host
_ALIGN = 64  # bytes: regions start on cache-line boundaries (every itemsize divides it)
MIN_SLOT_BYTES = 64 * 2**10
_HEADER = 64  # bytes after a rank's regions: what its current call is (see _check_calls)
NEVER = 2**63  # a threshold no buffer reaches


def node_communicator(comm, color: int | None = None):
    """A new communicator of the ranks of ``comm`` that share memory with this one (``COMM_TYPE_SHARED``),
    split further by ``color`` when one is given (``COLLECTIVES_SIMULATE_NODES``, tests: smaller "nodes"
    inside a real one, whose ranks still share memory). Collective; the caller frees it."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    if color is None:
        return node
    try:
        return node.Split(color, key=rank)
    finally:
        node.Free()


OSC_UCX_NOISE = "OSC UCX component priority set inside component query failed"


@contextlib.contextmanager
def _without_osc_ucx_noise(MPI):
    """Drop Open MPI 5.0's bogus ``osc_ucx_component.c: Error: OSC UCX component priority set inside
    component query failed`` line (open-mpi/ompi#14086) from what a window creation prints on stderr.

    Open MPI queries every one-sided component for each window, even a shared one that only osc/sm can
    serve; where UCX has no RMA transport (TCP-only machines, laptops, CI) osc/ucx's query prints that
    error and declines, harmlessly. Every other line the call prints still reaches stderr, after it.
    Setting ``OMPI_MCA_osc=^ucx`` would silence it too, but for every window of the process (also the
    user's own, which may need UCX), so it is left to the user (docs/backends.md).
    """
    if "Open MPI" not in MPI.Get_library_version():
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable stderr: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept, dropped = [], False
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if OSC_UCX_NOISE in line or (dropped and not line.strip()):
                    dropped = True  # the message, and the blank line Open MPI prints after it
                    continue
                kept.append(line)
                dropped = False
            if kept:
                os.write(2, "".join(kept).encode())


def _chain(ufunc):
    """The kernel of an ordinary op: the slice over every rank's data, in rank order (``res`` may not be one
    of the sources)."""
    def kernel(src, res):
        ufunc(src[0], src[1], out=res)
        for x in src[2:]:
            ufunc(res, x, out=res)
    return kernel


class Reducer:
    """Allreduce through a node-shared window. Collective to make, to use and to close (over ``comm``).

    Args:
        comm: the (private) intra-communicator to reduce over.
        slot_bytes: window bytes per rank (the smallest value any rank passes is used); a message goes
            through in pieces of about this size.
        types: NumPy dtype -> MPI datatype, for the allreduce among node leaders.
        ops: op name -> MPI op, for that allreduce (the transport's table).
        reduces: ``reduces(dtype, op)``, whether that MPI reduces the pair right (the transport's
            verdict, ``MPITransport.reduces``): across nodes, a pair it gets wrong is not taken.
        node_color: ``None`` to group ranks by shared memory (``COMM_TYPE_SHARED``); an int to split
            each such group further by this color (``COLLECTIVES_SIMULATE_NODES`` and tests use it to make
            one machine look like several nodes).
    """

    def __init__(self, comm, *, slot_bytes: int, types: dict, node_color: int | None = None, ops=None,
                 reduces=None):
        from mpi4py import MPI

        from .mpi.ops import OPERATIONS  # (here, as mpi4py: the MPI package is loaded once a Reducer is made)

        self.MPI = MPI
        self._leaders_row = OPERATIONS["allreduce"]  # the node leaders' allreduce, from its row
        rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.node = node_communicator(comm, node_color)
        self.local_rank, self.local_size = self.node.Get_rank(), self.node.Get_size()
        n = self.local_size
        smallest = _agree.Ballot({"bytes": "min"})  # (two exchanges: the chunk follows from the slot)
        slot = smallest.combine(comm, {"bytes": max(int(slot_bytes), MIN_SLOT_BYTES)})["bytes"]
        self.stride = slot // n // _ALIGN * _ALIGN  # bytes of one region
        # The chunk must be the same on every node (the leaders' allreduces must match): the smallest.
        self.chunk_bytes = smallest.combine(comm, {"bytes": self.stride * n})["bytes"]
        self.multi_node = self.size > n  # same answer on every rank: nodes partition comm
        self.leaders = None
        if self.multi_node:
            leaders = comm.Split(0 if self.local_rank == 0 else MPI.UNDEFINED, key=rank)
            self.leaders = None if leaders == MPI.COMM_NULL else leaders
        self._types = types
        ops = ops or {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
        self._mpi_ops = {**ops, "mean": ops["sum"]}
        self._mpi_reduces = reduces or (lambda dtype, op: True)
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each rank's slot in its own pages (NUMA first touch)
        try:
            with _without_osc_ucx_noise(MPI):
                self.win: MPI.Win | None = MPI.Win.Allocate_shared(self.stride * n + _HEADER, 1, info,
                                                                    comm=self.node)
        finally:
            info.Free()
        self.win.Lock_all(MPI.MODE_NOCHECK)  # one passive epoch for the window's life: load/store + Sync
        self._slots = []
        for q in range(n):
            mem, _ = self.win.Shared_query(q)
            # mpi4py's buffer has the buffer protocol; its stub declares __buffer__ only for Python >= 3.12
            self._slots.append(np.frombuffer(mem, dtype=np.uint8))  # type: ignore[call-overload]
        self._calls = [slot[self.stride * n:self.stride * n + 32].view(np.int64) for slot in self._slots]
        self._heads = [c[:3] for c in self._calls]  # (count, dtype, op) of each rank's call
        self._rank = rank
        self._regions: dict = {}  # dtype -> regions[q][p]: rank q's region p, as that dtype
        self._win_sync: Callable[[], None] | None = self.win.Sync  # None once closed
        barrier = OPERATIONS["barrier"]  # the node barriers, from the row: blocking, or non-blocking (a wait's)
        self._node_barrier: Any = barrier.method(self.node)  # (None once closed, as _win_sync)
        self._node_ibarrier: Any = barrier.method(self.node, False)
        self._wait = None  # how this call waits for a node barrier (see allreduce)

    def supports(self, dtype: np.dtype, op: str, bounded: bool = False) -> bool:
        """True if :meth:`allreduce` takes this dtype/op pair (else the caller uses MPI); with ``bounded``,
        with a ``wait`` (only where every rank is on this node: no leaders' allreduce to bound)."""
        if dtype.kind not in _KINDS or not dtype.isnative or op not in KERNELS or (bounded and self.multi_node):
            return False
        if op == "mean" and dtype.kind not in "fc":
            return False
        if not self.multi_node:
            return True  # NumPy reduces every byte on the node
        return dtype in self._types and self._mpi_reduces(dtype, wire_op(op))

    def _views(self, dtype: np.dtype):
        views = self._regions.get(dtype)
        if views is None:
            n, stride = self.local_size, self.stride
            cap = stride // dtype.itemsize
            views = [[slot[p * stride:p * stride + cap * dtype.itemsize].view(dtype) for p in range(n)]
                     for slot in self._slots]
            self._regions[dtype] = views
        return views

    def _sync(self) -> None:
        self._win_sync()  # type: ignore[misc]  # None only after close(), and a closed reducer is not used
        if self._wait is None:
            self._node_barrier()
        else:
            self._wait(self._node_ibarrier())
        self._win_sync()  # type: ignore[misc]  # as above

    def allreduce(self, buf: np.ndarray, op: str, wait=None) -> None:
        """Reduce the contiguous ``buf`` in place over every rank of ``comm``; ``op`` as in :meth:`supports`.

        Every rank must call it with the same op, dtype and size. NumPy's floating-point errors are
        ignored here whatever the caller's error state: a rank reducing a slice with ``inf - inf`` must not
        raise where the others do not (they would wait in the next barrier forever).

        ``wait``: None for MPI's blocking barriers; else a callable that completes an MPI request (or
        raises), given each node barrier as an ``MPI_Ibarrier``: the deadline transport bounds every
        wait for the other ranks that way. Only on one node (:meth:`supports` with ``bounded``).
        """
        self._wait = wait
        try:
            with np.errstate(all="ignore"):
                self._allreduce(buf, op)
        finally:
            self._wait = None

    def allreduce_many(self, bufs: list, op: str, wait=None) -> None:
        """:meth:`allreduce` of several contiguous buffers of one dtype in one pass through the window, as
        if they were one buffer end to end: the same bits as one :meth:`allreduce` per buffer (each element
        is still computed by one rank, in rank order, and divided alike for ``mean``), with the node
        barriers of one message instead of two per buffer (a tree of 66 large leaves: 16 barriers, not
        132). Each chunk gathers its pieces from the buffers into the window and scatters the results
        back, so nothing is packed first. One node only (:meth:`supports` with ``bounded``); every rank
        passes buffers of the same lengths in the same order."""
        if self.multi_node:
            raise ValueError("Reducer.allreduce_many runs on one node only (supports(..., bounded=True))")
        self._wait = wait
        try:
            with np.errstate(all="ignore"):
                if len(bufs) == 1:
                    self._allreduce(bufs[0], op)
                else:
                    self._allreduce_many([b.reshape(-1) for b in bufs], op)
        finally:
            self._wait = None

    def _allreduce_many(self, flats: list, op: str) -> None:
        dtype = flats[0].dtype
        starts = [0]
        for f in flats:
            starts.append(starts[-1] + f.shape[0])
        total = starts[-1]
        step = self.chunk_bytes // dtype.itemsize
        kernel = _chain(KERNELS[op])
        add = _native.adder(dtype) if op in _ADDS else None  # (a float sum or mean: one pass)
        divisor = float(self.size) if op == "mean" else None
        regions = self._views(dtype)
        n, p = self.local_size, self.local_rank
        if n > 1:
            self._calls[p][:] = (total, ord(dtype.kind) * 64 + dtype.itemsize, _OPS.index(op), self._rank)

        def pieces(lo, hi):  # the pieces of elements [lo, hi) of the buffers end to end: (buffer, a, b, at)
            i = bisect.bisect_right(starts, lo) - 1
            at = 0
            while lo < hi:
                f, base = flats[i], starts[i]
                b = min(hi, starts[i + 1])
                if b > lo:
                    yield f, lo - base, b - base, at
                    at += b - lo
                lo = b
                i += 1

        for lo in range(0, total, step):
            c = min(step, total - lo)
            bounds = [lo + c * q // n for q in range(n + 1)]
            if n == 1:
                if divisor is not None:
                    for f, a, b, _ in pieces(lo, lo + c):
                        divide(f[a:b], divisor, out=f[a:b])
                continue
            slot = regions[p]
            for q in range(n):  # 1: my inputs for the other ranks' slices
                if q != p:
                    for f, a, b, at in pieces(bounds[q], bounds[q + 1]):
                        slot[q][at:at + b - a] = f[a:b]
            self._sync()  # 2
            if lo == 0:
                self._check_calls()
            m = bounds[p + 1] - bounds[p]  # 3: my slice, over every rank's data, in rank order, piece by
            res = slot[p][:m]  # piece (my own input read where it lies, as allreduce reads its chunk)
            mine = list(pieces(bounds[p], bounds[p + 1]))
            for f, a, b, at in mine:
                terms = [f[a:b] if q == p else regions[q][p][at:at + b - a] for q in range(n)]
                if add is not None:  # the sum into the region and the result into the buffer: one pass
                    add(terms, res[at:at + b - a], f[a:b], divisor)
                else:
                    kernel(terms, res[at:at + b - a])
            if add is None:
                self._scatter(mine, res, divisor)  # (the region keeps the sum)
            self._sync()  # 4
            for q in range(n):  # 5: the other ranks' result slices (sums for mean: divided here)
                if q != p:
                    self._scatter(pieces(bounds[q], bounds[q + 1]), regions[q][q], divisor)

    @staticmethod
    def _scatter(pieces, part, divisor) -> None:
        for f, a, b, at in pieces:
            if divisor is None:
                f[a:b] = part[at:at + b - a]
            else:
                divide(part[at:at + b - a], divisor, out=f[a:b])

    def allreduce_exact(self, buf: np.ndarray, name: str, kernel, wait=None, src=None) -> None:
        """:meth:`allreduce` of ``buf`` whose slices are computed by ``kernel(terms, out)``: every rank's
        data of a slice at once (a list in rank order), the result written into ``out`` (the reproducible
        sums: ``_reproducible.sum_terms``, which needs every term of an element together); ``name`` (one of
        :data:`EXACT`) is what the ranks compare, as they compare an op. One node only. ``src``: this rank's
        terms where they are not ``buf`` (read, never written; the result lands in ``buf``: one copy less)."""
        if self.multi_node or name not in EXACT:
            raise ValueError(f"Reducer.allreduce_exact runs {EXACT} on one node only, got {name!r}"
                             f"{' across nodes' if self.multi_node else ''}")
        self._wait = wait
        try:
            with np.errstate(all="ignore"):
                self._allreduce(buf, name, kernel, src)
        finally:
            self._wait = None

    def _allreduce(self, buf: np.ndarray, op: str, kernel=None, src=None) -> None:
        flat = buf.reshape(-1)
        total = flat.shape[0]
        if src is not None and (self.multi_node or self.local_size == 1):  # (only a node's pass reads src
            np.copyto(flat, src.reshape(-1))  # where it lies)
            src = None
        flat_in = flat if src is None else src.reshape(-1)
        step = self.chunk_bytes // flat.dtype.itemsize
        add = None
        if kernel is None:
            kernel = _chain(KERNELS[op])
            add = _native.adder(flat.dtype) if op in _ADDS else None  # (a float sum or mean: one pass)
        divisor = float(self.size) if op == "mean" else None
        regions = self._views(flat.dtype)
        n, p = self.local_size, self.local_rank
        if n > 1:  # what this call is, for the ranks of the node to compare after the first barrier
            self._calls[p][:] = (total, ord(flat.dtype.kind) * 64 + flat.dtype.itemsize, _OPS.index(op), self._rank)
        for lo in range(0, total, step):
            chunk = flat[lo:lo + step]
            c = chunk.shape[0]
            bounds = [c * q // n for q in range(n + 1)]
            if n > 1:
                self._node_reduce(chunk, bounds, regions, kernel, None if self.multi_node else divisor, lo == 0,
                                  flat_in[lo:lo + step], add)
            if self.multi_node:
                self._across_nodes(chunk, bounds, regions, op, divisor)
            elif n > 1:
                for q in range(n):  # 5: the other ranks' result slices (sums for mean: divided here)
                    if q != p:
                        part, out = regions[q][q][:bounds[q + 1] - bounds[q]], chunk[bounds[q]:bounds[q + 1]]
                        if divisor is None:
                            out[...] = part
                        else:
                            divide(part, divisor, out=out)
            elif divisor is not None:
                divide(chunk, divisor)

    def _node_reduce(self, chunk, bounds, regions, kernel, divisor, first: bool, source=None, add=None) -> None:
        """Steps 1 to 4 of a chunk (see the class): this rank's slice of ``chunk`` reduced over every rank's
        data, read from ``source`` (default: ``chunk`` itself) and written into ``chunk``. ``add``: the
        compiled pass of a float sum or mean (``_native.adder``), the kernel's and the copy's (or the
        division's) bits in one pass."""
        n, p = self.local_size, self.local_rank
        slot = regions[p]
        source = chunk if source is None else source
        for q in range(n):  # 1: my inputs for the other ranks' slices
            if q != p:
                lo, hi = bounds[q], bounds[q + 1]
                slot[q][:hi - lo] = source[lo:hi]
        self._sync()  # 2
        if first:
            self._check_calls()
        lo, hi = bounds[p], bounds[p + 1]  # 3: my slice, over every rank's data, in rank order
        mine = chunk[lo:hi]
        res = slot[p][:hi - lo]
        terms = [source[lo:hi] if q == p else regions[q][p][:hi - lo] for q in range(n)]
        if add is not None:
            add(terms, res, mine, divisor)
        else:
            kernel(terms, res)
            if divisor is None:
                mine[...] = res
            else:  # the region keeps the sum; each rank divides while copying it out (one pass less)
                divide(res, divisor, out=mine)
        self._sync()  # 4

    def _check_calls(self) -> None:
        """After the first barrier of a call: every rank of the node has written what its call is (count,
        dtype, op: the buffer as it reaches this reducer), none has touched a result yet. Where they differ
        every rank of the node raises the same MismatchError here, its buffer untouched: a shape mismatch
        through shared memory would otherwise return wrong data or read past a buffer (the unchecked
        blocking path's large allreduces). A rank's next call rewrites its entry only after every rank has
        passed this call's last barrier, so all read the same entries. Costs a few loads: no message."""
        first = self._heads[0].tolist()
        for head in self._heads:
            if head.tolist() != first:
                break
        else:
            return
        calls = [c.tolist() for c in self._calls]
        fields = []
        for i, field in enumerate(("count", "dtype", "op")):
            values: dict[str, list[int]] = {}
            for c in calls:
                text = str(c[0]) if i == 0 else _OPS[c[2]] if i == 2 else np.dtype(f"{chr(c[1] // 64)}{c[1] % 64}").name
                values.setdefault(text, []).append(c[3])
            if len(values) > 1:
                fields.append(f"{field}: " + ", ".join(f"{v} on rank{'s' if len(r) > 1 else ''} "
                                                        f"{','.join(map(str, sorted(r)))}" for v, r in values.items()))
        raise MismatchError(f"ranks disagree about an allreduce through node-shared memory: {'; '.join(fields)} "
                            f"(the buffers as they reach it; no result was written). Every rank must pass the "
                            f"same count, dtype and op; COLLECTIVES_CHECK=1 names the calls as you made them.")

    def _across_nodes(self, chunk, bounds, regions, op, divisor) -> None:
        n = self.local_size
        if self.leaders is not None:  # a node leader: gather the node's result, reduce across leaders
            for q in range(1, n):
                chunk[bounds[q]:bounds[q + 1]] = regions[q][q][:bounds[q + 1] - bounds[q]]
            self._leaders_row.call(self.leaders, ([chunk, self._types[chunk.dtype]],), self._mpi_ops[op],
                                 in_place=self.MPI.IN_PLACE)
            if divisor is not None:
                divide(chunk, divisor)
            if n > 1:
                for q in range(n):
                    regions[q][q][:bounds[q + 1] - bounds[q]] = chunk[bounds[q]:bounds[q + 1]]
        if n > 1:
            self._sync()
            if self.leaders is None:
                for q in range(n):
                    chunk[bounds[q]:bounds[q + 1]] = regions[q][q][:bounds[q + 1] - bounds[q]]

    def close(self) -> None:
        """Free the window and the communicators. Collective over ``comm``; idempotent."""
        win, self.win = getattr(self, "win", None), None
        self._regions, self._slots = {}, []
        self._win_sync = self._node_barrier = self._node_ibarrier = None
        comms = [c for c in (getattr(self, "leaders", None), getattr(self, "node", None)) if c is not None]
        self.leaders = self.node = None
        if self.MPI.Is_finalized():
            return
        if win is not None:
            win.Unlock_all()
            win.Free()
        for c in comms:
            c.Free()

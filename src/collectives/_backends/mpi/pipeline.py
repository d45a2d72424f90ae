"""Many buffers, one broadcast: ``synchronize``'s pipeline of point-to-point messages from the root to
the other ranks of one node, and its plans (the byte stream cut into messages, the receive datatypes)."""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from ..base import HostTransport
from .ops import MESSAGES


class BroadcastPipeline(HostTransport):
    """The part of :class:`~collectives._backends.mpi.transport.MPITransport` that runs
    :meth:`broadcast_many` (the state is the transport's, set in its ``__init__``)."""

    MPI: Any
    comm: Any
    _pipeline: bool
    _pipe_ring: Any
    _pipe_plans: dict
    _pipe_typesets: dict

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
            isend, byte = MESSAGES["send"].method(comm, False), MPI.BYTE  # point-to-point rows, on self.comm
            testall, waitall = MPI.Request.Testall, MPI.Request.Waitall
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
        recv, bottom = MESSAGES["recv"].method(comm), MPI.BOTTOM
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

"""The node-shared-memory allreduce on the MPI transport (``shm``): the window made at first use on the
allreduce lane, buffers from the agreed threshold through it, several in one pass, and the asynchronous
allreduce that runs through it at the call (``allreduce_at_start``), each wait bounded where asked."""

from __future__ import annotations

from typing import Any

from ... import _config
from ..._dtypes import wire_op
from .. import shm
from ..base import HostTransport
from .ops import OPERATIONS


class SharedWindow(HostTransport):
    """The part of :class:`~collectives._backends.mpi.transport.MPITransport` that reduces through the
    node-shared window (the state is the transport's, set in its ``__init__``)."""

    _shm: Any
    _shm_threshold: int
    _lanes: dict
    _types: dict
    _ops: dict
    _node_color: Any
    _make_lane: Any
    _fingerprint: Any
    _verify: Any
    _wait_within: Any

    def reduces_on_the_callers_cpus(self) -> bool:
        """Every rank on one node: an allreduce of any size is computed by the ranks themselves, in the
        node-shared window (``shm``) from the shared-memory threshold and by MPI's own shared-memory
        transport below it, which moves a non-blocking one only inside the ranks' MPI calls."""
        return 1 < self.size == self.local_size

    def _shm_allreduce(self, buf, op, wait=None) -> bool:
        """Reduce ``buf`` through node-shared memory (``op`` may also be "mean"); False if it cannot.
        ``wait``: how to complete each node barrier (shm.Reducer.allreduce; the deadline transport's)."""
        reducer = self._reducer(wait)
        if not reducer.supports(buf.dtype, op, bounded=wait is not None):
            return False
        reducer.allreduce(buf, op, wait)
        return True

    def sums_in_one_pass(self, buf) -> bool:
        """Every rank on one node, ``buf`` from the shared-memory threshold: :meth:`allreduce_exact` takes it.
        Depends only on what every rank passes alike (the size)."""
        return buf.nbytes >= self._shm_threshold and self.reduces_on_the_callers_cpus()

    def allreduce_exact(self, buf, name, kernel, src=None) -> None:
        """``buf`` reduced through the node-shared window by ``kernel`` (``shm.Reducer.allreduce_exact``):
        with an ordinary allreduce's bytes and barriers (from ``src`` where given). Where
        :meth:`sums_in_one_pass`."""
        self._reducer().allreduce_exact(buf, name, kernel, src=src)

    def _reducer(self, wait=None) -> shm.Reducer:
        """The node-shared window, made at first use: collective, and safe where every rank is in the same
        allreduce (``wait``: as in :meth:`_shm_allreduce`)."""
        if self._shm is None:
            if wait is not None and "allreduce" not in self._lanes:  # its making bounded as this call is
                self._make_lane("allreduce", lambda what, req: wait(req))
            lane = self._lanes["allreduce"]  # made on the allreduce lane: only an allreduce can meet it
            if wait is not None:  # every rank has arrived (within the deadline) before the blocking setup
                wait(OPERATIONS["barrier"].call(lane, blocking=False))
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

    def _wait_at_start(self, what, req, keep=None) -> None:
        """A wait of :meth:`_allreduce_at_start`: bounded as :meth:`allreduce_at_start` was asked."""
        seconds, setting = self._at_start  # type: ignore[misc]  # set: only _allreduce_at_start waits here
        self._wait_within(what, req, seconds, setting, keep)

    def _bounded_shm(self, buf, op, wait, kernel=None, src=None) -> bool:
        """On one node, from the shared-memory threshold: ``buf`` reduced through the shared window, each of
        its barriers an ``MPI_Ibarrier`` completed by ``wait(what, request[, keep])`` (the window is made after a
        rendezvous of every rank waited for the same way). False where that path does not apply. The
        fingerprint of the call is reduced first (a node barrier cannot tell an allreduce of 4 elements from
        one of 8). With ``kernel``: :meth:`allreduce_exact` (from ``src`` where given), ``op`` its name."""
        if buf.nbytes < self._shm_threshold or not self.reduces_on_the_callers_cpus():
            return False
        self.usable()
        what = ("allreduce", buf, f"op={op}, node-shared memory")
        if kernel is None and self._shm is not None and not self._shm.supports(buf.dtype, op, bounded=True):
            return False
        if self.size > 1:
            req, check = self._fingerprint("allreduce", buf, wire_op(op) if kernel is None else "sum")
            wait(what, req, check)  # (the fingerprint's buffer kept with its request if it stays pending)
            self._verify(check, what)
        if kernel is None:
            return self._shm_allreduce(buf, op, lambda req: wait(what, req))
        self._reducer(lambda req: wait(what, req)).allreduce_exact(buf, op, kernel, lambda req: wait(what, req),
                                                                    src=src)
        return True

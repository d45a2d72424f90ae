"""The MPI transport with a deadline on every collective (``COLLECTIVES_TIMEOUT``): each MPI call is the
non-blocking one of its row, with its fingerprint, polled until it completes or the deadline passes."""

from __future__ import annotations

import pickle

import numpy as np

from ..._dtypes import divide, wire_op
from .ops import ALLGATHERV, OPERATIONS
from .p2p import _Receive
from .transport import MPITransport


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

    def fast_reduce(self, op, dtype):
        return None  # the same (the hot path's call is this transport's polled reduce)

    # ---- waiting ----
    def _wait(self, what, req, keep=None) -> None:
        """Wait for ``req`` under the deadline (:meth:`MPITransport._wait_within`, ``keep`` as there)."""
        self._wait_within(what, req, self.timeout, self.timeout_setting, keep)

    def _call(self, operation, *args) -> None:
        """One MPI call of ``operation`` (every blocking operation's pieces, the barrier), non-blocking with
        its fingerprint, waited under the deadline."""
        if self.failed is not None:
            self.usable()
        self._begin(operation, *args).wait()

    # ---- data: the blocking operations, whose MPI calls are the non-blocking ones waited (_call) ----
    def allreduce(self, buf, op):
        if self._bounded_shm(buf, op, self._wait):
            return
        super().allreduce(buf, op)

    def allreduce_exact(self, buf, name, kernel, src=None) -> None:
        """As the plain transport's, under the deadline: the call's fingerprint first, then each node
        barrier an ``MPI_Ibarrier`` waited under the deadline (:meth:`_bounded_shm`)."""
        self._bounded_shm(buf, name, self._wait, kernel, src)

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
        self._wait(what, req, check)
        self._verify(check, what)

        def wait(req):
            self._wait(what, req)

        reducer = self._reducer(wait)
        if not reducer.supports(dtype, op, bounded=True):
            return False  # (the same answer on every rank; each buffer then has a fingerprint of its own)
        reducer.allreduce_many(bufs, op, wait)
        return True

    def reduce(self, buf, op, root):
        if OPERATIONS["reduce"].reorders((buf, op, root)):  # Ireduce's order of complex products gives other
            # signs of zero parts than Reduce's (ops._complex_product); Iallreduce's agrees with Reduce's
            return self.allreduce(buf if self.rank == root else buf.copy(), op)
        super().reduce(buf, op, root)

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
        sizes, int64, byte = np.empty(self.size, dtype=np.int64), self.MPI.INT64_T, self.MPI.BYTE
        allgather, size = OPERATIONS["allgather"], np.array([data.size], dtype=np.int64)
        self._wait(what, allgather.call(comm, ([size, int64], [sizes, int64]), blocking=False), (size, sizes))
        table = np.empty(int(sizes.sum()), dtype=np.uint8)
        offsets = np.zeros(self.size, dtype=np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        self._wait(what, ALLGATHERV.call(comm, ([data, byte], [table, (sizes, offsets), byte]), blocking=False),
                   (data, table, sizes, offsets))
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
        bcast = OPERATIONS["broadcast"]
        self._wait(what, bcast.call(comm, ([n, self.MPI.INT64_T],), root=root, blocking=False), n)
        if self.rank != root:
            data = np.empty(int(n[0]), dtype=np.uint8)
        self._wait(what, bcast.call(comm, ([data, self.MPI.BYTE],), root=root, blocking=False), data)
        return obj if self.rank == root else pickle.loads(data.tobytes())

    def allgather_object(self, obj):
        return self._allgather_object_on(self.comm, obj, ("the agreement step (allgather of call descriptions)",
                                                          None, None))

    def broadcast_object(self, obj, root):
        return self._broadcast_object_on(self.comm, obj, root, ("broadcast of the library's metadata", None,
                                                                f"root={root}"))

    def agree_allgather(self, send, recv) -> None:
        self.usable()
        byte = self.MPI.BYTE  # on the agreement communicator (self.comm), not the allgather lane
        self._wait(("the agreement step (allgather of fingerprints)", None, None),
                   OPERATIONS["allgather"].call(self.comm, ([send, byte], [recv, byte]), blocking=False), (send, recv))

    def objects_allgather(self, obj) -> list:
        return self._allgather_object_on(self._lanes["objects"], obj, ("allgather_object", None, None))

    def objects_broadcast(self, obj, root):
        return self._broadcast_object_on(self._lanes["objects"], obj, root, ("broadcast_object", None,
                                                                             f"root={root}"))


MPITransport.deadline_kind = DeadlineMPITransport  # what split makes for a timeout (transport.py cannot import it)

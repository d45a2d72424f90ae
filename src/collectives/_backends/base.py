"""The contract every host transport fulfils.

A host transport moves *contiguous NumPy buffers* in host memory; it knows nothing about array libraries,
dtype legality or the reduction rules: the Communicator has validated the call and the reduction rules
(``_reduction``) have converted the values to a dtype the transport reduces natively
(:meth:`HostTransport.reduces`). ``op`` is one of ``"sum" "prod" "min" "max"``, and ``"mean"`` only
where a transport says it divides itself (:meth:`HostTransport.fast_call`). Floats never reach a
transport with ``min``/``max``: the rules map them to ordered integers first.

Optional capabilities, declared here with their defaults (a transport overrides what it offers):

- :meth:`fast_call`: a direct call for the hot path (default: none, the general path runs);
- :meth:`fast_blocks`: the same for ``reduce_scatter`` and ``alltoall`` (default: none);
- :attr:`can_broadcast_many` and :meth:`broadcast_many`: many buffers broadcast in one pipelined call
  (default: not offered; :meth:`broadcast_many` then broadcasts one buffer after another);
- :meth:`allreduce_fused`: several large buffers of one dtype allreduced in one pass, with the bits of
  one :meth:`allreduce` each (default: not offered; the caller reduces them one by one);
- :meth:`reduces`: which (dtype, op) pairs it reduces correctly itself (default: all but float16 where
  ``_float16`` is False).

- :meth:`reduces_on_the_callers_cpus`: whether a blocking allreduce is done by the calling processes'
  own CPUs (every rank on one node), so that starting it asynchronously cannot overlap it with anything
  (default: False);

- :meth:`start`: begin an operation and return a :class:`Request` (default: run the blocking operation
  now and return a completed request); the asynchronous collectives (``async_op=True``) use it.

Every rank must call every operation, in the same order (they are collective), except the two
point-to-point operations, :meth:`send` and :meth:`recv`, which only the two ranks concerned call. Each
point-to-point message carries a header (``collectives._p2p.header``: the element count, the bytes, the dtype's
name) so that a receiver whose buffer differs from what was sent raises a clear error
(``collectives._p2p.mismatch``) instead of truncating or reading garbage; the message is then received into a
scratch buffer and dropped, the receiver's buffer untouched and the transport usable.
"""

from __future__ import annotations

import abc

import numpy as np

from .._errors import CollectiveError
from .._handles import ABANDONED  # (the one list of what a failure left in flight, handles' and transports')

_F16 = np.dtype(np.float16)


class Request:
    """A started operation. :meth:`test` never blocks; :meth:`wait` returns once it is complete (or raises:
    a timeout, an MPI error). This one is complete from the start."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        pass


DONE = Request()
OPERATIONS = ("allreduce", "reduce", "broadcast", "allgather", "gather", "reduce_scatter", "alltoall", "send",
              "recv")
P2P_OPERATIONS = ("send", "recv")


class HostTransport(abc.ABC):
    name: str = "abstract"
    array_level = False  # host transports take NumPy buffers; device transports (device.py) take arrays
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @property
    def can_broadcast_many(self) -> bool:
        """Whether :meth:`broadcast_many` may be used (a transport that has one says when)."""
        return False
    timeout: float | None = None  # seconds a wait may last (COLLECTIVES_TIMEOUT), where the transport has one
    failed: str | None = None  # why the transport cannot be used any more (see fail), or None
    # The caller's call the engine is running right now (collectives._call.describe), set around each
    # transfer it makes; a transport that checks calls beside them (MPI's fingerprint) compares it
    caller: tuple | None = None
    checks_beside = False  # whether even its blocking calls are checked beside them (the deadline transport)
    # COLLECTIVES_CHECK_NAN: whether the engine scans the inputs of floating reductions for NaN/inf before they
    # move (collectives._finite); the same on every rank (the MPI transport agrees on it when made)
    check_nan = False
    _float16 = True

    # ---- the failed state: once failed, failed for good ----
    def fail(self, reason: str) -> None:
        """Mark the transport unusable (a timeout, a mismatch found beside a call, a job failure): every
        later operation raises :class:`CollectiveError` at once (:meth:`usable`), and the callbacks given to
        :meth:`on_failure` run once (a Communicator empties its hot-path tables). The first reason stays."""
        if self.failed is not None:
            return
        self.failed = reason
        for callback in self.__dict__.pop("_failure_callbacks", ()):
            callback()

    def on_failure(self, callback) -> None:
        """Call ``callback()`` when the transport fails (at once if it has)."""
        if self.failed is not None:
            callback()
        else:
            self.__dict__.setdefault("_failure_callbacks", []).append(callback)

    def usable(self, pending=None) -> None:
        """Raise :class:`CollectiveError` if the transport has failed (:meth:`fail`), keeping a request still
        ``pending`` on it (:meth:`abandon`)."""
        if self.failed is not None:
            if pending is not None:
                self.abandon(pending)
            raise CollectiveError(f"this communicator is unusable: {self.failed}; the job cannot continue "
                                  f"(other ranks may still be waiting in that collective)")

    def abandon(self, request) -> None:
        """Keep ``request``, left pending by a failure, and its buffers to the end of the process
        (``_handles.ABANDONED``; never on the transport, which a closed communicator lets go). A request let go
        is freed by mpi4py (``MPI_Request_free`` lets the operation run on): when the late ranks' calls
        arrive, MPI writes into memory the process has reused (it corrupted the heap of 3-rank test runs)."""
        ABANDONED.append(request)

    def reduces(self, dtype: np.dtype, op: str) -> bool:
        """True if this transport reduces ``dtype`` with ``op`` correctly itself (else the reduction rules
        widen it: float16 to float32, small integers to 64 bits)."""
        return dtype != _F16 or self._float16

    def allreduce_at_start(self, seconds: float | None, setting: str) -> None:
        """Ask that an asynchronous allreduce the ranks' own CPUs compute run at the call, bounded by
        ``seconds`` (the MPI transport's node-shared window; see ``MPITransport.allreduce_at_start``).
        Nothing to do on a transport without such a path."""
        return None

    def reduces_on_the_callers_cpus(self) -> bool:
        """True where a blocking allreduce is computed by the calling processes themselves (every rank on
        one node, in node-shared memory or MPI's own): nothing else advances a non-blocking one
        while they compute, so it would only finish later. The gradient buckets then take the blocking
        call (the same bits)."""
        return False

    def fast_call(self, op: str, dtype: np.dtype, size: int):
        """A direct callable for contiguous writable buffers of ``dtype``: ``run(buf)`` reducing with
        ``op`` in place (``"mean"`` included, divided by ``size``), or ``run(buf, root)`` for
        ``op="broadcast"``; or None to use the general operations below. Only asked for pairs that
        :meth:`reduces` accepts and that need no conversion."""
        return None

    def fast_blocks(self, operation: str, op: str | None, dtype: np.dtype, size: int):
        """A direct callable ``run(send, recv)`` for ``operation`` ``"reduce_scatter"`` (with ``op``, a
        pair that :meth:`reduces` accepts and that needs no conversion; never ``"mean"``), ``"alltoall"``
        or ``"allgather"`` (``op`` None) on contiguous buffers of ``dtype`` of any size, with the arguments
        the blocking method takes (alltoall's and allgather's in any shape of the same elements: the
        hot path passes the caller's array and the result's, ``(size, *x.shape)`` for allgather); or None
        to use that method."""
        return None

    def fast_reduce(self, op: str, dtype: np.dtype):
        """A direct callable ``run(buf, root)`` that reduces the contiguous writable ``buf`` of ``dtype`` with
        ``op`` onto ``root`` (in place there; ``buf`` left as it was elsewhere), as :meth:`reduce` does, or
        None to use that method. Only asked for pairs that :meth:`reduces` accepts and that need no
        conversion."""
        return None

    def fast_start(self, op: str, dtype: np.dtype):
        """A direct start of the non-blocking allreduce of contiguous buffers of ``dtype`` with the wire op
        ``op`` (sum, prod, min, max): ``start(buf)`` returning the :class:`Request` that
        ``start("allreduce", buf, op)`` returns, made without its general dispatch (the asynchronous hot
        path, ``_comm.call.cache_start``); or None (then :meth:`start` itself is called). Only asked for
        pairs that :meth:`reduces` accepts and that need no conversion."""
        return None

    def start(self, operation: str, *args) -> Request:
        """Begin ``operation`` (one of :data:`OPERATIONS`, with the arguments its blocking method takes)
        and return its :class:`Request`; the buffers must stay alive and untouched until it completes.
        Default: run the blocking operation now and return a completed request."""
        getattr(self, operation)(*args)
        return DONE

    # ---- point-to-point (only the two ranks concerned call these) ----
    max_tag: int = 2**31 - 1  # the largest tag a message may carry (MPI: MPI_TAG_UB)

    def send(self, buf: np.ndarray, name: str, dst: int, tag: int) -> None:
        """Send the contiguous ``buf`` (of the dtype called ``name``) to rank ``dst`` with ``tag``; returns
        once ``buf`` may be reused. Validated by the Communicator (``dst`` a rank, ``tag`` within
        :attr:`max_tag`)."""
        raise CollectiveError(f"the {self.name} transport has no point-to-point operations")

    def recv(self, buf: np.ndarray, name: str, src: int | None, tag: int, box: list) -> None:
        """Receive into the contiguous writable ``buf`` the message with ``tag`` from rank ``src`` (None:
        any rank); ``box[0]`` becomes the sender's rank. A message that does not fit (``collectives._p2p.mismatch``)
        raises that error, ``buf`` unchanged."""
        raise CollectiveError(f"the {self.name} transport has no point-to-point operations")

    def allreduce_fused(self, bufs: list, op: str) -> bool:
        """Allreduce the contiguous writable ``bufs`` (one dtype, each a direct call's buffer: ``op`` may be
        ``"mean"``) in one pass, each with the bits its own direct call (:meth:`fast_call`) would give; False
        where this transport has no such pass for them (nothing was done: the caller reduces them one by
        one). The answer depends only on what every rank passes alike (lengths, dtype, op)."""
        return False

    def sums_in_one_pass(self, buf: np.ndarray) -> bool:
        """Whether :meth:`allreduce_exact` takes ``buf``: a pass of this transport's own in which one rank
        sees every rank's data of an element at once (the node-shared window). The answer depends only on
        what every rank passes alike; where False the reproducible sums run their two collectives (the
        codes' max, the words' sum), which give the same bits."""
        return False

    def allreduce_exact(self, buf: np.ndarray, name: str, kernel, src: np.ndarray | None = None) -> None:
        """Reduce the contiguous writable ``buf`` over the ranks in place, each element computed by
        ``kernel(terms, out)`` from every rank's values of it at once (``terms``: a list in rank order);
        ``name`` says what the kernel computes ("reproducible sum" or "reproducible mean"), for the ranks to
        compare. ``src``: this rank's values where they are not ``buf``'s (contiguous, ``buf``'s dtype and
        size; read only: the result still lands in ``buf``, a copy less). Where :meth:`sums_in_one_pass`."""
        raise NotImplementedError(f"the {self.name} transport has no one-pass reduction")

    @abc.abstractmethod
    def allreduce(self, buf: np.ndarray, op: str) -> None:
        """Reduce ``buf`` across ranks, result in ``buf`` on every rank."""

    @abc.abstractmethod
    def reduce(self, buf: np.ndarray, op: str, root: int) -> None:
        """Reduce ``buf`` across ranks, result in ``buf`` on ``root``; other ranks' ``buf`` unchanged."""

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Copy root's ``buf`` into every rank's ``buf``."""

    def broadcast_many(self, bufs: list, root: int, ring_bytes: int) -> None:
        """Root's bytes into every rank's ``bufs`` (1-d contiguous uint8 arrays, the same lengths in the
        same order on every rank); ``ring_bytes`` bounds the memory a pipelined implementation adds."""
        for buf in bufs:
            self.broadcast(buf, root)

    @abc.abstractmethod
    def allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        """``recv[r]`` becomes rank r's ``send``; ``recv`` has shape ``(size, send.size)``."""

    @abc.abstractmethod
    def gather(self, send: np.ndarray, recv: np.ndarray | None, root: int) -> None:
        """On ``root``, ``recv[r]`` becomes rank r's ``send`` (``recv``: shape ``(size, send.size)``); the
        other ranks pass ``recv=None``."""

    @abc.abstractmethod
    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, op: str) -> None:
        """Reduce ``send`` across ranks; ``recv`` (``send.size // size`` elements, same dtype) becomes
        this rank's block of the result (block r: elements ``r * recv.size`` to ``(r + 1) * recv.size``).
        ``send`` is left as it was."""

    @abc.abstractmethod
    def alltoall(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Block j of ``send`` (shape ``(size, n)``, contiguous) goes to rank j; row i of ``recv`` (the same
        shape and dtype) becomes rank i's block for this rank."""

    @abc.abstractmethod
    def allgather_object(self, obj) -> list:
        """Every rank's picklable ``obj``, in rank order (used for agreement checks, not for data)."""

    @abc.abstractmethod
    def broadcast_object(self, obj, root: int):
        """Root's picklable ``obj`` on every rank (the library's own metadata)."""

    def agree_allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        """The agreement protocol's fixed-size allgather of uint8 ``send`` into ``recv`` (``(size, n)``),
        apart from the data collectives where the transport can keep it apart (MPI: its own communicator)."""
        self.allgather(send, recv)

    def objects_allgather(self, obj) -> list:
        """:func:`collectives.allgather_object`'s exchange (apart from the library's metadata where it can)."""
        return self.allgather_object(obj)

    def objects_broadcast(self, obj, root: int):
        """:func:`collectives.broadcast_object`'s exchange (apart from the library's metadata where it can)."""
        return self.broadcast_object(obj, root)

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has entered."""

    @abc.abstractmethod
    def split(self, color: int | None, key: int, timeout: float | None = None):
        """A new transport for the ranks of equal ``color``, ordered by ``(key, rank)`` (MPI_Comm_split);
        None for a rank whose ``color`` is None. Collective over this transport; the arguments were
        validated (non-negative ``color`` or None, integer ``key``, ``timeout`` None or positive seconds)
        and agreed on every rank. ``timeout``: every wait of the new transport for the other ranks is
        bounded by it (and by this one's bound, the smaller), where the transport bounds waits at all."""

    def close(self) -> None:  # noqa: B027 - optional: a transport that holds nothing keeps this no-op
        """Release what the transport holds; idempotent."""

"""The MPI operations as a table: one row per collective, from which every MPI call of it is made.

A row says which mpi4py methods run the collective (blocking and non-blocking), on which lane, how the
call's arguments become theirs (buffers first, then the op of a reduction, then the root of a rooted
call; a reduction's buffers typed by their element datatype, data movement's as raw bytes of
``MPI.BYTE``; ``MPI_IN_PLACE`` where the call is in place), and what count one call carries (which
``COLLECTIVES_MAX_COUNT`` bounds). The transport makes its blocking pieces, its non-blocking starts (and
so the deadline transport's polled calls), its hot-path closures and CUDA-aware MPI's calls from the
rows: an MPI operation's call is written here once, and adding one is adding a row (docs/architecture.md,
"How to add a collective or a transport"). So are the library's own calls: the agreement step's allgather,
the fingerprint beside each non-blocking call, the deadline transport's object collectives (with the one
row of their own, :data:`ALLGATHERV`), the shared-memory allreduce's node barriers and node leaders'
allreduce; and point-to-point messages, from the sibling table :data:`MESSAGES`. No MPI communication
method is named outside this module (tests/unit/test_mpi_calls.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from time import time_ns as _ns  # the hosts' clock: the timeline's stamps (Operation.bind)

ELEMENTS, BYTES, BYTES_PER_RANK = "elements", "bytes", "bytes per rank"  # what a row's count counts
NEVER, ALWAYS, AT_ROOT = "never", "always", "at root"  # where a row's send buffer is MPI_IN_PLACE


def _never(args: tuple) -> bool:
    return False


def _complex_product(args: tuple) -> bool:
    """A product of complex numbers: MPICH's ``Ireduce`` multiplies in another order than ``Reduce``, and
    the sign of a zero part depends on that order (tests/mpi/test_paths.py)."""
    return args[1] == "prod" and args[0].dtype.kind == "c"


class _Methods:
    """What every row has: the names of mpi4py's blocking and non-blocking method of its call."""

    blocking: str
    nonblocking: str

    def method(self, comm, blocking: bool = True) -> Callable:
        """mpi4py's bound method of this row's call on ``comm`` (its lane, or another communicator: the
        agreement communicator, the node's or the node leaders' of the shared-memory allreduce), blocking or
        non-blocking: the one place that names it."""
        return getattr(comm, self.blocking if blocking else self.nonblocking)


@dataclass(frozen=True)
class Operation(_Methods):
    """One MPI operation. Its arguments, as the transport's methods take them: ``buffers`` arrays (the
    send buffer, then the receive buffer: None on a rank that receives nothing), then the op (a name of
    ``_dtypes``, where ``reduces``), then the root (where ``rooted``)."""

    name: str  # the collective
    lane: str  # the MPI communicator it runs on (_fingerprint.LANES)
    blocking: str  # mpi4py's method of the blocking call ...
    nonblocking: str  # ... and of the non-blocking one
    buffers: int  # how many buffers it takes (0, 1: in and out, 2: send and receive)
    reduces: bool = False  # an op after the buffers, and the buffers typed by their elements' datatype
    rooted: bool = False  # a root last
    in_place: str = NEVER  # ALWAYS: MPI_IN_PLACE as the send buffer; AT_ROOT: so on root, no receive elsewhere
    counted: int = 0  # the buffer whose count one MPI call must hold ...
    unit: str = BYTES  # ... counted in its elements, bytes, or bytes per rank
    reorders: Callable[[tuple], bool] = _never  # whether the non-blocking call may give other bits than the
    # blocking one for these arguments (then the call runs blocking: MPITransport.start)

    def count(self, args: tuple, size: int) -> int:
        """The count one MPI call of these arguments carries (``size``: the ranks), 0 without buffers."""
        if not self.buffers:
            return 0
        buf = args[self.counted]
        if self.unit == ELEMENTS:
            return buf.size
        return buf.nbytes // size if self.unit == BYTES_PER_RANK else buf.nbytes

    def fits(self, args: tuple, size: int, max_count: int) -> bool:
        """Whether these arguments are one MPI call (within ``max_count``, ``COLLECTIVES_MAX_COUNT``) whose
        non-blocking form gives the blocking form's bits."""
        return self.count(args, size) <= max_count and not self.reorders(args)

    def parts(self, args: tuple) -> tuple[tuple, object, object]:
        """``(buffers, op, root)`` of the transport's arguments (op, root: None where the row has none)."""
        rest = args[self.buffers:]
        return args[:self.buffers], rest[0] if self.reduces else None, rest[-1] if self.rooted else None

    def arguments(self, specs, mop, root, rank: int, in_place) -> list:
        """mpi4py's arguments of this call on rank ``rank``: the buffer ``specs`` (``[buffer, datatype]``,
        ``[buffer, count, datatype]``, None for a receive buffer the rank lacks), ``in_place``
        (``MPI.IN_PLACE``) where the row is in place, then the MPI op ``mop`` and the ``root``."""
        if self.in_place == ALWAYS or (self.in_place == AT_ROOT and rank == root):
            mpi_args = [in_place, specs[0]]
        elif self.in_place == AT_ROOT:
            mpi_args = [specs[0], None]
        else:
            mpi_args = list(specs)
        if self.reduces:
            mpi_args.append(mop)
        if self.rooted:
            mpi_args.append(root)
        return mpi_args

    def call(self, comm, specs=(), mop=None, root=None, *, rank: int = 0, in_place=None, blocking: bool = True):
        """This row's call on ``comm`` of buffer ``specs`` already in MPI's terms (as :meth:`arguments`; ``rank``:
        this rank, where the row is in place at the root), blocking, or non-blocking (its request)."""
        return self.method(comm, blocking)(*self.arguments(specs, mop, root, rank, in_place))

    def bind_in_place(self, method, mop, in_place) -> Callable:
        """``run(buffer)``: ``method`` (this row's call, bound once: the fingerprint lane's ``Iallreduce``)
        in place on a buffer mpi4py types from its format, with the MPI op ``mop``: nothing made per call.
        For a row of one buffer, in place, with an op and no root."""
        if self.buffers != 1 or self.in_place != ALWAYS or not self.reduces or self.rooted:
            raise ValueError(f"the MPI operation {self.name} is not one buffer reduced in place")
        return lambda buf: method(in_place, buf, mop)

    def bind(self, method, datatype, mop, in_place, at: float | None, slow, rank: int = 0) -> Callable:
        """The hot path's call of this row (``fast_call``, ``fast_blocks``), made once per key: a closure
        that calls ``method`` (the lane's bound mpi4py method) on the whole buffers, typed ``datatype``,
        or ``slow`` with the same arguments where the counted buffer holds ``at`` bytes or more (None: no
        test). For the rows the hot path takes: one buffer in place, one rooted buffer, one rooted buffer
        reduced in place at the root (``rank``: this rank; elsewhere nothing is received), two buffers counted
        by the receive buffer with an op, or by the send buffer without.

        The closure of one buffer (the allreduce's and the broadcast's) has an attribute ``timed(stamp)``
        that makes the same call timed in its own frame (the timeline's hot path, ``_timeline``: no frame
        around it): ``stamp = (append, kind, seq, owner, failed)``; each call appends ``(kind, seq(owner),
        bytes or root, start, end)`` (``seq(owner)``: the call's sequence number; the hosts' clock, ns),
        and one that raises calls ``failed(start, exc)`` before the error goes on."""
        if self.buffers == 1 and self.in_place == ALWAYS and not self.rooted:
            def run(x):
                if x.nbytes >= at:
                    return slow(x)
                method(in_place, [x, datatype], mop)

            def timed_run(stamp):
                append, kind, seq, owner, failed = stamp

                def run_timed(x):
                    t0 = _ns()
                    try:
                        if (nbytes := x.nbytes) >= at:
                            slow(x)
                        else:
                            method(in_place, [x, datatype], mop)
                    except BaseException as exc:
                        failed(t0, exc)
                        raise
                    append((kind, seq(owner), nbytes, t0, _ns()))

                return run_timed

            run.timed = timed_run  # type: ignore[attr-defined]
            return run
        if self.buffers == 1 and self.in_place == NEVER and self.rooted and not self.reduces:
            if at is None:
                def run_rooted(x, root):
                    method([x, datatype], root)
            else:
                def run_rooted(x, root):
                    if x.nbytes >= at:
                        return slow(x, root)
                    method([x, datatype], root)

            def timed_rooted(stamp):
                append, kind, seq, owner, failed = stamp

                def run_rooted_timed(x, root):
                    t0 = _ns()
                    try:
                        if at is not None and x.nbytes >= at:
                            slow(x, root)
                        else:
                            method([x, datatype], root)
                    except BaseException as exc:
                        failed(t0, exc)
                        raise
                    append((kind, seq(owner), root, t0, _ns()))

                return run_rooted_timed

            run_rooted.timed = timed_rooted  # type: ignore[attr-defined]
            return run_rooted
        if self.buffers == 1 and self.in_place == AT_ROOT and self.rooted and self.reduces:
            def run_reduce(x, root):
                if x.nbytes >= at:
                    return slow(x, root)
                if root == rank:
                    method(in_place, [x, datatype], mop, root)
                else:
                    method([x, datatype], None, mop, root)

            return run_reduce
        if self.buffers == 2 and self.in_place == NEVER and not self.rooted and self.reduces and self.counted == 1:
            def run_reducing(send, recv):
                if recv.nbytes >= at:
                    return slow(send, recv)
                method([send, datatype], [recv, datatype], mop)

            return run_reducing
        if self.buffers == 2 and self.in_place == NEVER and not self.rooted and not self.reduces and not self.counted:
            def run_moving(send, recv):
                if send.nbytes >= at:
                    return slow(send, recv)
                method([send, datatype], [recv, datatype])

            return run_moving
        raise ValueError(f"the hot path has no form for the MPI operation {self.name}")


OPERATIONS = {row.name: row for row in (
    Operation("allreduce", "allreduce", "Allreduce", "Iallreduce", 1, reduces=True, in_place=ALWAYS, unit=ELEMENTS),
    Operation("reduce", "reduce", "Reduce", "Ireduce", 1, reduces=True, rooted=True, in_place=AT_ROOT,
              unit=ELEMENTS, reorders=_complex_product),
    Operation("broadcast", "broadcast", "Bcast", "Ibcast", 1, rooted=True),
    Operation("allgather", "allgather", "Allgather", "Iallgather", 2),
    Operation("gather", "gather", "Gather", "Igather", 2, rooted=True),
    Operation("reduce_scatter", "reduce_scatter", "Reduce_scatter_block", "Ireduce_scatter_block", 2,
              reduces=True, counted=1, unit=ELEMENTS),
    Operation("alltoall", "alltoall", "Alltoall", "Ialltoall", 2, unit=BYTES_PER_RANK),
    Operation("barrier", "barrier", "Barrier", "Ibarrier", 0),
)}

# The deadline transport's object collectives (no user collective: pickled bytes of every rank, each rank's
# count its own), on the communicator they are given (the agreement communicator or the objects lane).
ALLGATHERV = Operation("allgatherv", "objects", "Allgatherv", "Iallgatherv", 2)


@dataclass(frozen=True)
class Message(_Methods):
    """One point-to-point MPI call, a send or a receive. A message is two (mpi/p2p.py): its header on
    ``lane`` under the user's tag, then its data on ``data_lane`` under a tag of its own. mpi4py's
    arguments: the buffer spec, the peer's rank (or ``MPI.ANY_SOURCE``), the tag, and a receive's status
    where one is asked for."""

    name: str  # the transport's operation (base.P2P_OPERATIONS)
    lane: str  # the header's lane ...
    data_lane: str  # ... and the data's
    blocking: str  # mpi4py's method of the blocking call ...
    nonblocking: str  # ... and of the non-blocking one

    def call(self, comm, spec, peer: int, tag: int, status=None, *, blocking: bool = True):
        """This message's call on ``comm`` (its lane or data lane): blocking, or non-blocking (its request)."""
        method = self.method(comm, blocking)
        return method(spec, peer, tag) if status is None else method(spec, peer, tag, status)


MESSAGES = {row.name: row for row in (
    Message("send", "p2p", "p2p_data", "Send", "Isend"),
    Message("recv", "p2p", "p2p_data", "Recv", "Irecv"),
)}

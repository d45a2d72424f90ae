"""The MPI transport's lanes (one MPI communicator per kind of collective): a communicator duplicates only
the lanes it uses, each at its first use, and that first use is agreed, so ranks whose first calls differ
raise MismatchError on every rank instead of meeting on one duplicate.

Counted through the public way to bring a communicator (``init(comm=...)``) with an mpi4py communicator
that counts its duplications: the transport duplicates the communicator it is given, and every lane is a
duplicate of that duplicate.
"""

import contextlib
from typing import ClassVar

import numpy as np
import pytest

import collectives as coll
from support.comms import settings

MPI = pytest.importorskip("mpi4py.MPI")

EAGER = 4  # the lanes made with every transport: fingerprints, point-to-point headers and data, the lanes' parent


class Counting(MPI.Intracomm):
    """An mpi4py communicator whose duplicates (and split parts) count their duplications in ``dups``."""

    dups: ClassVar[list[int]] = [0]

    def Dup(self, *args, **kwargs):
        self.dups[0] += 1
        return Counting(super().Dup(*args, **kwargs))

    def Idup(self, *args, **kwargs):
        self.dups[0] += 1
        new, request = super().Idup(*args, **kwargs)
        return Counting(new), request

    def Split(self, *args, **kwargs):
        return Counting(super().Split(*args, **kwargs))


@contextlib.contextmanager
def counted(**env):
    """A new communicator of every rank, made with these settings over a counting duplicate of the world;
    yields (communicator, the count list)."""
    user = Counting(MPI.COMM_WORLD.Dup())
    Counting.dups[0] = 0
    with settings(**env):
        c = coll.init(comm=user)
    try:
        yield c, Counting.dups
    finally:
        c.close()
        user.Free()


MODES = {"plain": {}, "deadline": {"COLLECTIVES_TIMEOUT": 60}}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_communicator_duplicates_only_the_lanes_it_uses(comm, mode):
    with counted(**MODES[mode]) as (c, dups):
        assert dups[0] == 1 + EAGER  # its own duplicate and the eager lanes (before: 1 + 12 lanes)
        x = np.ones(4)
        c.allreduce(x, "sum")
        assert x.tolist() == [c.size] * 4 and dups[0] == 1 + EAGER + 1  # the allreduce lane
        c.allreduce(x, "sum")
        c.allreduce(x, "sum", async_op=True).wait()
        assert dups[0] == 1 + EAGER + 1  # made once, for every form of the call
        c.barrier()
        assert dups[0] == 1 + EAGER + 2
        dups[0] = 0
        sub = c.split(0, key=c.rank)  # a split: its own duplicate and the eager lanes only
        try:
            assert dups[0] == 1 + EAGER
            assert sub.allgather(np.array([c.rank]))[:, 0].tolist() == list(range(c.size))
            assert dups[0] == 1 + EAGER + 1
        finally:
            sub.close()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_first_calls_of_every_kind_agree(comm, mode):
    """Every kind's first call on a new communicator, one after another, each making its lane (every rank
    at the same call): the results are the library's."""
    with counted(**MODES[mode]) as (c, dups):
        r, n = c.rank, c.size
        assert c.broadcast(np.array([r, r]), root=n - 1).tolist() == [n - 1] * 2
        assert c.reduce(np.array([1.0]), "sum", root=0).tolist() == ([float(n)] if r == 0 else [1.0])
        assert c.allgather(np.array([r]))[:, 0].tolist() == list(range(n))
        gathered = c.gather(np.array([r]), root=0)
        assert gathered is None if r else gathered[:, 0].tolist() == list(range(n))
        assert c.reduce_scatter(np.ones(n), "sum").tolist() == [float(n)]
        assert c.alltoall(np.arange(n) + 10 * r).tolist() == [10 * q + r for q in range(n)]
        c.barrier()
        assert c.allgather_object(r) == list(range(n))
        assert c.allreduce(np.ones(2), "max", async_op=True).wait().tolist() == [1.0, 1.0]
        assert dups[0] == 1 + EAGER + 9  # the eight collectives' lanes and the objects' lane


@pytest.mark.skipif("coll.world().size < 2", reason="a mismatch needs two ranks")
@pytest.mark.parametrize("mode", sorted(MODES))
def test_different_first_calls_raise_on_every_rank(comm, mode):
    """The last rank's first call is a barrier, the others' an allreduce, unchecked and blocking: each
    would make its own lane, and the two duplications would be one communicator. Agreed first, every rank
    raises MismatchError naming both (before: a hang on the plain transport), and nothing is duplicated."""
    with counted(**MODES[mode]) as (c, dups):
        last = c.rank == c.size - 1
        with pytest.raises(coll.MismatchError, match="different collectives") as info:
            if last:
                c.barrier()
            else:
                c.allreduce(np.ones(3), "sum")
        assert "allreduce and barrier" in str(info.value) or "barrier and allreduce" in str(info.value)
        assert dups[0] == 1 + EAGER
        with pytest.raises(coll.CollectiveError, match="unusable"):
            c.allreduce(np.ones(2), "sum")
    comm.barrier()


@pytest.mark.skipif("coll.world().size < 2", reason="a mismatch needs two ranks")
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_first_call_against_a_known_kind_raises_on_every_rank(comm, mode):
    """Every rank has its allreduce lane; then the last rank's call is a broadcast (its first) and the
    others' an allreduce (on the lane they have), fingerprinted (deadline: every call; plain: async_op).
    The making of the broadcast lane meets the allreduce's fingerprint: MismatchError on every rank."""
    with counted(**MODES[mode]) as (c, _dups):
        c.allreduce(np.ones(3), "sum")
        wait = mode == "plain"
        x = np.ones(3)
        with pytest.raises(coll.MismatchError, match="different collectives"):
            if c.rank == c.size - 1:
                h = c.broadcast(x, root=0, async_op=wait)
            else:
                h = c.allreduce(x, "sum", async_op=wait)
            if wait:
                h.wait()
        if c.rank == c.size - 1:
            assert x.tolist() == [1.0] * 3  # its broadcast never started: it waited for its lane
    comm.barrier()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_first_non_blocking_call_does_not_block(comm, mode):
    """Starting a kind's first non-blocking call returns at once, as MPI's non-blocking calls do (its lane
    is made when it is tested or waited for): rank 0 starts an allreduce, then sends to rank 1, which
    starts its allreduce only after receiving. Had the start made the lane (a collective), rank 0 would
    wait there for rank 1, and rank 1 in its receive for rank 0."""
    with counted(**MODES[mode]) as (c, dups):
        x = np.full(4, float(c.rank + 1))
        note = np.zeros(1)
        if c.rank == 0:
            h = c.allreduce(x, "sum", async_op=True)
            for dst in range(1, c.size):
                c.send(np.ones(1), dst)
        else:
            c.recv(note, 0)
            h = c.allreduce(x, "sum", async_op=True)
        assert h.wait().tolist() == [c.size * (c.size + 1) / 2] * 4
        assert c.rank == 0 or note.tolist() == [1.0]
        y = np.ones(2)
        assert c.allreduce(y, "sum", async_op=True).wait().tolist() == [c.size] * 2  # on the lane made
        assert dups[0] == 1 + EAGER + 1

"""Communicator.split at any world size: uneven colours, None, key order, nested splits, collectives on
several sub-communicators interleaved, invalid arguments on one rank, settings inherited."""

import time

import numpy as np
import pytest

import collectives as coll
from support.comms import communicator, gather_objects


def members(color_of, size):
    return {c: [r for r in range(size) if color_of(r) == c] for c in {color_of(r) for r in range(size)}}


def test_uneven_colours_and_ranks(comm):
    color_of = lambda r: 0 if r == 0 else 1  # sizes 1 and size - 1
    sub = comm.split(color_of(comm.rank), key=0)
    group = members(color_of, comm.size)[color_of(comm.rank)]
    try:
        assert sub.size == len(group) and sub.rank == group.index(comm.rank)
        assert sub.backend == comm.backend and sub is not comm
        x = np.array([float(comm.rank)])
        assert sub.allreduce(x, "sum").tolist() == [float(sum(group))]
        assert sub.allgather_object(comm.rank) == group
    finally:
        sub.close()
    assert sub.closed
    with pytest.raises(coll.BackendUnavailableError):
        sub.allreduce(np.ones(1))
    sub.close()  # idempotent


def test_key_orders_the_ranks(comm):
    sub = comm.split(7, key=-comm.rank)  # reversed
    try:
        assert sub.rank == comm.size - 1 - comm.rank
        assert sub.allgather_object(comm.rank) == list(reversed(range(comm.size)))
        assert sub.broadcast_object(comm.rank, root=0) == comm.size - 1
    finally:
        sub.close()


def test_none_is_not_a_member(comm):
    color = None if comm.rank == 0 else 3
    sub = comm.split(color)
    if comm.rank == 0:
        assert sub is None
    else:
        try:
            assert sub.size == comm.size - 1 and sub.rank == comm.rank - 1
            assert sub.allgather_object(comm.rank) == list(range(1, comm.size))
        finally:
            sub.close()
    everybody_none = comm.split(None)
    assert everybody_none is None
    comm.barrier()


def test_nested_splits_and_interleaved_collectives(comm):
    halves = comm.split(comm.rank % 2, key=comm.rank)
    single = comm.split(comm.rank)  # one communicator per rank
    quarter = halves.split(halves.rank % 2)
    try:
        assert single.size == 1 and single.rank == 0
        a = np.full(4, float(comm.rank + 1))
        b = np.full(4, float(comm.rank + 1))
        c = np.full(halves.size * 2, comm.rank, dtype=np.int64)
        halves.allreduce(a, "sum")  # interleaved: halves, the world, the single, the nested
        world_sum = comm.allreduce(np.array([comm.rank]), "sum")
        single.allreduce(b, "sum")
        rs = halves.reduce_scatter(c, "sum")
        q = quarter.allgather_object(comm.rank)
        group = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
        assert (a == sum(r + 1 for r in group)).all() and (b == comm.rank + 1).all()
        assert world_sum.tolist() == [comm.size * (comm.size - 1) // 2]
        assert rs.tolist() == [sum(group)] * 2
        assert q == [g for i, g in enumerate(group) if i % 2 == halves.rank % 2]
        seen = gather_objects((comm.rank % 2, halves.rank, quarter.size))
        assert sorted(r for p, r, _ in seen if p == comm.rank % 2) == list(range(halves.size))
    finally:
        quarter.close()
        single.close()
        halves.close()


def test_parent_close_closes_its_subs(comm):
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend")
    with communicator() as parent:
        sub = parent.split(0)
        inner = sub.split(0)
    assert parent.closed and sub.closed and inner.closed


@pytest.mark.parametrize("color,key,error,match", [
    ("red", 0, TypeError, "color must be a non-negative integer or None"),
    (True, 0, TypeError, "color must be"),
    (-1, 0, ValueError, "non-negative"),
    (0, 1.5, TypeError, "key must be an integer"),
    (0, 2**40, ValueError, "key must fit"),
    (0, 0, TypeError, "timeout must be a number of seconds"),
    (0, 0, ValueError, "timeout must be a positive, finite"),
])
def test_invalid_arguments_on_one_rank(comm, color, key, error, match):
    bad = comm.size - 1
    timeout = {"timeout must be a number of seconds": "10", "timeout must be a positive, finite": float("inf")}.get(match)
    if comm.rank == bad:
        with pytest.raises(error, match=match):
            comm.split(color, key, timeout=timeout)
    else:
        with pytest.raises(coll.MismatchError, match=f"split refused by rank {bad}"):
            comm.split(0, 0)
    comm.barrier()  # nobody is left in MPI_Comm_split


def test_settings_inherited(comm):
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend")
    with communicator(COLLECTIVES_TIMEOUT=300) as d:
        d.check = True
        sub = d.split(0)
        try:
            assert sub.check
            assert type(sub._host).__name__ == "DeadlineMPITransport"  # no public name tells the transport
            assert sub._host.timeout == 300
            if comm.size > 1:
                with pytest.raises(coll.MismatchError):
                    sub.allreduce(np.ones(2 if comm.rank else 3))
            assert sub.allreduce(np.ones(2)).tolist() == [comm.size] * 2
        finally:
            sub.close()


def test_a_timeout_bounds_every_wait_of_the_new_communicator(comm):
    """split(timeout=): a deadline communicator (blocking calls included), bounded by the smaller of its
    timeout and the parent's; a rank whose peers never call raises CollectiveTimeoutError, and the
    communicator stays failed."""
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend")
    with communicator(COLLECTIVES_TIMEOUT=300) as d:
        tighter, looser = d.split(0, timeout=5), d.split(0, timeout=900)
        try:
            # no public name tells the bound: read on the transport
            assert (tighter._host.timeout, looser._host.timeout) == (5, 300)
        finally:
            tighter.close()
            looser.close()
    sub = comm.split(0, timeout=0.5)
    try:
        x = np.ones(3)
        assert sub.allreduce(x).tolist() == [comm.size] * 3  # agreeing ranks: as any communicator
        if comm.size > 1:
            if comm.rank == 0:
                t0 = time.monotonic()
                with pytest.raises(coll.CollectiveTimeoutError, match="timeout=0.5"):
                    sub.allreduce(x)  # blocking: the others never call it
                assert time.monotonic() - t0 < 10
                with pytest.raises(coll.CollectiveError):
                    sub.allreduce(x)  # failed for good
            comm.barrier()
    finally:
        sub.close()  # (on rank 0, failed: released without freeing what a pending request may use)

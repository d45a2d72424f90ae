"""Point-to-point through the torch.distributed backend "collectives" at any world size: dist.send/recv,
isend/irecv, recv from any source (the sender's global rank), tags, batch_isend_irecv, sends to the rank
itself, groups (group ranks), a tensor that does not fit (an error on the receiver, the group usable),
and the group's timeout= on a receive nobody sends to."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

import collectives as coll

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


@pytest.fixture(scope="module")
def pg(comm):
    import collectives.torch_backend  # noqa: F401 - registers the backend

    dist.init_process_group("collectives")
    yield dist.distributed_c10d._get_default_group()
    dist.destroy_process_group()


def neighbours():
    r, n = dist.get_rank(), dist.get_world_size()
    return (r + 1) % n, (r - 1) % n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.complex64, torch.bool])
def test_ring_of_isend_and_recv(pg, dtype):
    right, left = neighbours()
    mine = (torch.arange(6) + 10 * dist.get_rank()).to(dtype)
    got = torch.zeros(6, dtype=dtype)
    w = dist.isend(mine, right)
    assert dist.recv(got, left) == left
    w.wait()
    assert torch.equal(got, (torch.arange(6) + 10 * left).to(dtype))


def test_recv_from_any_source_returns_the_sender(pg):
    """dist.recv without src: the sender's rank (torch refuses a message from the rank itself there); an
    any-source irecv's Work tells its sender by source_rank(), the rank itself included."""
    r, n = dist.get_rank(), dist.get_world_size()
    w = dist.isend(torch.full((2,), float(r)), 0, tag=4) if r else None
    if r == 0:
        seen = []
        for _ in range(n - 1):
            t = torch.empty(2)
            src = dist.recv(t, tag=4)  # src=None: recv_anysource
            assert (t == src).all()
            seen.append(src)
        assert sorted(seen) == list(range(1, n))
        t = torch.empty(2)
        w2 = dist.isend(torch.full((2,), 5.0), 0, tag=5)
        work = dist.irecv(t, tag=5)
        work.wait()
        assert work._source_rank() == 0 and (t == 5).all()
        w2.wait()
    if w is not None:
        w.wait()
    dist.barrier()


def test_tags_and_batch_isend_irecv(pg):
    """batch_isend_irecv with tags in both directions of the ring, the receives listed first; then
    messages of two tags received in the other order."""
    right, left = neighbours()
    r = dist.get_rank()
    from_left, from_right = torch.empty(3), torch.empty(3)
    ops = [dist.P2POp(dist.irecv, from_left, left, tag=1), dist.P2POp(dist.irecv, from_right, right, tag=2),
           dist.P2POp(dist.isend, torch.full((3,), float(r)), right, tag=1),
           dist.P2POp(dist.isend, torch.full((3,), -float(r)), left, tag=2)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert (from_left == left).all() and (from_right == -right).all()
    ws = [dist.isend(torch.full((1,), float(tag)), right, tag=tag) for tag in (7, 8)]
    for tag in (8, 7):
        t = torch.empty(1)
        dist.recv(t, left, tag=tag)
        assert t.item() == tag
    for w in ws:
        w.wait()


def test_isend_to_itself_and_blocking_send_refused(pg):
    r = dist.get_rank()
    t = torch.empty(4)
    w = dist.isend(torch.arange(4.0), r)
    dist.irecv(t, r).wait()
    w.wait()
    assert torch.equal(t, torch.arange(4.0))
    with pytest.raises(ValueError, match="destination"):  # torch's own rule, before the backend
        dist.send(t, r)


def test_group_ranks(pg, comm):
    """On a group of every rank, sends by group rank (group_dst), an any-source recv returning the global
    rank."""
    n = comm.size
    group = dist.new_group(list(range(n)))
    right, left = neighbours()
    w = dist.isend(torch.full((2,), float(dist.get_rank())), group=group, group_dst=dist.get_group_rank(group, right))
    t = torch.empty(2)
    if n > 1:
        assert dist.recv(t, group=group) == left  # a global rank
    else:  # (torch's recv refuses an any-source message from the rank itself; irecv takes it)
        work = dist.irecv(t, group=group)
        work.wait()
        assert work._source_rank() == dist.get_group_rank(group, left)
    assert (t == left).all()
    w.wait()
    dist.destroy_process_group(group)


def test_a_tensor_that_does_not_fit_is_an_error_on_the_receiver(pg):
    right, left = neighbours()
    w = dist.isend(torch.ones(5), right, tag=9)
    t = torch.full((4,), -1.0)
    with pytest.raises(ValueError, match="5 x float32"):
        dist.recv(t, left, tag=9)
    assert (t == -1).all()
    w.wait()
    w = dist.isend(torch.ones(4, dtype=torch.float64), right, tag=9)
    with pytest.raises(TypeError, match="float64"):
        dist.irecv(torch.empty(8), left, tag=9).wait()
    w.wait()
    w = dist.isend(torch.ones(4), right, tag=9)  # the group is usable
    assert dist.recv(t, left, tag=9) == left and (t == 1).all()
    w.wait()


@pytest.mark.skipif("coll.world().size < 2", reason="a receive that times out needs a rank that does not send")
def test_group_timeout_bounds_a_receive(comm):
    """A receive nobody sends to: Work.wait() raises CollectiveTimeoutError after the group's timeout=;
    the group is then failed (every later operation raises at the call)."""
    import collectives.torch_backend as ctb
    from support.comms import communicator

    with communicator() as d:  # a communicator of its own: the unmatched receive must not disturb the others
        group = ctb.ProcessGroupCollectives(d, timeout=timedelta(seconds=0.3))
        if d.rank == 0:
            t0 = time.monotonic()
            with pytest.raises(coll.CollectiveTimeoutError, match="0.3 s"):
                group.recv([torch.empty(2)], 1, 3).wait()
            assert time.monotonic() - t0 < 10
            with pytest.raises(coll.CollectiveError, match="unusable"):
                group.send([torch.empty(2)], 1, 0)
        comm.barrier()
        if d.rank == 1:  # the message, late: rank 0's abandoned receive takes it (nothing left pending)
            group.send([torch.ones(2)], 0, 3).wait()
        comm.barrier()

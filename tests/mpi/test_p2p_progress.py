"""Point-to-point in any wait order (issue 32): what completes with plain MPI completes here.

A receive posts the receive of its data only once its header has arrived (it learns the sender, the
data's tag and whether the message fits from it); every wait and test of the transport moves every pending
receive on, so a rank waiting for its own send (whose data needs the peer's receive posted) never stops its
peer's send. Ring and halo exchanges of 8 B to 64 MiB (past MPI's eager limit: rendezvous), every wait
order of their handles, receive-first and send-first, asynchronous receives with blocking sends and the
reverse, on the plain and the deadline transport, and through the torch backend's ``batch_isend_irecv``.
Size-agnostic: at one rank the ring is a rank sending to itself (asynchronously).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import collectives as coll
from support.comms import communicator

pytestmark = pytest.mark.skipif(coll.world().backend != "mpi", reason="needs the MPI backend")

SIZES = [8, 1 << 16, 4 << 20, 64 << 20]  # bytes


def payload(nbytes: int, rank: int, tag: int) -> np.ndarray:
    return (np.arange(max(1, nbytes // 8), dtype=np.int64) * 7 + rank * 1000 + tag)


@pytest.fixture(scope="module", params=["plain", "deadline"])
def c(request, comm):
    with communicator(**({"COLLECTIVES_TIMEOUT": 120} if request.param == "deadline" else {})) as made:
        yield made


def exchange(c, nbytes: int, order, first: str):
    """Ring: send to the right, receive from the left; both started (``first`` first), waited in ``order``."""
    right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    out, into = payload(nbytes, c.rank, 1), np.zeros(max(1, nbytes // 8), np.int64)
    start = {"send": lambda: c.send(out, right, tag=1, async_op=True),
             "recv": lambda: c.recv(into, left, tag=1, async_op=True)}
    handles = {}
    for what in (first, "recv" if first == "send" else "send"):
        handles[what] = start[what]()
    for what in order:
        handles[what].wait()
    assert np.array_equal(into, payload(nbytes, left, 1))


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("first", ["send", "recv"])
@pytest.mark.parametrize("order", [("send", "recv"), ("recv", "send")])
def test_ring_in_every_wait_order(c, nbytes, first, order):
    exchange(c, nbytes, order, first)


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("blocking", ["send", "recv"])
def test_an_asynchronous_one_with_a_blocking_other(c, nbytes, blocking):
    if c.size == 1:
        pytest.skip("a blocking send to this rank itself is refused (it could not complete)")
    right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    out, into = payload(nbytes, c.rank, 2), np.zeros(max(1, nbytes // 8), np.int64)
    if blocking == "send":  # every rank: recv(async), then a blocking send (MPI: Irecv, Send completes)
        h = c.recv(into, left, tag=2, async_op=True)
        c.send(out, right, tag=2)
    else:  # every rank: send(async), then a blocking recv
        h = c.send(out, right, tag=2, async_op=True)
        c.recv(into, left, tag=2)
    h.wait()
    assert np.array_equal(into, payload(nbytes, left, 2))


@pytest.mark.parametrize("nbytes", [8, 4 << 20])
@pytest.mark.parametrize("perm", list(itertools.permutations(range(4))))
def test_halo_in_every_wait_order(c, nbytes, perm):
    """Two sends and two receives per rank, waited in each of the 24 orders (the same on every rank), and
    in a rank-dependent order too."""
    right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    n = max(1, nbytes // 8)
    from_left, from_right = np.zeros(n, np.int64), np.zeros(n, np.int64)
    handles = [c.send(payload(nbytes, c.rank, 3), right, tag=3, async_op=True),
               c.send(payload(nbytes, c.rank, 4), left, tag=4, async_op=True),
               c.recv(from_left, left, tag=3, async_op=True),
               c.recv(from_right, right, tag=4, async_op=True)]
    order = perm if c.rank % 2 == 0 else perm[::-1]
    for i in order:
        handles[i].wait()
    assert np.array_equal(from_left, payload(nbytes, left, 3))
    assert np.array_equal(from_right, payload(nbytes, right, 4))


def test_a_collectives_wait_moves_a_pending_receive_on(c):
    """A rank waits for an asynchronous allreduce while its receive's peer waits for its send."""
    if c.size == 1:
        pytest.skip("needs two ranks")
    right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    nbytes = 16 << 20
    into = np.zeros(nbytes // 8, np.int64)
    r = c.recv(into, left, tag=5, async_op=True)
    s = c.send(payload(nbytes, c.rank, 5), right, tag=5, async_op=True)
    a = c.allreduce(np.ones(4), "sum", async_op=True)
    s.wait()  # the peer's send can complete only while this rank's receive posts its data
    assert a.wait().tolist() == [c.size] * 4
    r.wait()
    assert np.array_equal(into, payload(nbytes, left, 5))


def test_done_moves_every_pending_receive_on(c):
    """Polling one handle's done() completes an exchange whose other handles are never polled."""
    right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    nbytes = 8 << 20
    into = np.zeros(nbytes // 8, np.int64)
    r = c.recv(into, left, tag=6, async_op=True)
    s = c.send(payload(nbytes, c.rank, 6), right, tag=6, async_op=True)
    from collectives._poll import poll

    assert poll(s.done, 60.0), "the send never completed while only its own done() was polled"
    r.wait()
    assert np.array_equal(into, payload(nbytes, left, 6))


def test_torch_batch_isend_irecv_completes_by_design(comm):
    torch = pytest.importorskip("torch")
    import collectives.torch_backend as ctb

    if comm.size == 1:
        pytest.skip("needs two ranks")
    with communicator() as c:
        pg = ctb.ProcessGroupCollectives(c)
        right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
        n = (16 << 20) // 4
        out, into = torch.full((n,), float(c.rank)), torch.zeros(n)
        works = [pg.send([out], right, 7), pg.recv([into], left, 7)]
        for w in works:  # the send first: completes only because its wait moves the receive on
            w.wait()
        assert bool((into == float(left)).all())

"""Point-to-point (coll.send / coll.recv) at any world size: ring exchanges of every kind of dtype, any-source
receives, tags and message order, a message that does not fit its buffer (an error on the receiver, the
buffer untouched, the communicator usable), validation before anything is sent, the deadline, the
asynchronous forms, and the flight recorder's records."""

import time

import numpy as np
import pytest

import collectives as coll
from support.comms import communicator, gather_objects


def neighbours(c):
    return (c.rank + 1) % c.size, (c.rank - 1) % c.size


def ring(c, send, recv, tag=0):
    """Send ``send`` to the right, receive ``recv`` from the left (asynchronous send: no deadlock at any
    size, 1 included); the sender's rank."""
    right, left = neighbours(c)
    h = c.send(send, right, tag, async_op=True)
    got = c.recv(recv, left, tag)
    assert h.wait() is None
    return got


@pytest.mark.parametrize("dtype", ["int8", "uint64", "float16", "float32", "float64", "longdouble", "complex128",
                                   "bool"])
def test_ring_moves_every_dtype_bit_for_bit(c, dtype):
    left = neighbours(c)[1]
    rng = np.random.default_rng(c.rank)
    x = (rng.random((3, 5)) * 100 - 50).astype(dtype)
    if np.dtype(dtype).kind == "f":
        x.reshape(-1)[:3] = [np.nan, -0.0, np.inf]
    y = np.zeros_like(x)
    assert ring(c, x, y) == left
    want = gather_objects(x.tobytes())[left] if c.backend == "mpi" else x.tobytes()
    assert y.tobytes() == want


def test_views_tensors_and_empty_arrays(c):
    torch = pytest.importorskip("torch")
    left = neighbours(c)[1]
    # a non-contiguous send view; a non-contiguous receive view (only its elements change)
    base = np.arange(24, dtype=np.int32).reshape(4, 6) + 100 * c.rank
    out = np.full((4, 6), -1, dtype=np.int32)
    assert ring(c, base[:, ::2], out[:, 1::2]) == left
    assert (out[:, 1::2] == np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2] + 100 * left).all()
    assert (out[:, ::2] == -1).all()
    # torch tensors, also bfloat16 and a tensor that requires grad (received as under no_grad)
    t = torch.arange(6, dtype=torch.bfloat16) + c.rank
    r = torch.zeros(6, dtype=torch.bfloat16)
    assert ring(c, t, r) == left and torch.equal(r, torch.arange(6, dtype=torch.bfloat16) + left)
    w = torch.zeros(3, requires_grad=True)
    assert ring(c, torch.full((3,), float(c.rank)), w) == left and torch.equal(w.detach(), torch.full((3,), float(left)))
    # an empty array, and a different shape of the same number of elements
    assert ring(c, np.empty(0), np.empty((0, 3))) == left
    z = np.empty((2, 3))
    ring(c, np.arange(6.0) * c.rank, z)
    assert z.reshape(-1).tolist() == (np.arange(6.0) * left).tolist()


def test_any_source_receives_every_sender(c):
    """Every rank sends to rank 0 (itself too, asynchronously); rank 0 receives from any rank and learns
    each sender from the returned rank."""
    h = c.send(np.array([c.rank, 7 * c.rank], dtype=np.int64), 0, tag=3, async_op=True)
    if c.rank == 0:
        seen = set()
        for _ in range(c.size):
            x = np.empty(2, dtype=np.int64)
            source = c.recv(x, None, tag=3)
            assert x.tolist() == [source, 7 * source]
            seen.add(source)
        assert seen == set(range(c.size))
    h.wait()
    c.barrier()


def test_tags_select_messages_and_one_tag_keeps_order(c):
    right, left = neighbours(c)
    hs = [c.send(np.array([float(tag), k]), right, tag, async_op=True) for k in range(3) for tag in (1, 2)]
    got = {1: [], 2: []}
    for tag in (2, 1):  # the other tag first: tags select, whatever the order they were sent in
        for _ in range(3):
            x = np.empty(2)
            assert c.recv(x, left, tag) == left
            got[tag].append(x.tolist())
    assert got == {tag: [[float(tag), float(k)] for k in range(3)] for tag in (1, 2)}  # in the order sent
    for h in hs:
        h.wait()


def test_asynchronous_receives_waited_in_any_order(c):
    right, left = neighbours(c)
    outs = [np.empty(1000) for _ in range(5)]
    recvs = [c.recv(o, left, 4, async_op=True) for o in outs]  # posted before anything is sent
    assert all(isinstance(h.done(), bool) for h in recvs)  # never blocks
    sends = [c.send(np.full(1000, 10.0 * c.rank + k), right, 4, async_op=True) for k in range(5)]
    for k in reversed(range(5)):
        assert recvs[k].wait() == left
        assert (outs[k] == 10.0 * left + k).all()
        assert recvs[k].done() and recvs[k].wait() == left  # again: the same
    for h in sends:
        h.wait()


def test_more_receives_posted_first_than_handles_are_kept(c):
    """Past the 64 asynchronous calls a communicator keeps in flight it completes the oldest collective,
    never a receive (its message comes with a later call of the peer): 80 receives, then the sends."""
    right, left = neighbours(c)
    outs = [np.empty(2) for _ in range(80)]
    recvs = [c.recv(o, left, 13, async_op=True) for o in outs]
    sends = [c.send(np.array([float(c.rank), k]), right, 13, async_op=True) for k in range(80)]
    assert [h.wait() for h in recvs] == [left] * 80
    assert all(o.tolist() == [float(left), k] for k, o in enumerate(outs))
    for h in sends:
        h.wait()


def test_any_source_asynchronous_from_the_left(c):
    right, left = neighbours(c)
    x = np.empty(4)
    h = c.recv(x, None, 11, async_op=True)
    s = c.send(np.full(4, float(c.rank)), right, 11, async_op=True)
    assert h.wait() == left and (x == left).all()
    s.wait()


def test_a_message_that_does_not_fit_is_an_error_on_the_receiver(c):
    """Another size: ValueError; another dtype of the same bytes: TypeError; the buffer unchanged, never
    truncated, and the communicator usable afterwards (the next exchange is right)."""
    right, left = neighbours(c)
    for sent, buf, error in ((np.arange(5.0), np.full(4, -1.0), ValueError),
                             (np.arange(4.0), np.full(8, -1.0, dtype=np.float32), TypeError),
                             (np.arange(4, dtype=np.int64), np.full(3, -1, dtype=np.int64), ValueError)):
        h = c.send(sent, right, 6, async_op=True)
        before = buf.copy()
        with pytest.raises(error, match=f"rank {left} sent {sent.size} x {sent.dtype}"):
            c.recv(buf, left, 6)
        assert buf.tobytes() == before.tobytes()
        h.wait()
        a = c.recv(buf, left, 6, async_op=True)  # the asynchronous form: raised by wait()
        h = c.send(sent, right, 6, async_op=True)
        with pytest.raises(error, match="does not fit|received and dropped"):
            a.wait()
        assert buf.tobytes() == before.tobytes()
        h.wait()
    y = np.empty(3)
    assert ring(c, np.full(3, float(c.rank)), y, tag=6) == left and (y == left).all()


def test_invalid_calls_are_refused_before_anything_is_sent(c):
    x = np.ones(3)
    for call, error, words in (
        (lambda: c.send(x, c.size), ValueError, "out of range"),
        (lambda: c.send(x, -1), ValueError, "out of range"),
        (lambda: c.send(x, True), TypeError, "integer rank"),
        (lambda: c.send(x, None), TypeError, "integer rank"),
        (lambda: c.recv(x, 1.0), TypeError, "integer rank or None"),
        (lambda: c.send(x, 0, tag=-1), ValueError, "tag=-1"),
        (lambda: c.recv(x, 0, tag=2**62), ValueError, "tag="),
        (lambda: c.send(x, 0, tag="a"), TypeError, "tag must be an integer"),
        (lambda: c.send([1.0, 2.0], 0, async_op=True), TypeError, "list"),
        (lambda: c.send(x, c.rank), ValueError, "blocking send to itself"),
    ):
        with pytest.raises(error, match=words):
            call()
    ro = np.ones(3)
    ro.flags.writeable = False
    for kwargs in ({}, {"async_op": True}):
        with pytest.raises(ValueError, match="writable"):
            c.recv(ro, 0, **kwargs)
    strict = pytest.importorskip("array_api_strict")
    with pytest.raises(ValueError, match="writable"):
        c.recv(strict.ones(3), 0)
    y = np.empty(3)  # nothing was sent or posted: the next exchange is right
    assert ring(c, np.full(3, float(c.rank)), y) == neighbours(c)[1] and (y == neighbours(c)[1]).all()


def test_blocking_receive_from_itself_needs_the_message_first(comm):
    with pytest.raises(coll.CollectiveError, match="this rank"):
        comm.recv(np.empty(2), comm.rank, tag=12)
    h = comm.send(np.arange(2.0), comm.rank, tag=12, async_op=True)
    x = np.empty(2)
    assert comm.recv(x, comm.rank, tag=12) == comm.rank and x.tolist() == [0.0, 1.0]
    h.wait()


def test_pieces_past_the_count_limit(comm):
    """COLLECTIVES_MAX_COUNT small: the data travels in many messages, received in order."""
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend")
    with communicator(COLLECTIVES_MAX_COUNT=1000) as d:
        x = np.arange(2500, dtype=np.float64) + d.rank
        y = np.empty_like(x)
        assert ring(d, x, y) == neighbours(d)[1] and (y == np.arange(2500) + neighbours(d)[1]).all()
        y2 = np.empty_like(x)
        h = d.recv(y2, None, 1, async_op=True)
        s = d.send(x, neighbours(d)[0], 1, async_op=True)
        assert h.wait() == neighbours(d)[1] and (y2 == y).all()
        s.wait()


def test_checked_mode_and_collectives_in_between(comm):
    """No agreement step for point-to-point (only two ranks take part), in checked mode too; collectives
    issued while messages are pending meet only each other."""
    old = comm.check
    comm.check = True
    try:
        right, left = neighbours(comm)
        x = np.empty(2)
        h = comm.recv(x, left, 8, async_op=True)
        total = comm.allreduce(np.ones(1), "sum")
        s = comm.send(np.full(2, float(comm.rank)), right, 8, async_op=True)
        assert total[0] == comm.size and h.wait() == left and (x == left).all()
        s.wait()
    finally:
        comm.check = old


def test_deadline_on_a_receive_and_on_a_send(comm):
    """With COLLECTIVES_TIMEOUT: a receive nobody sends to, and a large send nobody receives, raise
    CollectiveTimeoutError within the bound; the communicator then stays failed."""
    if comm.size < 2 or comm.backend != "mpi":
        pytest.skip("needs two MPI ranks")
    with communicator(COLLECTIVES_TIMEOUT=0.5) as d:
        if d.rank == 0:
            t0 = time.monotonic()
            with pytest.raises(coll.CollectiveTimeoutError, match="recv"):
                d.recv(np.empty(3), 1, tag=9)
            assert 0.4 < time.monotonic() - t0 < 5
            with pytest.raises(coll.CollectiveError, match="unusable"):
                d.send(np.ones(3), 1)
        gather_objects(None)
        if d.rank == 1:  # the message rank 0 waited for, now: its abandoned receive takes it
            d.send(np.ones(3), 0, tag=9)
        gather_objects(None)
    with communicator(COLLECTIVES_TIMEOUT=0.5) as d:
        big = np.ones(1 << 20)  # 8 MiB: past any eager limit, the send waits for its receive
        if d.rank == 0:
            h = d.send(big, 1, tag=2, async_op=True)
            t0 = time.monotonic()
            with pytest.raises(coll.CollectiveTimeoutError, match="send"):
                h.wait()
            assert 0.4 < time.monotonic() - t0 < 60
        gather_objects(None)
        if d.rank == 1:  # take the message (rank 0's request completes: nothing is left pending at exit)
            assert d.recv(np.empty(1 << 20), 0, tag=2) == 0
        gather_objects(None)


def test_flight_recorder_keeps_point_to_point_apart(comm):
    """Each send and recv is recorded in the communicator's point-to-point ring (the peer and tag in its
    path), not in the collectives' sequence, which stays the same on every rank."""
    from collectives._comm import engine_of  # the record as the dumps see it (Engine.trace_snapshot)

    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend (a communicator of its own)")
    with communicator() as d:
        seq = d.allreduce(np.ones(1), "sum") is not None and engine_of(d).trace_seq()
        extra = d.rank == 0  # rank 0 alone makes one more exchange with itself
        if extra:
            h = d.send(np.ones(2), 0, tag=1, async_op=True)
            d.recv(np.empty(2), 0, tag=1)
            h.wait()
        y = np.empty(1)
        ring(d, np.ones(1), y, tag=4)
        snap = engine_of(d).trace_snapshot()
        assert engine_of(d).trace_seq() == seq  # the collectives' sequence did not move
        p2p = snap["p2p"]
        assert [r["collective"] for r in p2p] == ["send", "recv"] * (2 if extra else 1)
        right, left = neighbours(d)
        assert f"dst={right}, tag=4" in p2p[-2]["path"] and f"src={left}, tag=4" in p2p[-1]["path"]
        assert all(r["state"] == "completed" for r in p2p)
        from collectives._tracetool import timeline  # the Chrome trace: point-to-point on a row of its own

        rows = {(e["name"], e["tid"]) for e in timeline({d.rank: {"communicators": [snap]}})["traceEvents"]
                if e["ph"] == "X"}
        assert {("send", f"{snap['name']} p2p"), ("recv", f"{snap['name']} p2p"), ("allreduce", snap["name"])} <= rows

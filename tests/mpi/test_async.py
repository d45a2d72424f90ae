"""Asynchronous collectives (async_op=True) at any world size: the same bits as the blocking calls, many
handles outstanding and waited in any order, done() never blocks, errors and the deadline in wait(),
close() with handles not yet waited."""

import gc
import time

import numpy as np
import pytest

import collectives as coll
from collectives._comm import engine_of
from support.comms import communicator, gather_objects


def last_path(c) -> str:
    """The path of ``c``'s last call as its flight recorder keeps it (internal: nothing public says which
    path a call took; ``tests/mpi/test_trace.py`` reads the record the same way)."""
    return engine_of(c).trace_entries()[-1]["path"]


def same(a, b) -> bool:
    """Equal bit for bit (longdouble: values, signs and NaN, not its padding bytes)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind == "f" and a.dtype.itemsize > 8:
        an, bn = np.isnan(a), np.isnan(b)
        return bool((an == bn).all() and (a[~an] == b[~bn]).all() and (np.signbit(a) == np.signbit(b))[~an].all())
    return a.tobytes() == b.tobytes()


def tricky(rank, dtype, shape):
    """Signed zeros, infinities, NaN on some ranks: every rule of the reductions shows."""
    rng = np.random.default_rng(rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-50, 50, shape).astype(dtype)
    if np.dtype(dtype).kind == "b":
        return rng.random(shape) < 0.5
    v = rng.choice([-2.0, -0.0, 0.0, 1.0, 3.0, np.inf, -np.inf], shape)
    v.reshape(-1)[rank % v.size] = np.nan
    return v.astype(dtype)




@pytest.mark.parametrize("dtype", ["int8", "float16", "float32", "float64", "longdouble", "bool"])
@pytest.mark.parametrize("op", ["sum", "min", "max", "mean"])
def test_async_reductions_are_the_blocking_bits(c, dtype, op):
    if (op == "mean" and np.dtype(dtype).kind in "biu") or (op in ("sum",) and dtype == "bool"):
        pytest.skip("illegal pair")
    n = c.size
    x = tricky(c.rank, dtype, (2 * n, 3))
    want = c.allreduce(x.copy(), op)
    y = x.copy()
    h = c.allreduce(y, op, async_op=True)
    assert isinstance(h, coll.Handle)
    assert h.wait() is y and same(y, want) and h.done()
    assert h.wait() is y  # again: the same result
    rs = c.reduce_scatter(x, op, async_op=True).wait()
    assert same(rs, want[2 * c.rank:2 * c.rank + 2])
    for root in range(n):
        r = x.copy()
        got = c.reduce(r, op, root, async_op=True).wait()
        assert got is r and same(r, want if c.rank == root else x)


@pytest.mark.parametrize("dtype", ["int8", "int32", "float16", "float32", "float64", "complex128", "longdouble", "bool"])
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "mean"])
def test_the_asynchronous_hot_path_gives_the_general_paths_bits(comm, dtype, op):
    """From the second asynchronous allreduce of an (op, dtype) on, a pair whose values travel as they are
    (no widening, no ordered integers, no bool bytes) takes the asynchronous hot path: the cached transfer,
    no validation. It gives the bits of the general path (its first call), of the blocking call and of
    the blocking hot path, for NumPy arrays and CPU torch tensors; float min/max and bool never take it."""
    kind = np.dtype(dtype).kind
    if (op == "mean" and kind in "biu") or (op in ("sum", "prod", "mean") and kind == "b") or (
            op in ("min", "max") and kind == "c"):
        pytest.skip("illegal pair")
    with communicator() as c:
        x = tricky(c.rank, dtype, (2 * c.size, 3))
        if op == "prod" and kind in "fc":
            x = np.where(np.isfinite(x), x, 1).astype(dtype)  # (finite: the order of a product's infinities)
        want = c.allreduce(x.copy(), op)
        assert same(c.allreduce(x.copy(), op), want)  # the blocking hot path, where it has one
        paths = []
        for _ in range(3):
            y = x.copy()
            h = c.allreduce(y, op, async_op=True)
            paths.append(last_path(c))
            assert h.wait() is y and same(y, want), (paths, y, want)
        assert paths[0] == "asynchronous, mpi", paths
        hot = "hot path, asynchronous"
        if kind == "b" or (op in ("min", "max") and kind == "f"):
            assert paths[1:] == ["asynchronous, mpi"] * 2, paths
        always = dtype in ("float32", "float64") and op in ("sum", "mean")  # (MPI reduces these itself everywhere)
        if always:
            assert paths[1:] == [hot, hot], paths
        torch = pytest.importorskip("torch") if dtype in ("int32", "float32", "float64") else None
        if torch is not None:
            for i in range(3):
                t = torch.from_numpy(x.copy())
                assert c.allreduce(t, op, async_op=True).wait() is t and same(t.numpy(), want)
                assert i == 0 or not always or last_path(c) == hot, last_path(c)


def test_the_asynchronous_hot_path_keeps_the_guarantees(comm):
    """The asynchronous hot path keeps what every asynchronous call has: a call the ranks made differently
    (count, op) is a MismatchError on every rank, from the fingerprint beside the transfer; the failed
    communicator refuses at the call; checked mode, a strided or read-only array and ``reproducible=``
    take the general path."""
    if comm.size < 2 or comm.backend != "mpi":
        pytest.skip("needs two MPI ranks")
    hot = "hot path, asynchronous"
    with communicator() as c:
        for op in ("sum", "mean"):
            c.allreduce(np.ones(2), op, async_op=True).wait()  # fills the asynchronous hot path's table
        h = c.allreduce(np.ones(2 if c.rank else 3), "sum", async_op=True)
        assert last_path(c) == hot
        with pytest.raises(coll.MismatchError, match="count"):
            h.wait()
        last = engine_of(c).trace_entries()[-1]  # the flight recorder's record of it: failed, with the error
        assert last["state"] == "failed" and "MismatchError" in last["error"] and last["path"] == hot, last
    with communicator() as c:
        for op in ("sum", "mean"):
            c.allreduce(np.ones(2), op, async_op=True).wait()
        x = np.full(2, float(c.rank))
        h = c.allreduce(x, "sum" if c.rank else "mean", async_op=True)
        assert last_path(c) == hot
        with pytest.raises(coll.MismatchError):
            h.wait()
        with pytest.raises(coll.CollectiveError):  # failed: it stays failed, refused at the call
            c.allreduce(np.ones(2), "sum", async_op=True)
    with communicator() as c:
        x = np.arange(8.0)
        c.allreduce(x.copy(), "sum", async_op=True).wait()
        c.allreduce(x.copy(), "sum", async_op=True).wait()
        assert last_path(c) == hot
        strided = np.stack([x, x], axis=1)[:, 0]
        assert (c.allreduce(strided, "sum", async_op=True).wait() == x * c.size).all()
        assert last_path(c) == "asynchronous, mpi"
        ro = x.copy()
        ro.flags.writeable = False
        got = c.allreduce(ro, "sum", async_op=True).wait()
        assert got is not ro and (got == x * c.size).all() and last_path(c) == "asynchronous, mpi"
        c.allreduce(x.copy(), "sum", async_op=True, reproducible=False).wait()
        assert last_path(c) == "asynchronous, mpi"
        c.check = True
        c.allreduce(x.copy(), "sum", async_op=True).wait()
        assert last_path(c) == "asynchronous, mpi"


def test_async_movement_and_trees(c):
    n = c.size
    x = np.arange(2 * n * 3, dtype=np.int32).reshape(2 * n, 3) + 100 * c.rank
    b = x.copy()
    assert c.broadcast(b, root=n - 1, async_op=True).wait() is b
    assert same(b, np.arange(2 * n * 3, dtype=np.int32).reshape(2 * n, 3) + 100 * (n - 1))
    assert same(c.allgather(x, async_op=True).wait(), c.allgather(x))
    assert same(c.alltoall(x, async_op=True).wait(), c.alltoall(x))
    tree = {"w": np.full(3, float(c.rank)), "s": 2.0}
    out = c.allreduce_tree(tree, "sum", async_op=True).wait()
    assert out["w"].tolist() == [float(sum(range(n)))] * 3 and out["s"] == 2.0 * n


def test_async_tree_starts_every_bucket_and_gives_the_blocking_tree(c):
    """Mixed dtypes (bfloat16 widened in its bucket), large solo leaves, read-only leaves (new arrays),
    torch leaves, a Python int, several trees in flight waited in reverse: the blocking call's bits."""
    torch = pytest.importorskip("torch")
    n, r = c.size, c.rank

    def tree(k):
        ro = np.full(5, float(r + k))
        ro.flags.writeable = False
        return {"big": np.arange(70000, dtype=np.float32) * (r + 1) + k, "ro": ro, "i": np.arange(7) + r,
                "t": torch.full((3,), float(r), dtype=torch.bfloat16), "n": 2 ** 70 + r, "none": None,
                "h": np.full((2, 2), r, dtype=np.float16)}

    want = [c.allreduce_tree(tree(k), "sum", bucket_bytes=1 << 12) for k in range(3)]
    handles = [c.allreduce_tree(tree(k), "sum", bucket_bytes=1 << 12, async_op=True) for k in range(3)]
    for k in reversed(range(3)):
        got = handles[k].wait()
        for name in ("big", "ro", "i", "h"):
            assert same(got[name], want[k][name]), (k, name)
        assert torch.equal(got["t"], want[k]["t"]) and got["n"] == want[k]["n"] == n * 2 ** 70 + sum(range(n))
        assert got["none"] is None
        assert handles[k].done()


def test_general_path_write_back_and_new_arrays(comm):
    n = comm.size
    base = np.zeros((4, 3))
    view = base[:, 1]  # strided: reduced in a copy, written back by wait()
    view[:] = comm.rank + 1
    h = comm.allreduce(view, "sum", async_op=True)
    assert h.wait() is view and (base[:, 1] == n * (n + 1) / 2).all() and (base[:, 0] == 0).all()
    ro = np.ones(4)
    ro.flags.writeable = False
    got = comm.allreduce(ro, "sum", async_op=True).wait()
    assert got is not ro and (got == n).all() and (ro == 1).all()


@pytest.mark.parametrize("dtype", ["bool", "int8", "int32", "float16", "float64", "complex128", "longdouble"])
def test_the_asynchronous_allgather_s_hot_path_gives_the_general_paths_bits(comm, dtype):
    """From the second asynchronous allgather of a dtype on, the call takes the asynchronous hot path (the
    cached transfer, no validation), into a new array or into ``out=``, for NumPy arrays and CPU torch
    tensors: the bits of the general path (its first call) and of the blocking call. A strided ``out``,
    ``x`` inside ``out``, a strided ``x`` and an ``out`` of another class take the general path, which
    gives the same bits; a wrong ``out`` is the general path's error, raised at the call."""
    hot = "hot path, asynchronous"
    with communicator() as c:
        x = tricky(c.rank, dtype, (2, 3))
        want = c.allgather(x)
        paths = []
        for _ in range(3):
            h = c.allgather(x, async_op=True)
            paths.append(last_path(c))
            assert same(h.wait(), want), paths
        assert paths == ["asynchronous, mpi", hot, hot], paths
        with pytest.raises(TypeError, match="op must be"):  # (no other collective's entry serves it)
            c.reduce_scatter(np.repeat(x, c.size, axis=0), None, async_op=True)
        out = np.empty_like(want)
        h = c.allgather(x, out=out, async_op=True)
        assert last_path(c) == hot and h.wait() is out and same(out, want)
        frozen = x.copy()
        frozen.flags.writeable = False  # (read only: the hot path reads x, as the blocking one does)
        h = c.allgather(frozen, async_op=True)
        assert last_path(c) == hot and same(h.wait(), want)
        general = {
            "strided out": (x, np.empty((c.size, 2, 6), x.dtype)[:, :, ::2]),
            "x inside out": (None, np.empty_like(want)),
            "strided x": (np.repeat(x, 2, axis=1)[:, ::2], np.empty_like(want)),
        }
        for name, (y, o) in general.items():
            if y is None:
                o[c.rank] = x
                y = o[c.rank]
            h = c.allgather(y, out=o, async_op=True)
            assert last_path(c) == "asynchronous, mpi", name
            assert h.wait() is o and same(o, want), name
        for bad in (np.empty((c.size + 1, 2, 3), x.dtype), np.empty((c.size, 2, 3), np.complex64 if dtype != "complex128"
                                                                         else np.float64)):
            with pytest.raises((TypeError, ValueError)):
                c.allgather(x, out=bad, async_op=True)
        torch = pytest.importorskip("torch") if dtype in ("bool", "int8", "int32", "float16", "float64") else None
        if torch is not None:
            t = torch.from_numpy(x.copy())
            for i in range(3):
                got = c.allgather(t, async_op=True).wait()
                assert isinstance(got, torch.Tensor) and same(got.numpy(), want)
                assert i == 0 or last_path(c) == hot, (i, last_path(c))
            o = torch.empty(want.shape, dtype=t.dtype)
            before = o._version  # torch's public read of the counter
            h = c.allgather(t, out=o, async_op=True)
            assert last_path(c) == hot and h.wait() is o and same(o.numpy(), want) and o._version > before
            h = c.allgather(t, out=torch.from_numpy(np.empty_like(want)), async_op=True)  # (another tensor: fine)
            assert last_path(c) == hot and same(h.wait().numpy(), want)
            mixed = np.empty_like(want)  # a NumPy out for a tensor: the general path's rule
            try:
                r = c.allgather(t, out=mixed, async_op=True).wait()
            except (TypeError, ValueError):
                pass
            else:
                assert last_path(c) == "asynchronous, mpi" and same(np.asarray(r), want)


@pytest.mark.parametrize("dtype", ["int8", "int32", "float16", "float32", "float64", "complex128", "longdouble", "bool"])
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "mean"])
def test_the_asynchronous_reduce_scatter_s_hot_path_gives_the_general_paths_bits(comm, dtype, op):
    """From the second asynchronous reduce_scatter of an (op, dtype) on, a pair whose values travel as they
    are takes the asynchronous hot path (as allreduce's: float min/max and bool never do), into a new array
    or into ``out=``, for NumPy arrays and CPU torch tensors: the bits of the general path (its first call),
    of the blocking call and of the blocking hot path."""
    kind = np.dtype(dtype).kind
    if (op == "mean" and kind in "biu") or (op in ("sum", "prod", "mean") and kind == "b") or (
            op in ("min", "max") and kind == "c"):
        pytest.skip("illegal pair")
    hot = "hot path, asynchronous"
    with communicator() as c:
        x = tricky(c.rank, dtype, (2 * c.size, 3))
        if op == "prod" and kind in "fc":
            x = np.where(np.isfinite(x), x, 1).astype(dtype)  # (finite: the order of a product's infinities)
        want = c.reduce_scatter(x, op)
        assert same(c.reduce_scatter(x, op), want)  # the blocking hot path, where it has one
        paths = []
        for _ in range(3):
            h = c.reduce_scatter(x, op, async_op=True)
            paths.append(last_path(c))
            assert same(h.wait(), want), (paths, op, dtype)
        out = np.empty_like(want)
        h = c.reduce_scatter(x, op, out=out, async_op=True)
        paths.append(last_path(c))
        assert h.wait() is out and same(out, want)
        assert paths[0] == "asynchronous, mpi", paths
        if kind == "b" or (op in ("min", "max") and kind == "f"):
            assert hot not in paths, paths
        if dtype in ("float32", "float64") and op in ("sum", "mean"):  # (MPI reduces these itself everywhere)
            assert paths[1:] == [hot] * 3, paths
        torch = pytest.importorskip("torch") if dtype in ("int32", "float32", "float64") else None
        if torch is not None:
            t = torch.from_numpy(x.copy())
            for i in range(3):
                got = c.reduce_scatter(t, op, async_op=True).wait()
                assert isinstance(got, torch.Tensor) and same(got.numpy(), want)
                assert i == 0 or dtype not in ("float32", "float64") or op not in ("sum", "mean") or last_path(c) == hot
            o = torch.empty(want.shape, dtype=t.dtype)
            before = o._version
            h = c.reduce_scatter(t, op, out=o, async_op=True)
            assert h.wait() is o and same(o.numpy(), want) and o._version > before
            if dtype in ("float32", "float64") and op in ("sum", "mean"):
                assert last_path(c) == hot


def test_the_asynchronous_allgather_s_hot_path_keeps_the_guarantees(comm):
    """The asynchronous allgather's hot path keeps what every asynchronous call has: another count or
    dtype on one rank is a MismatchError on every rank, from the fingerprint beside the transfer, and the
    call's out is never handed back; the record says so; the failed communicator refuses at the call."""
    if comm.size < 2 or comm.backend != "mpi":
        pytest.skip("needs two MPI ranks")
    hot = "hot path, asynchronous"
    for other in ("count", "dtype"):
        with communicator() as c:
            for dtype in (np.float64, np.int64):
                c.allgather(np.ones(2, dtype), async_op=True).wait()  # fills the hot path's table
            last = c.rank == c.size - 1
            x = np.ones(3 if last and other == "count" else 2, np.int64 if last and other == "dtype" else np.float64)
            h = c.allgather(x, async_op=True)
            assert last_path(c) == hot
            with pytest.raises(coll.MismatchError, match="count" if other == "count" else "int64"):
                h.wait()
            entry = engine_of(c).trace_entries()[-1]
            assert entry["state"] == "failed" and "MismatchError" in entry["error"] and entry["path"] == hot, entry
            with pytest.raises(coll.CollectiveError):
                c.allgather(np.ones(2), async_op=True)  # failed for good: refused at the call


def test_torch(comm):
    torch = pytest.importorskip("torch")
    t = torch.full((comm.size * 2,), float(comm.rank), dtype=torch.bfloat16)
    want = comm.allreduce(t.clone(), "mean")
    h = comm.allreduce(t, "mean", async_op=True)
    assert h.wait() is t and torch.equal(t, want)
    rs = comm.reduce_scatter(torch.arange(comm.size * 2), "sum", async_op=True).wait()
    assert isinstance(rs, torch.Tensor) and rs.tolist() == [comm.size * (2 * comm.rank), comm.size * (2 * comm.rank + 1)]


@pytest.mark.parametrize("make", ["plain", "strided", "hot path"])
def test_torch_writes_bump_the_version_as_blocking_ones_do(comm, make):
    """An async write into a tensor autograd saved is seen by backward (as a blocking one, or a write under
    ``no_grad``), on the in-place, the written-back (strided) and the asynchronous hot path."""
    torch = pytest.importorskip("torch")
    if make == "hot path":
        comm.allreduce(torch.ones(4), "sum", async_op=True).wait()  # fills the asynchronous hot path's table
    a = torch.ones(4, requires_grad=True)
    b = torch.full((8,), 2.0)[::2] if make == "strided" else torch.full((4,), 2.0)
    loss = (a * b).sum()  # autograd saves b
    before = b._version  # torch's public read of the counter
    h = comm.allreduce(b, "sum", async_op=True)
    assert make != "hot path" or last_path(comm) == "hot path, asynchronous"
    assert h.wait() is b and b._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("collective", ["allreduce", "reduce", "reduce_scatter"])
def test_polling_on_one_rank_only_keeps_the_order_of_collectives(c, collective):
    """Rank 0 polls ``done()`` until its handle completes while the others go straight on to another
    collective: every rank must still issue the same collectives in the same order. The longdouble
    min/max pair takes two transfers; a second one started by ``done()`` on rank 0 only would meet the
    others' next allreduce instead (found in review: it ran blocking at the call since)."""
    n = c.size
    x = np.array([c.rank, -0.0, np.nan if c.rank == n - 1 else 1.0] * n, dtype=np.longdouble)
    calls = {"allreduce": lambda: c.allreduce(x, "max", async_op=True),
             "reduce": lambda: c.reduce(x, "max", root=n - 1, async_op=True),
             "reduce_scatter": lambda: c.reduce_scatter(x, "max", async_op=True)}
    h = calls[collective]()
    if c.rank == 0:
        deadline = time.monotonic() + 30
        while not h.done() and time.monotonic() < deadline:
            pass
    y = c.allreduce(np.full(4, float(c.rank)), "sum")
    assert (y == sum(range(n))).all()
    got = h.wait()
    one = np.array([n - 1, -0.0, np.nan], dtype=np.longdouble)  # NaN wins; every rank's zero is -0.0
    want = one if collective == "reduce_scatter" else np.tile(one, n)
    if collective != "reduce" or c.rank == n - 1:  # longdouble's padding bytes are free: values and signs
        np.testing.assert_array_equal(got, want)
        assert (np.signbit(got) == np.signbit(want)).all()


def test_many_outstanding_waited_in_reverse(c):
    n = c.size
    xs = [np.full(5, float(c.rank + i)) for i in range(4)]
    handles = [c.allreduce(xs[0], "sum", async_op=True),
               c.broadcast(xs[1], root=0, async_op=True),
               c.reduce_scatter(np.tile(xs[2], (n, 1)), "max", async_op=True),
               c.alltoall(np.tile(xs[3], (n, 1)), async_op=True),
               c.allgather(np.array([c.rank]), async_op=True),
               c.reduce(np.array([1.0]), "sum", 0, async_op=True)]
    results = [h.wait() for h in reversed(handles)][::-1]
    assert (results[0] == sum(r for r in range(n))).all()
    assert (results[1] == 1.0).all()
    assert (results[2] == n - 1 + 2).all()
    assert [row[0] for row in results[3]] == [i + 3.0 for i in range(n)]
    assert results[4].tolist() == [[r] for r in range(n)]
    assert results[5].tolist() == ([float(n)] if c.rank == 0 else [1.0])
    assert all(h.done() for h in handles)


def test_done_never_blocks(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    x = np.ones(8)
    if comm.rank == 0:
        h = comm.allreduce(x, "sum", async_op=True)
        t0 = time.monotonic()
        early = h.done()
        assert time.monotonic() - t0 < 0.2 and early is False  # the others have not issued it yet
        gather_objects(None)  # now they may
        h.wait()
    else:
        gather_objects(None)
        comm.allreduce(x, "sum", async_op=True).wait()  # async on every rank: MPI does not match a
    assert (x == comm.size).all()                        # non-blocking collective with a blocking one


def test_errors(comm):
    with pytest.raises(TypeError, match="op="):  # validation: raised by the call, nothing started
        comm.allreduce(np.ones(2, dtype=np.int64), "mean", async_op=True)
    with pytest.raises(ValueError, match="divisible|at least one dimension"):
        comm.reduce_scatter(np.ones(comm.size + 1) if comm.size > 1 else np.ones(()), async_op=True)
    if comm.size < 2 or comm.backend != "mpi":
        return
    with communicator() as c:
        c.check = True
        h = c.allreduce(np.ones(2 if c.rank else 3), "sum", async_op=True)
        with pytest.raises(coll.MismatchError):  # checked mode agreed at the call; wait() raises
            h.wait()
        assert h.done()
        y = np.ones(2)
        with pytest.raises(coll.MismatchError, match="async_op"):  # blocking on some ranks only
            if c.rank == 0:
                c.allreduce(y, "sum", async_op=True).wait()
            else:
                c.allreduce(y, "sum")


@pytest.mark.parametrize("path", ["general", "hot"])
def test_deadline_fires_in_wait(comm, path):
    """One rank issues an allreduce that the others issue only after its wait() gave up (the general path,
    or the asynchronous hot path: both wait under the transport's deadline)."""
    if comm.size < 2 or comm.backend != "mpi":
        pytest.skip("needs two MPI ranks")
    with communicator(COLLECTIVES_TIMEOUT=0.5) as d:
        x = np.ones(4)
        # the allreduce lane made first: a kind's first non-blocking call is posted to MPI only once its lane
        # is (test_lanes.py), and this checks that a posted call a rank gave up on still meets the late ones
        if path == "hot":  # (its asynchronous call also fills the asynchronous hot path's table)
            d.allreduce(np.ones(1), "sum", async_op=True).wait()
        else:
            d.allreduce(np.ones(1), "sum")
        if comm.rank == 0:
            h = d.allreduce(x, "sum", async_op=True)
            assert (last_path(d) == "hot path, asynchronous") == (path == "hot"), last_path(d)
            time.sleep(0.7)  # longer than the timeout: the deadline counts the time spent in wait()
            assert not h.done()
            t0 = time.monotonic()
            with pytest.raises(coll.CollectiveTimeoutError, match="allreduce"):
                h.wait()
            assert 0.4 < time.monotonic() - t0 < 5
            with pytest.raises(coll.CollectiveTimeoutError):
                h.wait()  # the same error again
            gather_objects(None)
            gather_objects(None)  # MPI progresses rank 0's pending request while the others match it
        else:
            gather_objects(None)
            d.allreduce(x, "sum")
            gather_objects(None)


def test_deadline_bounds_the_shared_memory_allreduce(comm):
    """With COLLECTIVES_TIMEOUT, a large allreduce on one node goes through the node-shared window, each
    of its barriers waited for under the deadline: a rank alone in it raises CollectiveTimeoutError
    instead of hanging (rank 0, at the first barrier; then the others, who enter late, at the second),
    and the communicator is unusable afterwards."""
    if comm.size < 2 or comm.backend != "mpi" or comm.size != comm.local_size:
        pytest.skip("needs two MPI ranks on one node")
    with communicator(COLLECTIVES_TIMEOUT=0.5, COLLECTIVES_SHM_THRESHOLD=64, COLLECTIVES_SHM_SLOT_BYTES=65536) as d:
        x = np.arange(5000, dtype=np.float64)
        assert (d.allreduce(x.copy(), "sum") == comm.size * x).all()  # every rank: the window is made
        gather_objects(None)
        t0 = time.monotonic()
        if comm.rank == 0:
            with pytest.raises(coll.CollectiveTimeoutError, match="node-shared memory"):
                d.allreduce(x.copy(), "sum")
            assert 0.4 < time.monotonic() - t0 < 5
            with pytest.raises(coll.CollectiveError, match="unusable"):
                d.allreduce(x.copy(), "sum")
            # The call left pending reads this rank's fingerprint when the others arrive: memory freed and
            # reused meanwhile would reach them as another call's (a MismatchError, where stop 57's CI found
            # heap pointers in it on Open MPI). Reuse freed memory of a fingerprint's size now.
            gc.collect()
            junk = [np.full(22, -7, dtype=np.int64) for _ in range(4096)]
            del junk
        gather_objects(None)
        if comm.rank != 0:  # late: past the first barrier (rank 0's is pending), alone at the second
            with pytest.raises(coll.CollectiveTimeoutError, match="node-shared memory"):
                d.allreduce(x.copy(), "sum")
        gather_objects(None)
        if comm.rank == 0:
            # The others wait in a node barrier that rank 0 will never reach; nothing public can complete
            # it (a communicator is broken by design after a timeout), so the test does, on the window's
            # node communicator, to leave no request unmatched at MPI_Finalize. (Every rank's transport
            # has failed, so none frees the window collectively at close.)
            d._host._shm.node.Ibarrier().Wait()
        gather_objects(None)


def test_close_completes_outstanding_handles(comm):
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend")
    with communicator() as c:
        x = np.full(6, float(comm.rank))
        h = c.allreduce(x, "sum", async_op=True)
        g = c.alltoall(np.arange(comm.size), async_op=True)
    assert c.closed and h.done() and (x == sum(range(comm.size))).all()
    assert g.wait().tolist() == [comm.rank] * comm.size
    with pytest.raises(coll.BackendUnavailableError):  # raised by the call: nothing can start
        c.allreduce(x, "sum", async_op=True)


def test_close_with_a_handle_that_cannot_complete_raises(comm):
    if comm.size < 2 or comm.backend != "mpi":
        pytest.skip("needs two MPI ranks")
    user = __import__("mpi4py").MPI.COMM_WORLD.Dup()
    import os

    os.environ["COLLECTIVES_TIMEOUT"] = "0.5"
    try:
        c = coll.init(comm=user)
    finally:
        del os.environ["COLLECTIVES_TIMEOUT"]
    x = np.ones(3)
    c.allreduce(np.ones(1), "sum")  # the allreduce lane made: see test_deadline_fires_in_wait
    if comm.rank == 0:
        h = c.allreduce(x, "sum", async_op=True)
        t0 = time.monotonic()
        with pytest.raises(coll.CollectiveError, match=r"close\(\): 1 asynchronous collective"):
            c.close()
        assert time.monotonic() - t0 < 5 and c.closed and not h.done()
        gather_objects(None)
        gather_objects(None)  # progress: the others match the pending allreduce
    else:
        gather_objects(None)
        c.allreduce(x, "sum")
        c.close()
        gather_objects(None)


def drop_allreduces(c, n: int, elements: int) -> list:
    """Start ``n`` asynchronous allreduces of ``elements`` float64 on ``c`` and drop their handles and
    arrays; weak references to the arrays."""
    import weakref

    refs = []
    for _ in range(n):
        x = np.ones(elements)
        refs.append(weakref.ref(x))
        c.allreduce(x, async_op=True)  # dropped
        del x
    return refs


def test_handles_dropped_without_wait_are_released(comm):
    """A handle dropped without wait() is released with its buffers once its transfer is done (the next
    asynchronous calls move it on, and complete the oldest past MAX_OUTSTANDING in flight), not kept to
    close(): 200 dropped 1 MiB allreduces hold at most 64 buffers, not 200."""
    import gc

    c = coll.init(comm=__import__("mpi4py.MPI", fromlist=["MPI"]).COMM_WORLD.Dup())
    try:
        refs = drop_allreduces(c, 200, 1 << 17)  # 1 MiB each
        c.allreduce(np.ones(1), async_op=True).wait()  # every earlier one is complete now (issue order)...
        c.allreduce(np.ones(1), async_op=True).wait()  # ...and the next call releases them
        gc.collect()
        alive = sum(r() is not None for r in refs)
        assert alive <= 8 if c.size == 1 else alive <= 66, f"{alive} of 200 dropped buffers still held"
    finally:
        c.close()


def test_dropped_handles_are_released_by_later_blocking_calls(comm):
    """Issue 32: 50 dropped 256 KiB allreduces are all released by later blocking calls (the general path
    and barrier move the completed ones on), not kept until 64 more calls are in flight or close()."""
    import gc

    from support.comms import communicator, gather_objects

    with communicator() as c:
        refs = drop_allreduces(c, 50, 1 << 15)  # 256 KiB each
        alive = None
        for i in range(400):  # until MPI has completed them all (every rank calls alike)
            if i % 2:
                c.barrier()
            else:
                c.allgather(np.ones(2))
            gc.collect()
            alive = sum(r() is not None for r in refs)
            if not any(gather_objects(alive)):  # every rank leaves the loop together
                break
        assert alive == 0, f"{alive} of 50 dropped buffers still held after 400 blocking calls"

"""Issue 12 (hardening): the defects an adversarial pass found, one test (or a few) each.

Written in terms of ``comm.rank`` and ``comm.size``: passes under ``mpiexec -n 1``, ``-n 2`` and ``-n 3``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

import collectives as coll
from collectives._comm import engine_of


def _closed_communicator():
    c = coll.init(comm=MPI.COMM_WORLD.Dup())
    c.close()  # collective: every rank closes its own
    return c


# ---- item 10: a closed communicator raises BackendUnavailableError everywhere, never AttributeError ----

CLOSED_CALLS = {
    "allreduce": lambda c: c.allreduce(np.ones(3)),
    "broadcast": lambda c: c.broadcast(np.ones(3)),
    "reduce": lambda c: c.reduce(np.ones(3)),
    "allgather": lambda c: c.allgather(np.ones(3)),
    "barrier": lambda c: c.barrier(),
    "synchronize": lambda c: c.synchronize({"w": np.ones(3)}),
    "allreduce_tree": lambda c: c.allreduce_tree({"w": np.ones(3)}),
    "coll.synchronize": lambda c: coll.synchronize({"w": np.ones(3)}, comm=c),
    "coll.allreduce_tree": lambda c: coll.allreduce_tree([np.ones(3)], comm=c),
    "coll.allreduce": lambda c: coll.allreduce(np.ones(3), comm=c),
    "coll.broadcast": lambda c: coll.broadcast(np.ones(3), comm=c),
    "shard": lambda c: coll.shard(list(range(10)), comm=c),
    "DistributedOptimizer": lambda c: coll.DistributedOptimizer(_Sgd(), comm=c),
    "rank": lambda c: c.rank,
    "size": lambda c: c.size,
    "local_rank": lambda c: c.local_rank,
    "local_size": lambda c: c.local_size,
    "backend": lambda c: c.backend,
}


class _Sgd:
    @staticmethod
    def init(params):
        return ()

    @staticmethod
    def update(grads, state, params=None):
        return grads, state


@pytest.mark.parametrize("call", sorted(CLOSED_CALLS))
def test_a_closed_communicator_raises_backend_unavailable(comm, call):
    c = _closed_communicator()
    assert c.closed and "closed" in repr(c)
    with pytest.raises(coll.BackendUnavailableError, match="clos|finaliz"):
        CLOSED_CALLS[call](c)
    c.close()  # still idempotent


def test_a_warm_hot_path_on_a_closed_communicator_raises(comm):
    c = coll.init(comm=MPI.COMM_WORLD.Dup())
    x = np.ones(3)
    rows = np.zeros((c.size, 3))
    for _ in range(3):  # warm: the cached direct calls are filled
        c.allreduce(x)
        c.broadcast(x)
        c.allgather(x)
        c.allgather(x, out=rows)
        c.reduce(x)
    c.close()
    rows[...] = 7
    for call in (c.allreduce, c.broadcast, c.allgather, c.reduce, lambda y: coll.allreduce(y, comm=c),
                 lambda y: coll.broadcast(y, comm=c), lambda y: coll.allgather(y, comm=c),
                 lambda y: coll.allgather(y, out=rows, comm=c), lambda y: coll.reduce(y, comm=c)):
        with pytest.raises(coll.BackendUnavailableError):
            call(x)
    assert (rows == 7).all()


def test_a_warm_torch_hot_path_on_a_closed_communicator_raises(comm):
    torch = pytest.importorskip("torch")
    c = coll.init(comm=MPI.COMM_WORLD.Dup())
    t = torch.ones(2 * comm.size)
    gathered, block = torch.zeros(comm.size, 2 * comm.size), torch.zeros(2)
    calls = (c.allreduce, c.broadcast, c.allgather, c.reduce, c.reduce_scatter, c.alltoall,
             lambda y: c.allgather(y, out=gathered), lambda y: c.reduce_scatter(y, out=block))
    for _ in range(3):  # warm: the cached direct calls are filled for the tensor's dtype
        for call in calls:
            call(t)
    c.close()
    before = t.clone()
    gathered.fill_(7)
    block.fill_(7)
    for call in calls:
        with pytest.raises(coll.BackendUnavailableError):
            call(t)
    assert torch.equal(t, before) and (gathered == 7).all() and (block == 7).all()


# ---- item 8: communicators are looked up by the MPI communicator, not by the Python wrapper ----

def test_a_new_wrapper_of_the_same_communicator_finds_the_same_communicator(comm):
    base = MPI.COMM_WORLD.Dup()
    try:
        first = coll.init(comm=base)
        again = coll.init(comm=MPI.Intracomm(base))  # another Python object for the same MPI communicator
        assert again is first
        x = np.ones(2)
        for _ in range(2500):  # frameworks hand a fresh wrapper every call; MPICH ran out at ~2000 dups
            coll.allreduce(x, comm=MPI.Intracomm(base))
            x[:] = 1
        assert coll.init(comm=MPI.Intracomm(base)) is first and not first.closed
    finally:
        base.Free()


def test_freeing_the_users_communicator_releases_ours(comm):
    base = MPI.COMM_WORLD.Dup()
    ours = coll.init(comm=base)
    base.Free()  # collective, as MPI requires
    assert ours.closed  # its MPI duplicate and shared memory were released with it
    with pytest.raises(coll.BackendUnavailableError):
        ours.allreduce(np.ones(2))
    # MPI reuses the freed handle for the next communicator: that must not find the released one
    other = MPI.COMM_WORLD.Dup()
    try:
        fresh = coll.init(comm=other)
        assert fresh is not ours and not fresh.closed
        x = np.ones(2)
        fresh.allreduce(x)
        assert (x == comm.size).all()
    finally:
        other.Free()
    assert fresh.closed


def test_a_closed_communicator_is_not_returned_for_its_mpi_communicator(comm):
    base = MPI.COMM_WORLD.Dup()
    try:
        ours = coll.init(comm=base)
        ours.close()
        again = coll.init(comm=base)
        assert again is not ours and not again.closed
    finally:
        base.Free()


# ---- item 2: a malformed setting on one rank is refused on every rank, naming variable and value ----

MALFORMED = [
    ("COLLECTIVES_TIMEOUT", "abc"),
    ("COLLECTIVES_MAX_COUNT", "lots"),
    ("COLLECTIVES_MAX_COUNT", "-4"),
    ("COLLECTIVES_SHM", "maybe"),
    ("COLLECTIVES_SHM_THRESHOLD", "1.5"),
    ("COLLECTIVES_SHM_SLOT_BYTES", "0"),
    ("COLLECTIVES_SIMULATE_NODES", "two"),
    ("COLLECTIVES_SYNC_PIPELINE", "2"),
    ("COLLECTIVES_BUCKET_BYTES", "25MB"),
    ("COLLECTIVES_CHECK", "please"),
    ("COLLECTIVES_ABORT_ON_ERROR", "never"),
    ("COLLECTIVES_DISABLE_NCCL", "nope"),
    ("COLLECTIVES_CUDA_AWARE_MPI", "perhaps"),
    ("COLLECTIVES_NCCL_EAGER", "soon"),
    ("COLLECTIVES_MPI_THREAD_LEVEL", "many"),
]


@pytest.mark.parametrize(("name", "value"), MALFORMED)
def test_a_malformed_setting_on_one_rank_is_refused_on_every_rank(comm, monkeypatch, name, value):
    if comm.rank == comm.size - 1:
        monkeypatch.setenv(name, value)
    base = MPI.COMM_WORLD.Dup()
    try:
        with pytest.raises(ValueError) as info:
            coll.init(comm=base)  # would hang at 2+ ranks if only the last rank raised
        text = str(info.value)
        assert name in text and repr(value) in text and f"rank {comm.size - 1}" in text, text
    finally:
        base.Free()
    monkeypatch.delenv(name, raising=False)
    again = coll.init(comm=MPI.COMM_WORLD.Dup())  # nothing was left behind: init works again
    x = np.ones(1)
    again.allreduce(x)
    assert x[0] == comm.size
    again.close()


# ---- item 5: in-place writes into torch tensors bump autograd's version counter ----

def _saved_for_backward(torch, make=None):
    """``(loss, b)``: ``loss.backward()`` needs ``b`` as it was (b is saved for a's gradient)."""
    a = torch.ones(4, requires_grad=True)
    b = torch.full((4,), 2.0) if make is None else make()
    return (a * b).sum(), b


INPLACE_CALLS = {
    "allreduce": lambda c, b: c.allreduce(b),
    "coll.allreduce": lambda c, b: coll.allreduce(b, comm=c),
    "allreduce mean": lambda c, b: c.allreduce(b, op="mean"),
    "allreduce max": lambda c, b: c.allreduce(b, op="max"),
    "broadcast": lambda c, b: c.broadcast(b, root=0),
    "coll.broadcast": lambda c, b: coll.broadcast(b, root=c.size - 1, comm=c),
    "allreduce_tree": lambda c, b: coll.allreduce_tree({"b": b, "other": np.ones(2)}, op="sum", comm=c),
    "synchronize": lambda c, b: coll.synchronize({"b": b, "other": np.ones(2)}, comm=c),
    "allreduce_tree single": lambda c, b: c.allreduce_tree([b]),
}


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("call", sorted(INPLACE_CALLS))
def test_a_collective_into_a_saved_tensor_makes_backward_raise(comm, call, warm):
    torch = pytest.importorskip("torch")
    base = MPI.COMM_WORLD.Dup()
    try:
        c = coll.init(comm=base)  # fresh: nothing cached (cold) unless warmed here
        if warm:
            for _ in range(3):
                INPLACE_CALLS[call](c, torch.full((4,), 2.0))
        loss, b = _saved_for_backward(torch)
        INPLACE_CALLS[call](c, b)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()  # as after b.mul_(1) under torch.no_grad(); it gave a wrong gradient silently
    finally:
        base.Free()


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("collective", ["allgather", "reduce_scatter"])
def test_a_result_written_into_a_saved_out_makes_backward_raise(comm, collective, warm):
    """``out=`` is written as ``x`` is by broadcast: behind autograd's back, with a new version, on the hot
    path (warm) and the general path (cold) alike."""
    torch = pytest.importorskip("torch")
    base = MPI.COMM_WORLD.Dup()
    try:
        c = coll.init(comm=base)
        rows = (c.size, 2) if collective == "allgather" else (1, 2)
        x = torch.ones(2) if collective == "allgather" else torch.ones(c.size, 2)
        call = getattr(c, collective)
        if warm:
            for _ in range(3):
                call(x, out=torch.empty(rows))
        a = torch.ones(rows, requires_grad=True)
        out = torch.full(rows, 2.0)
        loss = (a * out).sum()
        assert call(x, out=out) is out
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    finally:
        base.Free()


@pytest.mark.parametrize("make", ["strided", "bfloat16", "parameter", "float16"])
def test_the_general_paths_bump_the_version_too(comm, make):
    torch = pytest.importorskip("torch")
    makers = {
        "strided": lambda: torch.full((8,), 2.0)[::2],  # written back through a contiguous copy
        "bfloat16": lambda: torch.full((4,), 2.0, dtype=torch.bfloat16),  # widened to float32
        "parameter": lambda: torch.nn.Parameter(torch.full((4,), 2.0), requires_grad=False),
        "float16": lambda: torch.full((4,), 2.0, dtype=torch.float16),
    }
    a = torch.ones(4, requires_grad=True, dtype=torch.float32)
    b = makers[make]()
    loss = (a * b.float()).sum() if b.dtype != torch.float32 else (a * b).sum()
    comm.allreduce(b)
    if b.dtype != torch.float32:  # b.float() was a copy: autograd saved that, and b's write is harmless
        loss.backward()
        return
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_reduce_bumps_the_version_where_it_writes(comm):
    torch = pytest.importorskip("torch")
    loss, b = _saved_for_backward(torch)
    comm.reduce(b, root=0)
    if comm.rank == 0:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    else:  # non-root ranks: b is untouched (documented), so backward is right
        loss.backward()


def test_a_collective_does_not_bump_a_tensor_it_did_not_write(comm):
    torch = pytest.importorskip("torch")
    b = torch.full((4,), 2.0)
    before = b._version  # torch's public read of the counter
    comm.allgather(b)
    assert b._version == before
    comm.allreduce(b)
    assert b._version > before


# ---- found by the fuzz suite: allreduce_tree's float min/max bypassed the NaN-propagating order ----

@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("op", ["min", "max"])
def test_allreduce_tree_float_min_max_propagates_nan_and_orders_signed_zeros(comm, dtype, op):
    def leaf(rank):  # NaN on rank 0 only; -0.0 and +0.0 on different ranks
        v = np.array([1.0 + rank, -0.0 if rank == 0 else 0.0, 0.0 if rank == 0 else -0.0, 2.0], dtype=dtype)
        if rank == 0:
            v[0] = np.nan
        return v

    zero_first = -0.0 if op == "min" or comm.size == 1 else 0.0  # rank 0 holds -0.0 at index 1
    zero_second = 0.0 if op == "max" or comm.size == 1 else -0.0  # and +0.0 at index 2
    for _ in range(3):  # cold, then warm (cached plan and runners)
        tree = {"x": leaf(comm.rank), "big": np.full(50_000, float(comm.rank), dtype=dtype)}  # a solo too
        out = coll.allreduce_tree(tree, op=op, comm=comm)
        x = out["x"]
        assert np.isnan(x[0]), x
        assert x[1] == 0 and bool(np.signbit(x[1])) == bool(np.signbit(zero_first)), (op, x)
        assert x[2] == 0 and bool(np.signbit(x[2])) == bool(np.signbit(zero_second)), (op, x)
        assert x[3] == 2.0
        big = out["big"]
        assert (big == (0 if op == "min" else comm.size - 1)).all()


# ---- item 7: shard in checked mode compares drop_remainder, and one rank's invalid data is typed ----

def test_shard_checked_mode_compares_drop_remainder(comm, monkeypatch):
    monkeypatch.setattr(comm, "check", True)
    drop = comm.rank == comm.size - 1
    if comm.size == 1:
        assert len(coll.shard(list(range(10)), drop_remainder=drop, comm=comm)) == 10
        return
    with pytest.raises(coll.MismatchError, match="drop_remainder"):
        coll.shard(list(range(10)), drop_remainder=drop, comm=comm)  # silently 3/3/4 items before


def test_shard_checked_mode_data_invalid_on_one_rank_is_typed_everywhere(comm, monkeypatch):
    monkeypatch.setattr(comm, "check", True)
    last = comm.rank == comm.size - 1
    data = (i for i in range(10)) if last else list(range(10))  # a generator has no length
    expected = TypeError if last else coll.MismatchError
    with pytest.raises(expected, match="generator" if last else f"rank {comm.size - 1}.*generator"):
        coll.shard(data, comm=comm)
    assert len(coll.shard(list(range(10)), comm=comm)) == -(-10 // comm.size)  # still usable


# ---- item 12: the smaller ones, each a typed error (or a working call) on every rank ----

def test_a_meta_tensor_is_a_type_error(comm):
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="'meta' device has no data"):
        comm.allreduce(torch.ones(3, device="meta"))
    with pytest.raises(TypeError, match="'meta' device"):
        coll.allreduce_tree({"w": torch.ones(3, device="meta")}, comm=comm)


@pytest.mark.parametrize("call", ["allreduce", "broadcast", "allgather", "allreduce_tree"])
def test_a_masked_array_is_refused_not_misread(comm, call):
    m = np.ma.masked_array(np.arange(4.0), mask=[0, 1, 0, 0])
    with pytest.raises(TypeError, match="masked array"):
        if call == "allreduce_tree":
            coll.allreduce_tree({"m": m}, comm=comm)
        else:
            getattr(comm, call)(m)
    assert m.mask.tolist() == [False, True, False, False] and m.data.tolist() == [0, 1, 2, 3]


def test_shard_keeps_a_masked_arrays_mask_when_it_wraps(comm):
    m = np.ma.masked_array(np.arange(5.0), mask=[0, 1, 0, 0, 1])
    part = coll.shard(m, comm=comm)  # the last rank's part wraps round when 5 % size != 0
    from collectives._shard import shard_indices  # (the expected indices: pure arithmetic)

    idx = shard_indices(5, comm.rank, comm.size)
    assert isinstance(part, np.ma.MaskedArray)
    assert part.mask.tolist() == [bool(m.mask[i]) for i in idx] and part.data.tolist() == [float(i) for i in idx]


def test_a_conjugated_complex32_tensor_is_broadcast(comm):
    torch = pytest.importorskip("torch")
    with warnings_ignored():
        values = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (comm.rank + 1)
        z = values.to(torch.complex32).conj()
        comm.broadcast(z, root=0)  # was "unsupported ScalarType ComplexHalf"
        assert z.is_conj()
        got = z.resolve_conj().to(torch.complex64)
    assert torch.equal(got, torch.tensor([1 - 2j, 3 + 1j], dtype=torch.complex64))


def warnings_ignored():
    import warnings

    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("ignore")  # torch: "ComplexHalf support is experimental"
    return _Exit(ctx)


class _Exit:
    def __init__(self, ctx):
        self.ctx = ctx

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)


@pytest.mark.parametrize("name", ["bits8", "bits16", "uint1", "int4", "qint8", "quint8"])
def test_torch_dtypes_without_a_numpy_equivalent_are_a_clear_type_error(comm, name):
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"this torch has no {name}")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: quantized tensors are deprecated
        t = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, dtype) if name.startswith("q") \
            else torch.empty(3, dtype=dtype)
    for call in (comm.allreduce, comm.broadcast, comm.allgather):
        with pytest.raises(TypeError, match=f"torch dtype {name} is not supported"):
            call(t)


@pytest.mark.parametrize("reproducible", [False, True])
def test_a_distributed_optimizer_pickles_and_deep_copies(comm, reproducible):
    torch = pytest.importorskip("torch")
    import copy
    import pickle

    model = torch.nn.Linear(2, 1)
    opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm,
                                    reproducible=reproducible)
    twin = copy.deepcopy(opt)
    assert twin.comm is opt.comm and twin.inner is not opt.inner and twin.param_groups[0]["lr"] == 0.1
    back = pickle.loads(pickle.dumps(opt))
    assert back.comm is coll.world() and back.param_groups[0]["lr"] == 0.1
    model(torch.ones(1, 2)).sum().backward()
    twin.step()  # usable: averages the copied parameters' gradients (None here: nothing to do) and steps


def test_a_very_deep_tree_is_a_value_error_on_every_rank(comm):
    deep = np.ones(1)
    for _ in range(1200):
        deep = [deep]
    with pytest.raises(ValueError, match="levels deep"):
        coll.allreduce_tree(deep, comm=comm)


def test_a_leaf_root_cannot_pickle_raises_there_and_is_named_on_every_other_rank(comm):
    """The one agreement protocol (_agree): the refusing rank raises its own error, every other rank a
    MismatchError that names that rank and its error (was a bare CollectiveError off root)."""
    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle Unpicklable")

    tree = {"w": np.ones(2), "o": Unpicklable() if comm.rank == 0 else 1}
    if comm.size == 1:  # one rank sends nothing, so nothing is pickled
        assert coll.synchronize(tree, root=0, comm=comm) is tree
        return
    want = TypeError if comm.rank == 0 else coll.MismatchError
    with pytest.raises(want, match="cannot pickle Unpicklable") as info:
        coll.synchronize(tree, root=0, comm=comm)
    if comm.rank != 0:
        assert "synchronize refused by rank 0: rank 0 raised TypeError" in str(info.value)
    x = np.ones(2)
    comm.allreduce(x)
    assert (x == comm.size).all()


# ---- thread safety: a collective while another thread of the process is inside one is refused ----

class _BlockingLeaf:
    """An array-like whose device query waits for ``go``: the thread calling a collective on it stays
    inside that collective (before any communication) until the test lets it go; then it is refused."""

    def __init__(self, inside, go):
        self.inside, self.go = inside, go

    def __dlpack__(self, **kwargs):
        raise TypeError("not really an array")

    def __dlpack_device__(self):
        self.inside.set()
        self.go.wait(60)
        raise TypeError("not really an array (test)")


@pytest.mark.parametrize("second", ["allreduce", "coll.allreduce", "broadcast", "coll.broadcast", "reduce",
                                    "allgather", "barrier", "synchronize", "allreduce_tree", "handle.wait",
                                    "handle.done", "torch reduce", "torch allgather", "torch reduce_scatter",
                                    "torch alltoall"])
def test_a_collective_from_a_second_thread_at_once_is_refused(comm, second):
    import threading

    x = np.ones(2)
    comm.allreduce(x)  # warm: the hot paths are refused too
    comm.broadcast(x)
    comm.allgather(x)
    comm.reduce(x)
    tensors = {}
    if second.startswith("torch"):
        torch = pytest.importorskip("torch")
        t = tensors["t"] = torch.ones(2 * comm.size)
        for name in ("reduce", "allgather", "reduce_scatter", "alltoall"):  # warm for the tensor's dtype
            getattr(comm, name)(t)
    pending = np.ones(3)
    h = comm.allreduce(pending, async_op=True)  # waiting calls MPI: refused as a collective is
    inside, go = threading.Event(), threading.Event()
    outcome = {}

    def first():
        try:
            comm.allreduce_tree({"w": _BlockingLeaf(inside, go)})
        except Exception as exc:  # noqa: BLE001 - looked at below
            outcome["first"] = exc

    t = threading.Thread(target=first)
    t.start()
    try:
        assert inside.wait(60)
        calls = {"allreduce": lambda: comm.allreduce(x), "coll.allreduce": lambda: coll.allreduce(x, comm=comm),
                 "broadcast": lambda: comm.broadcast(x), "coll.broadcast": lambda: coll.broadcast(x, comm=comm),
                 "reduce": lambda: comm.reduce(x), "allgather": lambda: comm.allgather(x),
                 "barrier": comm.barrier, "synchronize": lambda: comm.synchronize({"x": x}),
                 "allreduce_tree": lambda: comm.allreduce_tree({"x": x}), "handle.wait": h.wait,
                 "handle.done": h.done}
        if tensors:
            name = second.split()[1]
            calls[second] = lambda: getattr(comm, name)(tensors["t"])
        before = x.copy()
        with pytest.raises(coll.CollectiveError, match="another thread of this process is inside a collective"):
            calls[second]()
        assert (x == before).all()
    finally:
        go.set()
        t.join(60)
    assert h.wait() is pending and (pending == comm.size).all()  # the refused wait left the handle usable
    assert isinstance(outcome.get("first"), TypeError), outcome  # the first call ended normally (its error)
    y = np.ones(2)
    comm.allreduce(y)  # the guard was released: one thread at a time works
    assert (y == comm.size).all()


def test_python_ints_in_trees_are_exact(comm):
    """Issue 12 item 6: Python int leaves are reduced in arbitrary precision (no int64 wrap, no mismatch
    for values that straddle 2**63, no object-array message for 2**70); mean is refused, as for integer
    arrays; NumPy integer scalars keep their dtype's semantics."""
    n, r = comm.size, comm.rank
    tree = {"big": 2**62, "huge": 2**70 * (r + 1), "straddle": 2**63 - 1 + r, "neg": -(2**80) + r,
            "w": np.ones(2), "np": np.int8(100)}
    out = coll.allreduce_tree(tree, op="sum", comm=comm)
    assert out["big"] == n * 2**62 and type(out["big"]) is int
    assert out["huge"] == 2**70 * n * (n + 1) // 2
    assert out["straddle"] == n * (2**63 - 1) + n * (n - 1) // 2
    assert out["neg"] == -n * 2**80 + n * (n - 1) // 2
    assert out["w"].tolist() == [n, n] and out["np"] == np.int8((100 * n + 128) % 256 - 128)
    assert coll.allreduce_tree({"p": 2**40 + r}, op="prod", comm=comm)["p"] == math.prod(2**40 + k for k in range(n))
    assert coll.allreduce_tree({"m": 2**100 * (r + 1)}, op="max", comm=comm)["m"] == 2**100 * n
    assert coll.allreduce_tree({"m": 2**100 * (r + 1)}, op="min", comm=comm)["m"] == 2**100
    with pytest.raises(TypeError, match=r"leaf \['i'\]: Python int scalar: op='mean' on integer dtype Python int would truncate"):
        coll.allreduce_tree({"i": 3, "w": np.ones(1)}, op="mean", comm=comm)


# ---- a transfer a failure leaves in flight keeps its buffers to the end of the process ----

def test_a_failed_call_s_buffers_outlive_its_communicator(comm):
    """A call that failed with its transfer in flight (here the ranks disagreed only on the op's name, so
    that its data meets on every rank and completes inside some later MPI call) keeps its buffers alive
    after its communicator is closed and dropped: mpi4py frees a request that is let go with
    ``MPI_Request_free``, which lets the operation run on, and MPI then wrote into memory the process had
    reused (the heap of 3-rank test runs was corrupted so, and ranks died later in torch code). Seen through
    a weak reference to the caller's array, with every reference of the caller's gone."""
    import gc
    import weakref

    if comm.size < 2:
        pytest.skip("a disagreement needs two ranks")
    c = coll.init(comm=MPI.COMM_WORLD.Dup())
    x = np.ones(2)
    alive = weakref.ref(x)
    with pytest.raises(coll.MismatchError):
        c.allreduce(x, "sum" if c.rank else "mean", async_op=True).wait()
    c.close()
    del c, x
    gc.collect()
    assert alive() is not None, "the array of a transfer left in flight was freed"
    comm.barrier()


@pytest.mark.parametrize("collective", ["allreduce", "allgather", "reduce_scatter"])
def test_a_failed_call_of_the_asynchronous_hot_path_keeps_its_buffers(comm, collective):
    """The same on the asynchronous hot path (a second asynchronous call of a dtype, no validation): the
    ranks disagree on the op's name (allreduce, reduce_scatter: sum and mean travel alike) or on the dtype
    (allgather: float64 and int64, eight bytes each), the transfer meets on every rank, the fingerprint
    refuses it; the input and the output the transfer writes outlive the communicator."""
    import gc
    import weakref

    if comm.size < 2:
        pytest.skip("a disagreement needs two ranks")
    c = coll.init(comm=MPI.COMM_WORLD.Dup())
    n = 2 * c.size
    for dtype in (np.float64, np.int64) if collective == "allgather" else (np.float64,):
        for op in ("sum", "mean"):  # fills the asynchronous hot path's tables
            if collective == "allgather":
                c.allgather(np.ones(n, dtype), async_op=True).wait()
            else:
                getattr(c, collective)(np.ones(n, dtype), op, async_op=True).wait()
    odd = c.rank == c.size - 1
    x = np.ones(n, np.int64 if odd and collective == "allgather" else np.float64)
    out = np.empty((c.size, n) if collective == "allgather" else (n // c.size,), x.dtype)
    alive = [weakref.ref(x), weakref.ref(out)]
    with pytest.raises(coll.MismatchError):
        if collective == "allgather":
            c.allgather(x, out=out, async_op=True).wait()
        elif collective == "allreduce":
            c.allreduce(x, "mean" if odd else "sum", async_op=True).wait()
        else:
            c.reduce_scatter(x, "mean" if odd else "sum", out=out, async_op=True).wait()
    assert engine_of(c).trace_entries()[-1]["path"] == "hot path, asynchronous"  # (the record, a private:
    # the one place that says which path a call took)
    c.close()
    del c, x, out
    gc.collect()
    assert alive[0]() is not None, "the input of a transfer left in flight was freed"
    assert collective == "allreduce" or alive[1]() is not None, "the output of a transfer left in flight was freed"
    comm.barrier()

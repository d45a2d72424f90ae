"""The array collectives at any world size, on NumPy, torch (CPU) and array-api-strict."""

import numpy as np
import pytest

import collectives as coll
from support.comms import communicator
from support.arrays import DTYPES, LIBS, has, legal, make, rank_values, reduce_reference, to_numpy

OPS = ["sum", "prod", "min", "max", "mean"]
SHAPES = [(), (0,), (7,), (3, 5)]


def cases(with_op=True):
    out = []
    for lib in LIBS:
        for dtype in DTYPES:
            if not has(lib, dtype):
                continue
            for op in OPS if with_op else [None]:
                out.append(pytest.param(lib, dtype, op, id=f"{lib}-{dtype}" + (f"-{op}" if op else "")))
    return out


def assert_reduced(got, want, dtype, op):
    """Exact, except where float16/bfloat16 rounding of a mean or product makes the order matter."""
    if dtype in ("float16", "bfloat16") and op in ("mean", "prod"):
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-2)
    else:
        assert got.dtype == want.dtype or dtype == "bfloat16"
        np.testing.assert_array_equal(got.astype(want.dtype), want)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.tobytes() == np.ascontiguousarray(b, dtype=a.dtype).tobytes()


@pytest.mark.parametrize("lib,dtype,op", cases())
def test_allreduce_every_dtype_and_op(comm, lib, dtype, op):
    shape = (3, 5)
    mine = rank_values(comm.rank, shape, dtype, op)
    x = make(lib, mine, dtype)
    before = to_numpy(x).copy()
    if not legal(op, dtype):
        with pytest.raises(TypeError, match="op="):
            coll.allreduce(x, op=op, comm=comm)
        assert same_bits(before, to_numpy(x))
        return
    y = coll.allreduce(x, op=op, comm=comm)
    want = reduce_reference([rank_values(r, shape, dtype, op) for r in range(comm.size)], op, dtype)
    assert_reduced(to_numpy(y), want, dtype, op)
    if lib == "strict":
        assert y is not x and same_bits(before, to_numpy(x)), "immutable input must be untouched"
    else:
        assert y is x, "writable NumPy/torch arrays are reduced in place"


@pytest.mark.parametrize("lib,dtype,op", cases())
def test_reduce_every_root(comm, lib, dtype, op):
    shape = (4,)
    for root in range(comm.size):
        mine = rank_values(comm.rank, shape, dtype, op)
        x = make(lib, mine, dtype)
        before = to_numpy(x).copy()
        if not legal(op, dtype):
            with pytest.raises(TypeError):
                coll.reduce(x, op=op, root=root, comm=comm)
            assert same_bits(before, to_numpy(x))
            continue
        want = reduce_reference([rank_values(r, shape, dtype, op) for r in range(comm.size)], op, dtype)
        for _ in range(2):  # the second call to a root: the hot path, where it has one (NumPy, CPU tensors)
            x = make(lib, mine, dtype)
            y = coll.reduce(x, op=op, root=root, comm=comm)
            if comm.rank == root:
                assert_reduced(to_numpy(y), want, dtype, op)
            else:
                assert y is x and same_bits(before, to_numpy(x)), "non-root ranks get x back unchanged"


@pytest.mark.parametrize("lib,dtype,op", cases(with_op=False))
def test_broadcast_every_dtype_every_root_bit_for_bit(comm, lib, dtype, op):
    for root in range(comm.size):
        for shape in SHAPES:
            x = make(lib, rank_values(comm.rank, shape, dtype), dtype)
            y = coll.broadcast(x, root=root, comm=comm)
            want = make(lib, rank_values(root, shape, dtype), dtype)
            assert same_bits(to_numpy(want), to_numpy(y))
            assert tuple(to_numpy(y).shape) == shape


@pytest.mark.parametrize("lib,dtype,op", cases(with_op=False))
def test_allgather_every_dtype(comm, lib, dtype, op):
    for shape in SHAPES:
        x = make(lib, rank_values(comm.rank, shape, dtype), dtype)
        before = to_numpy(x).copy()
        for _ in range(2):  # the second call of a shape: the hot path, where it has one (NumPy, CPU tensors)
            g = coll.allgather(x, comm=comm)
            assert type(g) is type(x)
            got = to_numpy(g)
            assert got.shape == (comm.size,) + shape
            for r in range(comm.size):
                assert same_bits(to_numpy(make(lib, rank_values(r, shape, dtype), dtype)), got[r])
            if lib == "strict":  # its arrays are not written in place: out= is refused, before any transfer
                with pytest.raises(TypeError, match="out must be an array the collective can write in place"):
                    coll.allgather(x, out=make(lib, np.zeros((comm.size,) + shape), dtype), comm=comm)
                continue
            out = make(lib, np.zeros((comm.size,) + shape), dtype)
            assert coll.allgather(x, out=out, comm=comm) is out  # (the second: the hot path into out)
            assert same_bits(to_numpy(out), got)
        assert same_bits(before, to_numpy(x)), "allgather never writes x"


BAD_OUT = {  # out= that every rank passes alike (``rows``: the result's shape): refused on every rank before
    # any transfer, nothing written
    "shape": (lambda lib, rows: make(lib, np.zeros((rows[0] + 1, 3)), "float64"), ValueError, "out must have shape"),
    "flat": (lambda lib, rows: make(lib, np.zeros((rows[0] * 3,)), "float64"), ValueError, "out must have shape"),
    "dtype": (lambda lib, rows: make(lib, np.zeros(rows), "float32"), TypeError, "out must have x's dtype"),
    "library": (lambda lib, rows: make("torch" if lib == "numpy" else "numpy", np.zeros(rows), "float64"),
                TypeError, "out must be an array of x's library"),
    "list": (lambda lib, rows: [[0.0] * 3] * rows[0], TypeError, "list"),
    "read-only": (lambda lib, rows: np.zeros(rows).view(), TypeError, "read-only"),
}


@pytest.mark.parametrize("collective", ["allgather", "reduce_scatter"])
@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("case", sorted(BAD_OUT))
def test_a_bad_out_is_refused_before_any_transfer(comm, collective, lib, case):
    if lib == "torch":
        pytest.importorskip("torch")
    make_out, err, text = BAD_OUT[case]
    mine = np.arange(3.0 * comm.size).reshape(comm.size, 3) + comm.rank
    x = make(lib, mine[0] if collective == "allgather" else mine, "float64")
    out = make_out(lib, (comm.size, 3) if collective == "allgather" else (1, 3))
    if case == "read-only":
        if lib == "torch":
            pytest.skip("a torch tensor is always written in place")
        out.flags.writeable = False
    call = getattr(coll, collective)
    before = np.array(to_numpy(out) if not isinstance(out, list) else out)
    for bad in (lambda: call(x, out=out, comm=comm), lambda: call(x, out=out, comm=comm, async_op=True).wait()):
        for _ in range(2):  # the second: after the hot path is warm for x's dtype
            with pytest.raises(err, match=text):
                bad()
            call(x, comm=comm)  # every rank is still in step
    assert same_bits(before, np.array(to_numpy(out) if not isinstance(out, list) else out)), "out untouched"
    assert same_bits(to_numpy(x), mine[0] if collective == "allgather" else mine)


@pytest.mark.parametrize("lib,dtype,op", cases(with_op=False))
def test_gather_every_dtype_every_root(comm, lib, dtype, op):
    for root in range(comm.size):
        for shape in SHAPES:
            x = make(lib, rank_values(comm.rank, shape, dtype), dtype)
            before = to_numpy(x).copy()
            g = coll.gather(x, root=root, comm=comm)
            assert same_bits(before, to_numpy(x)), "gather never writes x"
            if comm.rank != root:
                assert g is None
                continue
            assert type(g) is type(x)
            got = to_numpy(g)
            assert got.shape == (comm.size,) + shape
            for r in range(comm.size):
                assert same_bits(to_numpy(make(lib, rank_values(r, shape, dtype), dtype)), got[r])


def test_gather_refuses_a_bad_root_before_communicating(comm):
    x = np.arange(3.0)
    for root in (comm.size, -1, 1.5, "0"):
        with pytest.raises((ValueError, TypeError)):
            coll.gather(x, root=root, comm=comm)
    assert (x == np.arange(3.0)).all()
    assert coll.gather(x, root=0, comm=comm) is None or comm.rank == 0  # the communicator still works


def test_broadcast_opaque_numpy_dtypes_bit_for_bit(comm):
    rec = np.zeros(3, dtype=[("a", "i4"), ("b", "f8")])
    rec["a"] = comm.rank
    rec["b"] = comm.rank / 3
    strings = np.array([f"rank{comm.rank}", "x" * comm.rank], dtype="U8")
    dates = np.array(["2026-11-29"], dtype="datetime64[D]") + comm.rank
    nan_payload = np.array([np.nan, -0.0, np.inf], dtype=np.float64)
    nan_payload.view(np.uint64)[0] |= comm.rank  # distinct NaN payloads must survive
    for arr in (rec, strings, dates, nan_payload):
        want = comm.allgather(arr)[0]
        out = coll.broadcast(arr, root=0, comm=comm)
        assert out is arr and out.tobytes() == want.tobytes()
    with pytest.raises(TypeError, match="numeric dtype"):
        coll.allreduce(rec, comm=comm)


def test_object_arrays_are_refused(comm):
    x = np.array([object(), 1], dtype=object)
    for call in (lambda: coll.broadcast(x, comm=comm), lambda: coll.allreduce(x, comm=comm),
                 lambda: coll.allgather(x, comm=comm)):
        with pytest.raises(TypeError, match="object arrays"):
            call()


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_non_contiguous_view_only_its_elements_change(comm, lib):
    base_np = np.arange(24, dtype=np.float64).reshape(4, 6) + 100 * comm.rank
    base = make(lib, base_np, "float64")
    view = base[1:, ::2]
    untouched = to_numpy(base).copy()
    y = coll.allreduce(view, op="sum", comm=comm)
    assert y is view
    full = to_numpy(base)
    want = sum(np.arange(24.0).reshape(4, 6)[1:, ::2] + 100 * r for r in range(comm.size))
    np.testing.assert_array_equal(to_numpy(view), want)
    mask = np.ones((4, 6), bool)
    mask[1:, ::2] = False
    np.testing.assert_array_equal(full[mask], untouched[mask])
    z = coll.broadcast(base[:, 1], root=comm.size - 1, comm=comm)
    np.testing.assert_array_equal(to_numpy(z), np.arange(24.0).reshape(4, 6)[:, 1] + 100 * (comm.size - 1))


def test_fortran_order(comm):
    x = np.asfortranarray(np.arange(12.0).reshape(3, 4) * (comm.rank + 1))
    y = coll.allreduce(x, op="max", comm=comm)
    assert y is x and x.flags.f_contiguous
    np.testing.assert_array_equal(x, np.arange(12.0).reshape(3, 4) * comm.size)
    g = coll.allgather(np.asfortranarray(np.arange(6).reshape(2, 3) + comm.rank), comm=comm)
    for r in range(comm.size):
        np.testing.assert_array_equal(g[r], np.arange(6).reshape(2, 3) + r)


def test_read_only_input_is_untouched(comm):
    x = np.full(5, comm.rank + 1.0)
    x.flags.writeable = False
    y = coll.allreduce(x, op="sum", comm=comm)
    assert y is not x and type(y) is np.ndarray
    np.testing.assert_array_equal(x, np.full(5, comm.rank + 1.0))
    np.testing.assert_array_equal(y, np.full(5, comm.size * (comm.size + 1) / 2))
    b = coll.broadcast(x, root=0, comm=comm)
    assert b is not x and (b == 1.0).all() and (x == comm.rank + 1).all()


def test_torch_parameter_broadcast_in_place(comm):
    torch = pytest.importorskip("torch")
    layer = torch.nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight.fill_(comm.rank)
    w = layer.weight
    out = coll.broadcast(w, root=comm.size - 1, comm=comm)
    assert out is w and w.requires_grad
    assert (w.detach() == comm.size - 1).all()
    loss = layer(torch.ones(1, 3)).sum()
    loss.backward()  # autograd still works after the in-place broadcast
    assert layer.weight.grad is not None


def test_torch_conjugated_view_written_back(comm):
    torch = pytest.importorskip("torch")
    x = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (comm.rank + 1)
    c = x.conj()  # a lazily conjugated view
    y = coll.allreduce(c, op="sum", comm=comm)
    assert y is c
    s = comm.size * (comm.size + 1) / 2
    np.testing.assert_allclose(y.resolve_conj().numpy(), np.array([1 - 2j, 3 + 1j]) * s)


@pytest.mark.parametrize("lib", LIBS)
def test_zero_d_and_empty(comm, lib):
    x = make(lib, np.asarray(comm.rank + 1.0), "float64")
    y = coll.allreduce(x, op="mean", comm=comm)
    assert to_numpy(y).shape == () and float(to_numpy(y)) == (comm.size + 1) / 2
    e = make(lib, np.zeros((0, 3)), "float32")
    assert to_numpy(coll.allreduce(e, comm=comm)).shape == (0, 3)
    assert to_numpy(coll.broadcast(e, comm=comm)).shape == (0, 3)
    assert to_numpy(coll.allgather(e, comm=comm)).shape == (comm.size, 0, 3)


def test_float16_widened_path_matches_native(comm, monkeypatch):
    x = np.full(8, 0.1 * (comm.rank + 1), dtype=np.float16)
    native = coll.allreduce(x.copy(), op="mean", comm=comm)
    monkeypatch.setattr(comm._host, "_float16", False)  # as on an MPI without MPI_FLOAT16
    monkeypatch.setattr(comm, "_fast", {})  # the calls cached for the transport as it was (internal: no
    monkeypatch.setattr(comm, "_runners", {})  # public way to change a live transport's capabilities)
    monkeypatch.setattr(comm, "_fast_broadcast", {})
    monkeypatch.setattr(comm, "_fast_blocks", {})
    widened = coll.allreduce(x.copy(), op="mean", comm=comm)
    want = (sum(np.float32(np.float16(0.1 * (r + 1))) for r in range(comm.size)) / comm.size)
    np.testing.assert_allclose(widened.astype(np.float32), want, rtol=1e-3)
    np.testing.assert_allclose(native.astype(np.float32), want, rtol=1e-2)


def test_bfloat16_rounds_to_nearest(comm):
    torch = pytest.importorskip("torch")
    vals = torch.tensor([1.0, 1.0 / 3, 1e-3, 300.0]) * (comm.rank + 1)
    x = vals.to(torch.bfloat16)
    coll.allreduce(x, op="mean", comm=comm)
    parts = [(torch.tensor([1.0, 1.0 / 3, 1e-3, 300.0]) * (r + 1)).to(torch.bfloat16).float()
             for r in range(comm.size)]
    want = (sum(parts) / comm.size).to(torch.bfloat16)
    assert torch.equal(x, want)


def test_broadcast_hot_path_kinds(comm, monkeypatch):
    """The broadcast fast path is MPI's own Bcast where mpi4py types the buffer, else a closure that falls
    back to pieces when an older mpi4py refuses a count past 2**31-1 (OverflowError, before any data)."""
    host = comm._host
    if not hasattr(host, "_typed_from_buffer"):
        pytest.skip("not the MPI transport")
    if host.timeout is not None:
        pytest.skip("the deadline transport (COLLECTIVES_TIMEOUT) polls every broadcast: no fast path")
    direct = host.fast_call("broadcast", np.dtype(np.float32), comm.size)
    if host._large_counts:  # MPICH: one call at any count
        assert direct == host._lanes["broadcast"].Bcast  # (the broadcast lane: see MPITransport.__init__)
    else:  # Open MPI refuses counts past 2**31-1: a closure that cuts them in pieces
        assert direct != host._lanes["broadcast"].Bcast
    monkeypatch.setattr(host, "_large_counts", True)  # the closure of older mpi4py, below, on any MPI

    class OldMpi4py:  # refuses the first call as mpi4py 3 refuses a count that does not fit an int
        def __init__(self, comm):
            self.comm, self.refused = comm, 0

        def Bcast(self, buf, root):
            if not self.refused:
                self.refused += 1
                raise OverflowError("value too large to convert to int")
            return self.comm.Bcast(buf, root)

    fake = OldMpi4py(host._lanes["broadcast"])
    monkeypatch.setattr(host, "_typed_from_buffer", lambda dtype: False)
    monkeypatch.setitem(host._lanes, "broadcast", fake)
    run = host.fast_call("broadcast", np.dtype(np.float32), comm.size)
    x = np.arange(5, dtype=np.float32) + comm.rank
    run(x, comm.size - 1)
    assert fake.refused == 1
    np.testing.assert_array_equal(x, np.arange(5, dtype=np.float32) + comm.size - 1)


@pytest.fixture
def small_counts(comm):
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend")
    with communicator(COLLECTIVES_MAX_COUNT=7) as c:
        yield c


def test_chunked_counts(small_counts):
    """Messages past the per-call count limit are split; checked with a small limit."""
    comm = small_counts
    x = np.arange(50, dtype=np.int64) * (comm.rank + 1)
    coll.allreduce(x, comm=comm)
    np.testing.assert_array_equal(x, np.arange(50) * comm.size * (comm.size + 1) // 2)
    b = np.arange(23, dtype=np.float32) + comm.rank
    coll.broadcast(b, root=comm.size - 1, comm=comm)
    np.testing.assert_array_equal(b, np.arange(23, dtype=np.float32) + comm.size - 1)
    r = coll.reduce(np.arange(30.0) + comm.rank, op="max", root=0, comm=comm)
    if comm.rank == 0:
        np.testing.assert_array_equal(r, np.arange(30.0) + comm.size - 1)
    g = coll.allgather(np.arange(9, dtype=np.int16) + comm.rank, comm=comm)
    for i in range(comm.size):
        np.testing.assert_array_equal(g[i], np.arange(9) + i)


def test_bad_arguments_raise_before_communicating(comm):
    x = np.arange(4.0) + comm.rank
    before = x.copy()
    with pytest.raises(ValueError, match="unknown op='avg'"):
        coll.allreduce(x, op="avg", comm=comm)
    with pytest.raises(TypeError, match="op must be a string"):
        coll.allreduce(x, op=None, comm=comm)
    with pytest.raises(ValueError, match=f"root={comm.size} is out of range"):
        coll.broadcast(x, root=comm.size, comm=comm)
    with pytest.raises(ValueError, match="out of range"):
        coll.reduce(x, root=-1, comm=comm)
    with pytest.raises(TypeError, match="root must be an integer"):
        coll.broadcast(x, root=0.0, comm=comm)
    with pytest.raises(TypeError, match="root must be an integer"):
        coll.broadcast(x, root=True, comm=comm)
    with pytest.raises(TypeError, match="expected an array, got list"):
        coll.allreduce([1.0, 2.0], comm=comm)
    with pytest.raises(TypeError, match="expected an array, got float"):
        coll.broadcast(3.0, comm=comm)
    with pytest.raises(TypeError, match="integer dtype int64 would truncate"):
        coll.allreduce(np.arange(3), op="mean", comm=comm)
    np.testing.assert_array_equal(x, before)
    # numpy integer roots are fine; the communicator is still usable after the errors
    coll.broadcast(x, root=np.int64(comm.size - 1), comm=comm)
    np.testing.assert_array_equal(x, np.arange(4.0) + comm.size - 1)


def test_nan_and_inf_propagate(comm):
    x = np.array([np.nan if comm.rank == 0 else 1.0, np.inf, 1.0])
    coll.allreduce(x, op="sum", comm=comm)
    assert np.isnan(x[0]) and x[1] == np.inf and x[2] == comm.size


def test_methods_equal_functions_and_barrier(comm):
    a = np.arange(3.0) + comm.rank
    b = a.copy()
    comm.allreduce(a, op="sum")
    coll.allreduce(b, op="sum", comm=comm)
    np.testing.assert_array_equal(a, b)
    comm.barrier()
    coll.barrier(comm=comm)


def test_identity_and_local_rank(comm):
    assert comm is coll.init() is coll.world()
    assert 0 <= comm.rank < comm.size
    assert 0 <= comm.local_rank < comm.local_size <= comm.size
    ranks = coll.allgather(np.array([comm.rank, comm.local_rank, comm.local_size]), comm=comm)
    assert sorted(ranks[:, 0].tolist()) == list(range(comm.size))
    # all ranks of these tests run on one machine: node-local ranks are 0..size-1 here
    assert sorted(ranks[:, 1].tolist()) == list(range(comm.size)) and set(ranks[:, 2]) == {comm.size}
    assert comm.backend == "mpi"


def test_user_communicator_is_duplicated(comm):
    from mpi4py import MPI

    user = MPI.COMM_WORLD.Split(color=0, key=comm.size - comm.rank)  # reversed order
    try:
        c = coll.init(comm=user)
        assert c is coll.init(comm=user) and c is not comm
        assert c.rank == comm.size - 1 - comm.rank and c.size == comm.size
        assert MPI.Comm.Compare(c._host.comm, user) == MPI.CONGRUENT  # a duplicate, not the same
        x = np.array([float(c.rank)])
        coll.broadcast(x, root=0, comm=user)  # an mpi4py communicator is accepted as comm=
        assert x[0] == 0.0
        assert coll.world() is comm  # the default is unchanged
    finally:
        user.Free()  # releases (closes) the library communicator made for it


def test_reduce_non_root_widened_dtypes_leave_input_bit_for_bit(comm, monkeypatch):
    """bfloat16 (and float16 where MPI lacks it) are widened; non-root ranks must not write back."""
    torch = pytest.importorskip("torch")
    bits = torch.tensor([0x7F81, 0x3F80, 0x0001], dtype=torch.int16)  # signalling NaN, 1.0, a subnormal
    x = bits.clone().view(torch.bfloat16)
    y = coll.reduce(x, op="max", root=0, comm=comm)
    if comm.rank != 0:
        assert y is x and torch.equal(x.view(torch.int16), bits)
    monkeypatch.setattr(comm._host, "_float16", False)
    monkeypatch.setattr(comm, "_fast", {})  # the calls cached for the transport as it was (internal: no
    monkeypatch.setattr(comm, "_runners", {})  # public way to change a live transport's capabilities)
    monkeypatch.setattr(comm, "_fast_broadcast", {})
    h = np.array([1.5, -2.0], dtype=np.float16)
    h.flags.writeable = False
    out = coll.reduce(h, op="mean", root=0, comm=comm)
    if comm.rank == 0:
        np.testing.assert_array_equal(out, h)
    else:
        assert out is h


def test_zero_d_bfloat16_reductions(comm):
    """Found by the conformance suite: 0-d bfloat16 buffers must stay arrays through the widening."""
    torch = pytest.importorskip("torch")
    for op, want in (("sum", comm.size * (comm.size + 1) / 2), ("max", comm.size), ("min", 1.0),
                     ("mean", (comm.size + 1) / 2)):
        x = torch.tensor(float(comm.rank + 1), dtype=torch.bfloat16)
        assert coll.allreduce(x, op=op, comm=comm) is x
        assert float(x) == torch.tensor(want, dtype=torch.bfloat16).item(), (op, float(x))


def test_torch_tensors_take_the_hot_paths_of_reduce_allgather_reduce_scatter_alltoall(comm, monkeypatch):
    """Plain CPU tensors of a real dtype get the cached calls of reduce, allgather, reduce_scatter and
    alltoall from their second call on (keyed by the tensor's dtype), with the general path's results: a
    new tensor of its dtype, the root's tensor written in place with a new version, the others' untouched;
    bfloat16 and strided views keep the general path and give the right results too."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(comm, "_fast_blocks", {})  # the calls cached so far (internal: no public view of it)
    n, root = comm.size, comm.size - 1
    ranks = torch.arange(n, dtype=torch.float64)
    for _ in range(2):  # the first call fills the cache, the second uses it
        g = comm.allgather(torch.full((2,), float(comm.rank), requires_grad=True))  # read only: a leaf is fine
        assert type(g) is torch.Tensor and g.dtype == torch.float32 and not g.requires_grad
        assert torch.equal(g, ranks.float()[:, None].expand(n, 2))
        i = torch.arange(2 * n, dtype=torch.int64).reshape(n, 2) * (comm.rank + 1)
        mine = comm.reduce_scatter(i, "sum")
        assert mine.dtype == torch.int64 and torch.equal(mine, torch.arange(2 * n).reshape(n, 2)[comm.rank:comm.rank + 1]
                                                         * (n * (n + 1) // 2))
        a = comm.alltoall(torch.full((n, 3), float(comm.rank), dtype=torch.float64) + torch.arange(n)[:, None])
        assert a.dtype == torch.float64 and torch.equal(a, ranks[:, None].expand(n, 3) + comm.rank)
        r = torch.full((3,), float(comm.rank + 1))
        before = r._version  # torch's public read of the counter
        assert comm.reduce(r, "sum", root) is r
        if comm.rank == root:
            assert torch.equal(r, torch.full((3,), n * (n + 1) / 2)) and r._version > before
        else:
            assert torch.equal(r, torch.full((3,), float(comm.rank + 1))) and r._version == before
        b = comm.allgather(torch.full((2,), float(comm.rank), dtype=torch.bfloat16))
        assert b.dtype == torch.bfloat16 and torch.equal(b.float(), ranks.float()[:, None].expand(n, 2))
        wide = torch.zeros(n, 4)
        wide[:, ::2] = float(comm.rank)
        assert torch.equal(comm.alltoall(wide[:, ::2]), ranks.float()[:, None].expand(n, 2))  # a strided view
    assert {("allgather", torch.float32), ("reduce_scatter", "sum", torch.int64), ("alltoall", torch.float64),
            ("reduce", "sum", torch.float32)} <= set(comm._fast_blocks)
    assert not any(torch.bfloat16 in key for key in comm._fast_blocks)


def test_torch_hot_path_cached_only_where_it_is_exact(comm, monkeypatch):
    """CPU torch tensors of a real dtype get the cached direct call (keyed by the torch dtype) from their
    second call on; bfloat16, complex, subclasses (nn.Parameter) and non-contiguous views keep the
    general path, and every one of them gives the right result either way."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(comm, "_fast", {})  # the calls cached for the transport as it was (internal: no
    monkeypatch.setattr(comm, "_runners", {})  # public way to change a live transport's capabilities)
    monkeypatch.setattr(comm, "_fast_broadcast", {})
    n, root = comm.size, comm.size - 1
    for _ in range(2):  # the first call fills the cache, the second uses it
        t = torch.full((3,), float(comm.rank + 1))
        assert comm.allreduce(t, op="mean") is t and torch.equal(t, torch.full((3,), (n + 1) / 2))
        g = torch.full((4,), float(comm.rank), requires_grad=True)  # a leaf that requires grad: in place
        assert comm.broadcast(g, root) is g and bool((g == root).all())
        i = torch.arange(4, dtype=torch.int16) * (comm.rank + 1)
        assert comm.allreduce(i, op="max") is i and torch.equal(i, torch.arange(4, dtype=torch.int16) * n)
        b = torch.full((2,), float(comm.rank + 1), dtype=torch.bfloat16)
        comm.allreduce(b, op="sum")
        assert torch.equal(b, torch.full((2,), float(n * (n + 1) // 2), dtype=torch.bfloat16))
        z = torch.full((2,), 1 + 1j * comm.rank, dtype=torch.complex64).conj()  # a lazily conjugated view
        comm.allreduce(z, op="sum")
        assert torch.allclose(z, torch.full((2,), n - 1j * sum(range(n)), dtype=torch.complex64))
        p = torch.nn.Parameter(torch.full((2,), float(comm.rank)))
        assert comm.broadcast(p, root) is p and bool((p == root).all())
        base = torch.full((4, 2), float(comm.rank + 1))
        comm.allreduce(base[:, 0], op="sum")  # a strided view: only its elements change
        assert bool((base[:, 0] == n * (n + 1) / 2).all()) and bool((base[:, 1] == comm.rank + 1).all())
    assert set(comm._fast["mean"]) == {torch.float32} and set(comm._fast["max"]) == {torch.int16}
    assert torch.bfloat16 not in comm._fast.get("sum", {}) and torch.complex64 not in comm._fast.get("sum", {})
    assert set(comm._fast_broadcast) == {torch.float32}

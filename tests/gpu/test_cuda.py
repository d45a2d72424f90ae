"""CUDA arrays (torch and CuPy) through the array collectives, at any world size.

Which transport runs depends on the environment, and the tests follow it: NCCL by default;
``COLLECTIVES_DISABLE_NCCL=1`` gives host staging (or CUDA-aware MPI with
``COLLECTIVES_CUDA_AWARE_MPI=1``). Two ranks may share one GPU with ``NCCL_MULTI_RANK_GPU_ENABLE=1``.
"""

import itertools

import numpy as np
import pytest

import collectives as coll
from collectives._comm import engine_of  # the device transports' interface to a Communicator
from collectives import _config
from collectives._backends import _libnccl, cuda, factory
from support.arrays import DTYPES, legal, rank_values, reduce_reference

OPS = ["sum", "prod", "min", "max", "mean"]
CUDA = 2  # DLPack kDLCUDA


# The documented choice (docs/gpu.md), written down as a table rather than computed with the library's own
# choose_transport, so a wrong choice fails here: (NCCL loadable, COLLECTIVES_CUDA_AWARE_MPI, MPI backend)
EXPECTED = {
    (True, None, True): "nccl", (True, True, True): "nccl", (True, False, True): "nccl",
    (False, None, True): "host-staging", (False, True, True): "cuda-aware-mpi", (False, False, True): "host-staging",
    (True, None, False): "nccl", (True, True, False): "nccl", (True, False, False): "nccl",
    (False, None, False): "host-staging", (False, True, False): "host-staging",
    (False, False, False): "host-staging",
}


def expected_transport(comm) -> str:
    info = _libnccl.info()
    nccl = bool(info["available"] and not _config.disable_nccl()
                and tuple(int(p) for p in info["version"].split(".")) >= cuda.MIN_NCCL)
    return EXPECTED[(nccl, _config.cuda_aware_mpi(), comm.backend == "mpi")]


def legal_here(op: str, dtype: str, transport: str) -> bool:
    if not legal(op, dtype):
        return False
    # NCCL has no 16-bit integers and no complex type
    return not (transport == "nccl" and (dtype in ("int16", "uint16") or (dtype.startswith("complex") and op == "prod")))


def assert_reduced(got, want, dtype, op):
    if dtype in ("float16", "bfloat16") and op in ("mean", "prod"):
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-2)
    elif op == "mean":  # ncclAvg may pre-multiply by 1/n: last-bit differences
        single = got.dtype in (np.float32, np.complex64)
        np.testing.assert_allclose(got, want.astype(got.dtype), rtol=1e-6 if single else 1e-12)
    else:
        np.testing.assert_array_equal(got.astype(want.dtype), want)


def transport_of(comm, dev):
    return comm._devices[(CUDA, dev.index)]


def test_transport_is_reported(comm, dev):
    x = dev.make(np.ones(3), "float32")
    assert coll.allreduce(x, comm=comm) is x
    name = cuda.device_transports(engine_of(comm))[f"cuda:{dev.index}"]
    assert name == expected_transport(comm) == transport_of(comm, dev).name
    np.testing.assert_array_equal(dev.to_numpy(x), np.full(3, comm.size, np.float32))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_every_op_and_dtype(comm, dev, dtype, op):
    if not dev.has(dtype):
        pytest.skip(f"{dev.name} has no {dtype}")
    values = [rank_values(r, (3, 5), dtype, op) for r in range(comm.size)]
    x = dev.make(values[comm.rank], dtype)
    ptr = dev.ptr(x)
    if not legal_here(op, dtype, expected_transport(comm)):
        with pytest.raises(TypeError):
            coll.allreduce(x, op, comm=comm)
        np.testing.assert_array_equal(dev.to_numpy(x), dev.to_numpy(dev.make(values[comm.rank], dtype)))
        return
    assert coll.allreduce(x, op, comm=comm) is x
    assert dev.ptr(x) == ptr  # in place, no reallocation
    assert_reduced(dev.to_numpy(x), reduce_reference(values, op, dtype), dtype, op)


def test_nccl_refusals_name_the_reason(comm, dev):
    if expected_transport(comm) != "nccl":
        pytest.skip("NCCL-only rules")
    with pytest.raises(TypeError, match="int16 is not a NCCL type"):
        coll.allreduce(dev.make(np.ones(2), "int16"), comm=comm)
    with pytest.raises(TypeError, match="complex"):
        coll.allreduce(dev.make(np.ones(2), "complex64"), "prod", comm=comm)
    with pytest.raises(TypeError, match="op='max' \\(logical any\\)"):
        coll.allreduce(dev.make(np.ones(2), "bool"), "sum", comm=comm)


@pytest.mark.parametrize("dtype", ["bool", "int16", "int64", "float16", "bfloat16", "float32", "complex128"])
def test_broadcast_bit_for_bit(comm, dev, dtype):
    if not dev.has(dtype):
        pytest.skip(f"{dev.name} has no {dtype}")
    for root in sorted({0, comm.size - 1}):
        values = [rank_values(r, (4, 3), dtype) for r in range(comm.size)]
        x = dev.make(values[comm.rank], dtype)
        assert coll.broadcast(x, root, comm=comm) is x
        np.testing.assert_array_equal(dev.to_numpy(x), dev.to_numpy(dev.make(values[root], dtype)))


@pytest.mark.parametrize("dtype, op", [("float32", "sum"), ("int32", "max"), ("float64", "mean"),
                                       ("complex64", "sum")])
def test_reduce_root_gets_result_others_unchanged(comm, dev, dtype, op):
    for root in sorted({0, comm.size - 1}):
        values = [rank_values(r, (2, 6), dtype, op) for r in range(comm.size)]
        base = dev.make(np.stack([values[comm.rank]] * 2, axis=-1), dtype)  # (2, 6, 2)
        x = base[..., 0]  # non-contiguous
        assert coll.reduce(x, op, root, comm=comm) is x
        got = dev.to_numpy(x)
        if comm.rank == root:
            assert_reduced(got, reduce_reference(values, op, dtype), dtype, op)
        else:
            np.testing.assert_array_equal(got, values[comm.rank].astype(dtype))
        np.testing.assert_array_equal(dev.to_numpy(base[..., 1]), values[comm.rank].astype(dtype))


@pytest.mark.parametrize("dtype", ["bool", "int8", "float16", "bfloat16", "float64", "complex64"])
def test_allgather_new_array_on_the_same_device(comm, dev, dtype):
    if not dev.has(dtype):
        pytest.skip(f"{dev.name} has no {dtype}")
    values = [rank_values(r, (3, 4), dtype) for r in range(comm.size)]
    x = dev.make(values[comm.rank], dtype).T  # non-contiguous
    out = coll.allgather(x, comm=comm)
    assert dev.is_array(out) and dev.device_of(out) == dev.index and out is not x
    assert tuple(out.shape) == (comm.size, 4, 3) and out.dtype == x.dtype
    got = dev.to_numpy(out)
    for r in range(comm.size):
        np.testing.assert_array_equal(got[r], dev.to_numpy(dev.make(values[r], dtype)).T)


@pytest.mark.parametrize("dtype", ["bool", "float16", "bfloat16", "float64"])
def test_gather_on_root_only_on_the_same_device(comm, dev, dtype):
    if not dev.has(dtype):
        pytest.skip(f"{dev.name} has no {dtype}")
    values = [rank_values(r, (3, 4), dtype) for r in range(comm.size)]
    x = dev.make(values[comm.rank], dtype)
    for root in range(comm.size):
        for out in (coll.gather(x, root, comm=comm), coll.gather(x, root, comm=comm, async_op=True).wait()):
            if comm.rank != root:
                assert out is None
                continue
            assert dev.is_array(out) and dev.device_of(out) == dev.index
            got = dev.to_numpy(out)
            for r in range(comm.size):
                np.testing.assert_array_equal(got[r], dev.to_numpy(dev.make(values[r], dtype)))


def test_empty_and_zero_d(comm, dev):
    e = dev.make(np.zeros(0), "float32")
    assert coll.allreduce(e, comm=comm) is e and coll.broadcast(e, 0, comm=comm) is e
    assert tuple(coll.allgather(e, comm=comm).shape) == (comm.size, 0)
    s = dev.make(np.array(comm.rank + 1.0), "float64")
    coll.allreduce(s, "sum", comm=comm)
    assert float(dev.to_numpy(s)) == comm.size * (comm.size + 1) / 2
    g = coll.allgather(s, comm=comm)
    assert tuple(g.shape) == (comm.size,)


def test_non_contiguous_views_are_written_in_place(comm, dev):
    base = dev.make(np.full((4, 6), comm.rank + 1.0), "float32")
    view = base[:, ::2]
    assert coll.allreduce(view, "sum", comm=comm) is view
    got = dev.to_numpy(base)
    assert (got[:, ::2] == comm.size * (comm.size + 1) / 2).all() and (got[:, 1::2] == comm.rank + 1).all()
    t = dev.make(np.arange(12.0).reshape(3, 4) + comm.rank, "float64").T
    coll.allreduce(t, "max", comm=comm)
    np.testing.assert_array_equal(dev.to_numpy(t), (np.arange(12.0).reshape(3, 4) + comm.size - 1).T)


def test_torch_conj_neg_and_requires_grad(comm, dev):
    if dev.name != "torch":
        pytest.skip("torch only")
    torch = dev.xp
    base = torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64, device=f"cuda:{dev.index}")
    view = base.conj()
    coll.allreduce(view, "sum", comm=comm)
    np.testing.assert_array_equal(dev.to_numpy(view), np.array([1 - 1j, 2 + 1j], np.complex64) * comm.size)
    p = torch.ones(3, device=f"cuda:{dev.index}", requires_grad=True)
    assert coll.allreduce(p, "sum", comm=comm) is p
    assert p.requires_grad and p.grad is None and (p.detach() == comm.size).all()


def test_stream_ordered_on_a_side_stream(comm, dev):
    n = 1 << 22
    if dev.name == "torch":
        torch = dev.xp
        s = torch.cuda.Stream(device=dev.index)
        with torch.cuda.stream(s):
            a = torch.rand(2048, 2048, device=f"cuda:{dev.index}")
            for _ in range(4):  # keep the stream busy so that a wrong stream would race
                a = a @ a / 2048
            x = torch.full((n,), float(comm.rank + 1), device=f"cuda:{dev.index}") + a.sum() * 0
            coll.allreduce(x, "sum", comm=comm)
            y = x * 2
        s.synchronize()
        got = y.cpu().numpy()
    else:
        cp = dev.xp
        with cp.cuda.Device(dev.index), cp.cuda.Stream(non_blocking=True) as s:
            a = cp.random.rand(2048, 2048, dtype=cp.float32)
            for _ in range(4):
                a = a @ a / 2048
            x = cp.full((n,), float(comm.rank + 1), dtype=cp.float32) + a.sum() * 0
            coll.allreduce(x, "sum", comm=comm)
            y = x * 2
            s.synchronize()
            got = cp.asnumpy(y)
    assert (got == comm.size * (comm.size + 1)).all()


def test_allreduce_many_in_one_group(comm, dev):
    coll.allreduce(dev.make(np.ones(1), "float32"), comm=comm)  # makes the transport if needed
    transport = transport_of(comm, dev)
    arrays = [dev.make(np.full(7, comm.rank + 1.0), "float32"),
              dev.make(np.full((2, 3), comm.rank + 1), "int64"),
              dev.make(np.full((4, 4), comm.rank + 1.0), "float64")[:, 1],  # non-contiguous
              dev.make(np.full(3, comm.rank + 1.0), "float16"),
              dev.make(np.zeros(0), "float32")]
    assert transport.allreduce_many(arrays, None, "sum") is arrays
    tri = comm.size * (comm.size + 1) / 2
    for a in arrays[:4]:
        assert (dev.to_numpy(a) == tri).all()
    floats = [arrays[0], arrays[2]]
    transport.allreduce_many(floats, None, "mean")
    for a in floats:
        np.testing.assert_allclose(dev.to_numpy(a), tri, rtol=1e-6)
    with pytest.raises(TypeError):  # validated before anything is enqueued, on every rank
        transport.allreduce_many([arrays[0], arrays[1]], None, "mean")


def test_two_ranks_on_one_gpu_refused_without_opt_in(comm, dev, monkeypatch):
    if expected_transport(comm) != "nccl":
        pytest.skip("the refusal is NCCL's")
    f, _ = cuda.local_facts(comm, dev.index)
    everyone = comm._host.allgather_object(f)
    if not cuda.shared_devices([(e["host"], e["pci"]) for e in everyone]):
        pytest.skip("every rank has its own GPU")
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "0")
    with pytest.raises(coll.BackendUnavailableError, match="would share one GPU") as info:
        factory.device_transport(engine_of(comm), (CUDA, dev.index))
    assert "rank  host" in str(info.value) and "<- shared" in str(info.value)


def test_tree_on_cuda_arrays(comm, dev):
    if "allreduce_tree" not in coll.__all__:
        pytest.skip("collectives.allreduce_tree is not in this build")
    tree = {"w": dev.make(np.full((3, 2), comm.rank + 1.0), "float32"),
            "b": [dev.make(np.full(4, comm.rank + 1), "int32"), dev.make(np.full(2, comm.rank + 1.0), "float64")],
            "host": np.full(2, comm.rank + 1.0)}
    out = coll.allreduce_tree(tree, op="sum", comm=comm)
    tri = comm.size * (comm.size + 1) / 2
    for leaf in (out["w"], out["b"][0], out["b"][1]):
        assert dev.is_array(leaf) and (dev.to_numpy(leaf) == tri).all()
    assert (out["host"] == tri).all()
    if "synchronize" in coll.__all__:
        tree = {"w": dev.make(np.full(3, float(comm.rank)), "float32"), "step": comm.rank}
        out = coll.synchronize(tree, root=0, comm=comm)
        assert (dev.to_numpy(out["w"]) == 0).all() and out["step"] == 0


def test_distributed_optimizer_step_on_cuda(comm, dev):
    if "DistributedOptimizer" not in coll.__all__:
        pytest.skip("collectives.DistributedOptimizer is not in this build")
    if dev.name != "torch":
        pytest.skip("torch optimizer")
    torch = dev.xp
    torch.manual_seed(0)  # the same initial parameters on every rank
    model = torch.nn.Linear(4, 2).cuda(dev.index)
    opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm)
    x = torch.full((3, 4), float(comm.rank + 1), device=f"cuda:{dev.index}")
    model(x).square().sum().backward()
    local = [p.grad.clone() for p in model.parameters()]
    opt.step()
    for p, g in zip(model.parameters(), local):
        mean = coll.allgather(g, comm=comm).mean(0)
        torch.testing.assert_close(p.grad, mean)
        gathered = coll.allgather(p.detach(), comm=comm)
        assert all(torch.equal(gathered[0], gathered[r]) for r in range(comm.size))


def test_nccl_eager_sets_up_the_device_at_init(comm, dev, monkeypatch):
    """COLLECTIVES_NCCL_EAGER=1: a new communicator has its device transport right after init()."""
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend (init(comm=...))")
    from mpi4py import MPI

    monkeypatch.setenv("COLLECTIVES_NCCL_EAGER", "1")
    mine = MPI.COMM_WORLD.Dup()
    fresh = coll.init(comm=mine)
    try:
        want = f"cuda:{cuda.local_device(fresh)}"
        assert cuda.device_transports(engine_of(fresh)) == {want: expected_transport(fresh)}
        x = dev.make(np.ones(4), "float32")
        coll.allreduce(x, comm=fresh)
        np.testing.assert_array_equal(dev.to_numpy(x), np.full(4, comm.size, np.float32))
    finally:
        fresh.close()
        mine.Free()


# ---- issue 14: reduce_scatter, alltoall, split, async ----

@pytest.mark.parametrize("dtype, op", [("float32", "sum"), ("float32", "max"), ("int64", "min"), ("float64", "mean"),
                                       ("bfloat16", "sum"), ("float16", "mean"), ("bool", "max")])
def test_reduce_scatter_is_allreduce_block(comm, dev, dtype, op):
    if not dev.has(dtype):
        pytest.skip(f"{dev.name} has no {dtype}")
    shape = (2 * comm.size, 3)
    x = dev.make(rank_values(comm.rank, shape, dtype, op), dtype)
    before = dev.to_numpy(x).copy()
    y = coll.reduce_scatter(x, op=op, comm=comm)
    assert dev.is_array(y) and dev.device_of(y) == dev.index and tuple(y.shape) == (2, 3) and y.dtype == x.dtype
    np.testing.assert_array_equal(dev.to_numpy(x), before)  # x unchanged
    full = dev.to_numpy(coll.allreduce(dev.make(rank_values(comm.rank, shape, dtype, op), dtype), op=op, comm=comm))
    assert_reduced(dev.to_numpy(y), full[2 * comm.rank:2 * comm.rank + 2], dtype, op)


@pytest.mark.parametrize("dtype", ["int8", "bfloat16", "float64", "complex64"])
def test_alltoall_bit_for_bit(comm, dev, dtype):
    if not dev.has(dtype):
        pytest.skip(f"{dev.name} has no {dtype}")
    n = comm.size
    sent = [rank_values(r, (2 * n, 3), dtype) for r in range(n)]
    y = coll.alltoall(dev.make(sent[comm.rank], dtype), comm=comm)
    assert dev.is_array(y) and dev.device_of(y) == dev.index
    want = np.concatenate([dev.to_numpy(dev.make(sent[i], dtype))[2 * comm.rank:2 * comm.rank + 2] for i in range(n)])
    np.testing.assert_array_equal(dev.to_numpy(y), want)


def test_split_gets_its_own_device_transport(comm, dev):
    coll.allreduce(dev.make(np.ones(1), "float32"), comm=comm)  # the parent's device transport exists
    sub = comm.split(comm.rank % 2)
    try:
        x = dev.make(np.ones(4), "float32")
        coll.allreduce(x, comm=sub)
        assert (dev.to_numpy(x) == sub.size).all()
        assert transport_of(sub, dev) is not transport_of(comm, dev)
    finally:
        sub.close()


def test_async_on_cuda_arrays(comm, dev):
    x = dev.make(np.full(6, float(comm.rank)), "float32")
    h = coll.allreduce(x, op="sum", async_op=True, comm=comm)
    assert h.wait() is x and (dev.to_numpy(x) == sum(range(comm.size))).all() and h.done()
    rs = coll.reduce_scatter(dev.make(np.ones(2 * comm.size), "float32"), async_op=True, comm=comm).wait()
    assert (dev.to_numpy(rs) == comm.size).all()


def _busy(dev, n: int = 1 << 22):
    """A long kernel queue on the current stream, ending in a tensor of n ones (the stream is busy when
    the collective is issued, so a collective that did not wait for it would read garbage)."""
    if dev.name == "torch":
        torch = dev.xp
        a = torch.rand(2048, 2048, device=f"cuda:{dev.index}")
        for _ in range(6):
            a = a @ a / 2048
        return torch.ones(n, device=f"cuda:{dev.index}") + a.sum() * 0
    cp = dev.xp
    a = cp.random.rand(2048, 2048, dtype=cp.float32)
    for _ in range(6):
        a = a @ a / 2048
    return cp.ones(n, dtype=cp.float32) + a.sum() * 0


def test_async_is_ordered_after_the_callers_stream_and_before_what_follows_wait(comm, dev):
    """The collective runs after the work already on the caller's current stream; after ``wait()``
    (which does not block the host) work on the current stream sees the result; ``done()`` never blocks
    and is True once the event is reached."""
    n = comm.size
    if dev.name == "torch":
        ctx = dev.xp.cuda.stream(dev.xp.cuda.Stream(device=dev.index))
    else:
        ctx = dev.xp.cuda.Stream(non_blocking=True)
    with ctx:
        x = _busy(dev)
        h = coll.allreduce(x, op="sum", async_op=True, comm=comm)
        assert isinstance(h.done(), bool)
        y = h.wait() * 2  # enqueued after the wait: must see the sum
        g = coll.allgather(x, async_op=True, comm=comm)
        z = g.wait()[n - 1] + 0
        r = coll.reduce_scatter(_busy(dev, 2 * n), async_op=True, comm=comm).wait() * 1
        got_y, got_z, got_r = dev.to_numpy(y), dev.to_numpy(z), dev.to_numpy(r)
    assert (got_y == 2 * n).all() and (got_z == n).all() and (got_r == n).all()
    assert h.done() and g.done()


def test_many_async_then_a_blocking_call_keep_one_order(comm, dev):
    """Several asynchronous collectives in flight, a blocking one after them, waited in reverse order:
    every rank's results are what the blocking calls give (one communicator, one order)."""
    n = comm.size
    xs = [dev.make(np.full(1 << 16, float(comm.rank + i)), "float32") for i in range(4)]
    handles = [coll.allreduce(x, op="sum", async_op=True, comm=comm) for x in xs[:3]]
    coll.allreduce(xs[3], op="sum", comm=comm)
    for h in reversed(handles):
        h.wait()
    for i, x in enumerate(xs):
        assert (dev.to_numpy(x) == sum(r + i for r in range(n))).all(), i


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "complex64"])
def test_reproducible_sums_of_cuda_arrays_are_the_host_bits(comm, dev, dtype):
    """reproducible=True on CUDA arrays (issue 36), on every device transport (NCCL, host staging, CUDA-aware
    MPI): allreduce, reduce, reduce_scatter, allreduce_units and a tree's CUDA leaves give the bits of the
    same calls on host arrays of the same values, blocking and asynchronous; CUDA arrays come back."""
    if not dev.has(dtype):
        pytest.skip(f"{dev.name} has no {dtype}")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    size, rank = comm.size, comm.rank
    values = rng.standard_normal((size, 4 * size)) * np.exp2(rng.integers(-20, 20, (size, 4 * size)))
    if dtype.startswith("complex"):
        values = values + 1j * values[::-1]

    def host(v):  # the same values in host memory (bfloat16: a CPU tensor)
        if dtype == "bfloat16":
            return torch.from_numpy(np.asarray(v, np.float32)).to(torch.bfloat16)
        return np.array(v, dtype=dtype)

    def bits(x):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu()
            return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        return dev.to_numpy(x).tobytes() if dev.is_array(x) else np.asarray(x).tobytes()

    for op in ("sum", "mean"):
        want = bits(comm.allreduce(host(values[rank]), op, reproducible=True))
        for async_op in (False, True):
            def run(h, async_op=async_op):
                return h.wait() if async_op else h

            x = dev.make(values[rank], dtype)
            got = run(comm.allreduce(x, op, reproducible=True, async_op=async_op))
            assert dev.is_array(got) and bits(got) == want, (op, async_op)
            x = dev.make(values[rank], dtype)
            got = run(comm.reduce(x, op, size - 1, reproducible=True, async_op=async_op))
            assert bits(got) == (want if rank == size - 1 else bits(dev.make(values[rank], dtype)))
            got = run(comm.reduce_scatter(dev.make(values[rank], dtype), op, reproducible=True, async_op=async_op))
            block = len(want) // size
            assert dev.is_array(got) and bits(got) == want[rank * block:(rank + 1) * block]
        units = bits(comm.allreduce_units(host(values[:rank + 1]), op))  # uneven: rank r holds r + 1 units
        got = comm.allreduce_units(dev.make(values[:rank + 1], dtype), op)
        assert dev.is_array(got) and bits(got) == units
        out = comm.allreduce_tree({"w": dev.make(values[rank], dtype), "h": host(values[rank])}, op,
                                  reproducible=True)
        assert dev.is_array(out["w"]) and bits(out["w"]) == want == bits(out["h"])
        # several CUDA leaves: summed a bucket at a time (packed on the device), each its slice of the bits
        n, item = 4 * size, len(want) // (4 * size)
        pieces = list(itertools.pairwise([0, 1, 3, n // 2, n]))
        for bucket_bytes in (16, 1 << 20):
            tree = {f"p{i}": dev.make(values[rank][a:b], dtype) for i, (a, b) in enumerate(pieces)}
            out = comm.allreduce_tree(tree, op, bucket_bytes=bucket_bytes, reproducible=True)
            for i, (a, b) in enumerate(pieces):
                assert out[f"p{i}"] is tree[f"p{i}"] and bits(out[f"p{i}"]) == want[a * item:b * item], (i, bucket_bytes)


def test_reproducible_optimizer_on_cuda_parameters(comm, dev):
    """DistributedOptimizer(reproducible=True) with the model on the GPU: every backward pass one unit (summed
    in host memory, the sum back on the GPU); the parameters after 5 steps of a fixed global batch of six
    micro-batches are the same bits at this world size as on one rank alone."""
    if dev.name != "torch":
        pytest.skip("torch optimizer")
    torch = dev.xp
    device = f"cuda:{dev.index}"

    def run(c):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(6, 4, 5, generator=g).to(device), torch.randn(6, 4, 1, generator=g).to(device)
        opt = coll.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), comm=c, reproducible=True)
        for _ in range(5):
            for i in range(c.rank, 6, c.size):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x[i]), y[i]).backward()
            opt.step()
            assert all(p.grad.device == p.device for p in model.parameters())
        opt.close()
        return b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())

    solo = comm.split(color=comm.rank)
    try:
        want = run(solo)
    finally:
        solo.close()
    assert run(comm) == want

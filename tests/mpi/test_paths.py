"""One semantics, whatever the path: the same seeded data through every path that reduces host memory must
give the same bits (a NaN must be a NaN everywhere; its payload is free; -0.0 and +0.0 are different).

The paths: the cached hot path (a second call), the general path (a strided view, a read-only array), the
small-leaf buckets and the solo leaves of ``allreduce_tree`` (several solo leaves in shared memory: one pass
for all, ``allreduce_fused``), the shared-memory allreduce forced on (a tiny threshold) and off, the deadline transport, ``reduce``, torch tensors (hot and general path), and the two
CUDA transports that do not need a GPU for their logic (host staging, CUDA-aware MPI), with CPU tensors
standing in for device tensors; the asynchronous calls (``async_op=True``, trees too) on those host paths,
the asynchronous hot path (a second asynchronous call) among them; ``reduce`` of tensors (general and hot
path, every root); the
torch.distributed backend (``collectives.torch_backend``, torch's ReduceOp on CPU tensors; asynchronous, and
made at the call as ``async_op=False`` makes it on a bounded group);
``reduce_scatter`` through the same host paths (its hot path too) and stand-ins (its block must hold the
documented bits too); and DistributedOptimizer's gradient reduction (buckets with views or copies, sharded
state, overlap=False). Every result is compared with a reference computed on every rank from all
ranks' inputs (every rank can make every rank's inputs: they are seeded), under the documented rules:
integers wrap (modulo 2**n), float min/max is a total order in which NaN wins and -0.0 < +0.0, mean is the
sum divided once by the number of ranks. Values are small integers, zeros of both signs, infinities and
NaN, so every sum and product is exact in any order (a different summation order cannot excuse a
difference).

    timeout 600 mpiexec -n 3 python tests/mpi_pytest.py tests/mpi/test_paths.py -q -x
"""

from __future__ import annotations

import numpy as np
import pytest

import collectives as coll
from collectives._comm import engine_of  # the device transports' interface to a Communicator
from support.comms import communicator, settings

COUNT = 67  # elements per array: odd, so buckets, slices and chunks do not line up
OPS = ("sum", "prod", "min", "max", "mean")
DTYPES = ("bool", "int8", "uint8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "longdouble", "complex64")
LEGAL = {"sum": "iufc", "prod": "iufc", "min": "biuf", "max": "biuf", "mean": "fc"}


def kind(dtype: str) -> str:
    return "f" if dtype == "bfloat16" else np.dtype(dtype).kind


def pairs():
    return [(d, op) for d in DTYPES for op in OPS if kind(d) in LEGAL[op]]


def inputs(dtype: str, op: str, rank: int) -> np.ndarray:
    """Rank ``rank``'s input, the same on every rank that makes it (NumPy dtype; bfloat16 as float32)."""
    rng = np.random.default_rng([DTYPES.index(dtype), OPS.index(op), rank])
    k = kind(dtype)
    if k == "b":
        return rng.random(COUNT) < (0.8 if op == "min" else 0.2)
    if k in "iu":
        info = np.iinfo(dtype)
        lo, hi = (max(info.min, -3), min(info.max, 4)) if op == "prod" else (max(info.min, -100), 101)
        return rng.integers(lo, hi, COUNT).astype(dtype)  # sums of int8 past 127 wrap
    small = [-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0] if op == "prod" else [-3.0, -1.0, 1.0, 2.0, 4.0]
    values = rng.choice(small, COUNT)
    special = rng.integers(0, 12, COUNT)
    values[special == 0] = 0.0
    values[special == 1] = -0.0
    values[special == 2] = np.inf
    values[special == 3] = -np.inf
    values[(special == 4) & (rng.random(COUNT) < 0.5)] = np.nan  # on some ranks only
    values[:3] = (-0.0, 0.0, -0.0) if rank % 2 == 0 else (0.0, -0.0, -0.0)  # every mix of signed zeros
    values[3] = np.nan if rank == 0 else 1.0  # a NaN held by rank 0 only
    np_dtype = np.dtype(np.float32 if dtype == "bfloat16" else dtype)
    if np_dtype.kind == "c":  # finite: C's and NumPy's complex products of infinities differ (docs/semantics.md)
        values[np.isinf(values)] = 2.0
        imag = rng.choice([-1.0, 0.0, 1.0], COUNT)
        return (values + 1j * imag).astype(np_dtype)
    return values.astype(np_dtype)


def reference(dtype: str, op: str, size: int) -> np.ndarray:
    """The documented result, computed here from every rank's inputs."""
    xs = np.stack([inputs(dtype, op, r) for r in range(size)])
    k = kind(dtype)
    target = xs.dtype
    with np.errstate(all="ignore"):
        if k == "b":
            return xs.any(axis=0) if op == "max" else xs.all(axis=0)
        if k in "iu":
            wide = xs.astype(np.int64)
            out = wide.sum(axis=0) if op == "sum" else wide.prod(axis=0) if op == "prod" else (
                wide.max(axis=0) if op == "max" else wide.min(axis=0))
            return out.astype(target)  # modulo 2**n
        if op in ("min", "max"):
            nan = np.isnan(xs).any(axis=0)
            clean = np.where(np.isnan(xs), 0.0, xs)
            out = clean.max(axis=0) if op == "max" else clean.min(axis=0)
            zero = out == 0
            pick = ~np.signbit(clean) if op == "max" else np.signbit(clean)  # max: +0.0 wins, min: -0.0
            signed = np.where((clean == 0) & pick, 1, 0).any(axis=0)
            want_negative = ~signed if op == "max" else signed
            out = np.where(zero, np.where(want_negative, -0.0, 0.0), out).astype(target)
            out[nan] = np.nan
            return out
        acc = xs[0].copy()
        for x in xs[1:]:
            acc = acc * x if op == "prod" else acc + x
        if op == "mean":  # complex: each part divided by the (real) number of ranks
            acc = (acc.real / size + 1j * (acc.imag / size)) if k == "c" else acc / target.type(size)
        return acc.astype(target)


def same_bits(got: np.ndarray, want: np.ndarray) -> str | None:
    """None if equal bit for bit (any NaN equals any NaN), else a description of the first difference."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"dtype/shape {got.dtype} {got.shape} != {want.dtype} {want.shape}"
    if got.dtype.kind in "fc":
        parts = [(got.real, want.real), (got.imag, want.imag)] if got.dtype.kind == "c" else [(got, want)]
        for g, w in parts:
            gn, wn = np.isnan(g), np.isnan(w)
            if g.dtype.itemsize > 8:  # longdouble: compare values and signs, not padding bytes
                bad = (gn != wn) | (~gn & ~wn & ((g != w) | (np.signbit(g) != np.signbit(w))))
            else:
                bad = (gn != wn) | (~gn & ~wn & (g.view(f"u{g.itemsize}") != w.view(f"u{w.itemsize}")))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                return f"element {i}: got {g[i]!r}, want {w[i]!r}"
        return None
    bad = got != want
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        return f"element {i}: got {got[i]!r}, want {want[i]!r}"
    return None


# ---- communicators for the paths (collective to make and to close) ----

@pytest.fixture(scope="module")
def comms():
    if coll.world().backend != "mpi":
        pytest.skip("needs the MPI backend")
    with communicator(COLLECTIVES_SHM_THRESHOLD=64, COLLECTIVES_SHM_SLOT_BYTES=65536) as shm_on, \
            communicator(COLLECTIVES_SHM="0") as shm_off, \
            communicator(COLLECTIVES_TIMEOUT=300) as deadline, \
            communicator(COLLECTIVES_TIMEOUT=300, COLLECTIVES_SHM_THRESHOLD=64,
                         COLLECTIVES_SHM_SLOT_BYTES=65536) as deadline_shm, \
            communicator(COLLECTIVES_SHM_THRESHOLD=64, COLLECTIVES_SIMULATE_NODES=2) as nodes:
        yield {"shm-on": shm_on, "shm-off": shm_off, "deadline": deadline, "deadline shm": deadline_shm,
               "nodes": nodes}


# ---- the paths: each returns its result as NumPy ----

def as_lib(x: np.ndarray, dtype: str, lib: str):
    if lib == "numpy":
        return x.copy()
    import torch

    if dtype == "bfloat16":
        return torch.from_numpy(x.copy()).to(torch.bfloat16)
    return torch.from_numpy(x.copy())


def to_numpy(y, dtype: str) -> np.ndarray:
    if isinstance(y, np.ndarray):
        return y
    import torch

    if y.dtype == torch.bfloat16:
        return y.float().numpy()
    return y.numpy()


def numpy_paths(x, op, comm, comms):
    """name -> result, for a NumPy input."""
    out = {}
    a = x.copy()
    comm.allreduce(a, op)  # fills the hot path's cache ...
    b = x.copy()
    out["hot"] = coll.allreduce(b, op, comm=comm)  # ... which this call takes
    base = np.zeros((2, x.size), x.dtype)
    base[:, :] = x
    view = base.T[:, 0]  # strided: the general path, on a copy, written back
    coll.allreduce(view, op, comm=comm)
    out["general"] = view.copy()
    ro = x.copy()
    ro.flags.writeable = False
    out["read-only"] = coll.allreduce(ro, op, comm=comm)
    small = {"a": x.copy(), "pad": np.ones(3, x.dtype)}
    out["tree small leaves"] = coll.allreduce_tree(small, op, comm=comm)["a"]
    out["tree solo leaf"] = coll.allreduce_tree({"a": x.copy()}, op, comm=comm, bucket_bytes=64)["a"]
    small = {"a": x.copy(), "pad": np.ones(3, x.dtype)}
    out["async tree small leaves"] = comm.allreduce_tree(small, op, async_op=True).wait()["a"]
    out["async tree solo leaf"] = comm.allreduce_tree({"a": x.copy()}, op, bucket_bytes=64, async_op=True).wait()["a"]
    out["async"] = coll.allreduce(x.copy(), op, comm=comm, async_op=True).wait()
    out["async hot"] = coll.allreduce(x.copy(), op, comm=comm, async_op=True).wait()  # (where the pair has one)
    out["async strided"] = comm.allreduce(base.T[:, 1], op, async_op=True).wait().copy()
    for name, c in comms.items():
        out[name] = c.allreduce(x.copy(), op)
        out[f"{name} async"] = c.allreduce(x.copy(), op, async_op=True).wait()
        out[f"{name} async hot"] = c.allreduce(x.copy(), op, async_op=True).wait()
        out[f"{name} tree solo leaf"] = c.allreduce_tree({"a": x.copy()}, op, bucket_bytes=64)["a"]
        out[f"{name} tree small leaves"] = c.allreduce_tree({"a": x.copy(), "b": np.ones(2, x.dtype)}, op)["a"]
        solos = c.allreduce_tree({"a": x.copy(), "b": x.copy(), "c": x.copy()}, op, bucket_bytes=64)
        out[f"{name} tree solo leaves, first"], out[f"{name} tree solo leaves, last"] = solos["a"], solos["c"]
        out[f"{name} async tree"] = c.allreduce_tree({"a": x.copy(), "b": np.ones(2, x.dtype)}, op,
                                                     async_op=True).wait()["a"]
    for root in range(comm.size):
        r = x.copy()
        got = coll.reduce(r, op, root, comm=comm)  # fills the hot path's cache (any root) ...
        if comm.rank == root:
            out[f"reduce to {root}"] = got
        got = coll.reduce(x.copy(), op, root, comm=comm)  # ... which this call takes
        if comm.rank == root:
            out[f"reduce hot to {root}"] = got
        else:
            assert same_bits(got, x) is None, "a non-root rank's array changed"
        r = x.copy()
        got = coll.reduce(r, op, root, comm=comm, async_op=True).wait()
        if comm.rank == root:
            out[f"async reduce to {root}"] = got
        for hot in ("", " hot"):  # the deadline transport's general path, then its hot path
            got = comms["deadline"].reduce(x.copy(), op, root)
            if comm.rank == root:
                out[f"deadline reduce{hot} to {root}"] = got
            else:
                assert same_bits(got, x) is None, "a non-root rank's array changed"
    return out


def torch_paths(x, dtype, op, comm, comms):
    out = {}
    t = as_lib(x, dtype, "torch")
    comm.allreduce(t, op)
    t = as_lib(x, dtype, "torch")
    out["torch hot"] = to_numpy(coll.allreduce(t, op, comm=comm), dtype)
    t = as_lib(x, dtype, "torch").requires_grad_(False)
    wide = as_lib(np.repeat(x, 2), dtype, "torch")
    view = wide[::2]
    coll.allreduce(view, op, comm=comm)
    out["torch general"] = to_numpy(view.contiguous(), dtype)
    out["torch async"] = to_numpy(comm.allreduce(as_lib(x, dtype, "torch"), op, async_op=True).wait(), dtype)
    out["torch async hot"] = to_numpy(comm.allreduce(as_lib(x, dtype, "torch"), op, async_op=True).wait(), dtype)
    out["torch tree"] = to_numpy(coll.allreduce_tree({"a": as_lib(x, dtype, "torch")}, op, comm=comm)["a"], dtype)
    for root in range(comm.size):  # reduce of a tensor: the general path fills the cache (any root), then hot
        for hot in ("", " hot"):
            got = to_numpy(coll.reduce(as_lib(x, dtype, "torch"), op, root, comm=comm), dtype)
            if comm.rank == root:
                out[f"torch reduce{hot} to {root}"] = got
            else:
                assert same_bits(got, to_numpy(as_lib(x, dtype, "torch"), dtype)) is None, "a non-root's tensor changed"
    for transport in device_stand_ins(comm):
        t = as_lib(x, dtype, "torch")
        transport.allreduce(t, None, op)
        out[f"{transport.name} (CPU tensors standing in)"] = to_numpy(t, dtype)
    # the backend; on one node with shared memory from 64 B, a host tensor is reduced at the call (blocking)
    for name, c in (("", comm), (", shm", comms["shm-on"]), (", simulated nodes", comms["nodes"]),
                    (", deadline", comms["deadline"]), (", deadline shm", comms["deadline shm"])):
        group, opts = torch_group(c, op, "AllreduceOptions")
        t = as_lib(x, dtype, "torch")
        assert group.allreduce([t], opts).wait()
        out["torch.distributed backend" + name] = to_numpy(t, dtype)
        opts.asyncOp = False  # dist.all_reduce(async_op=False): made at the call where the group bounds its calls
        t = as_lib(x, dtype, "torch")
        assert group.allreduce([t], opts).wait()
        out["torch.distributed backend, waited at once" + name] = to_numpy(t, dtype)
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        out.update(optimizer_paths(x, dtype, op, comm, comms))
    return out


def optimizer_paths(x, dtype, op, comm, comms):
    """DistributedOptimizer's gradient reduction: the buckets (views or copies, during backward or in
    step(); blocking where the ranks' CPUs reduce in shared memory, from 64 B on the "shm" communicator,
    else non-blocking), sharded state (reduce-scatter, then gathered back by average_gradients), and
    overlap=False."""
    import torch

    out = {}
    shm_settings = dict(COLLECTIVES_SHM_THRESHOLD=64, COLLECTIVES_SHM_SLOT_BYTES=65536)
    configs = {"optimizer tree": (comm, {}, dict(overlap=False)), "optimizer bucket views": (comm, {}, {}),
               "optimizer bucket copies": (comm, {}, dict(grad_views=False)),
               "optimizer sharded": (comm, {}, dict(shard_state=True)),
               "optimizer bucket views, shm": (comms["shm-on"], shm_settings, {}),
               "optimizer bucket copies, simulated nodes": (comms["nodes"], dict(COLLECTIVES_SHM_THRESHOLD=64,
                                                                                  COLLECTIVES_SIMULATE_NODES=2),
                                                             dict(grad_views=False))}
    for name, (c, env, options) in configs.items():
        p = torch.nn.Parameter(torch.zeros(COUNT, dtype=getattr(torch, dtype)))
        q = torch.nn.Parameter(torch.zeros(5, dtype=getattr(torch, dtype)))  # a second bucket (bucket_bytes)
        with settings(**env):  # the gradient communicator (a split of c, made here) reads them
            opt = coll.DistributedOptimizer(torch.optim.SGD([q, p], lr=0.0), op=op, comm=c, bucket_bytes=64,
                                            **options)
        p.grad = as_lib(x, dtype, "torch")
        q.grad = torch.ones(5, dtype=getattr(torch, dtype))
        opt.average_gradients()
        out[name] = to_numpy(p.grad, dtype)
        opt.close()
    # the hooks: the same gradient produced by backward (d/dp of sum(p * x) is x)
    p = torch.nn.Parameter(torch.zeros(COUNT, dtype=getattr(torch, dtype)))
    opt = coll.DistributedOptimizer(torch.optim.SGD([p], lr=0.0), op=op, comm=comm)
    finite = as_lib(np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), dtype, "torch")
    (p * finite).sum().backward()
    want = coll.allreduce(finite.clone(), op, comm=comm)
    got = p.grad.clone()
    opt.close()
    assert torch.equal(got, want), "the gradient reduced during backward is the allreduce's"
    return out


def torch_group(comm, op, options):
    """The torch.distributed backend's process group over ``comm`` (collectives.torch_backend), and torch
    options carrying ``op`` as torch's ReduceOp (mean: AVG)."""
    import torch.distributed as dist

    import collectives.torch_backend as ctb

    opts = getattr(dist, options)()
    opts.reduceOp = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
                     "max": dist.ReduceOp.MAX, "mean": dist.ReduceOp.AVG}[op]
    return ctb.ProcessGroupCollectives(comm), opts


def device_stand_ins(comm):
    """The host-staging and CUDA-aware MPI transports, with a torch helper whose CUDA-only calls are
    replaced, so CPU tensors stand in for device tensors (the transports' logic is what is tested; there
    is no public way to hand a CPU tensor to a device transport, hence the private classes)."""
    import contextlib as cl

    import torch

    from collectives._backends import cuda, device

    class StandIn(device._TorchCUDA):
        def __init__(self):
            super().__init__(torch)

        def stream(self, x):
            return 0

        def synchronize(self, x):
            pass

        def using(self, index):
            return cl.nullcontext()

        def index(self, x):
            return 0

        def to_host(self, x):
            return x.detach().clone()

        def to_device(self, host, like):
            return host.clone()

    fake = StandIn()
    made = []
    for cls in (cuda.HostStagingTransport, cuda.CudaAwareMPITransport):
        t = cls(engine_of(comm), 0)
        t._library_of = lambda x: fake
        made.append(t)
    return made


def scatter_input(x: np.ndarray, size: int) -> np.ndarray:
    """``size`` blocks for reduce_scatter: block j is x rolled by j (the reference rolls alike)."""
    return np.stack([np.roll(x, j) for j in range(size)])


def reduce_scatter_paths(x, dtype, op, comm, comms, monkeypatch):
    """name -> this rank's block of reduce_scatter, for every host path and the device stand-ins; also
    written into ``out=`` (which it returns): contiguous (the general path, then the hot path), strided,
    inside ``x``, asynchronous (its hot path: a second asynchronous call), on every communicator, torch
    tensors, the device path (host staging, stand-in arrays) and the torch backend's output (contiguous:
    reduced into it; strided: copied)."""
    from support.device import OnDevice, staging

    out = {}
    xs = scatter_input(x, comm.size)
    block = (1, *xs.shape[1:])

    def into(name, o, call):
        assert call(o) is o, f"reduce_scatter {name}: out= returns out itself"
        out[f"reduce_scatter {name}"] = (o.values if isinstance(o, OnDevice) else o)[0]

    if dtype != "bfloat16":
        out["reduce_scatter"] = coll.reduce_scatter(xs.copy(), op, comm=comm)[0]  # fills the hot path's cache
        out["reduce_scatter hot"] = coll.reduce_scatter(xs.copy(), op, comm=comm)[0]  # ... which this takes
        base = np.zeros((2,) + xs.shape, xs.dtype)
        base[:] = xs
        out["reduce_scatter strided"] = coll.reduce_scatter(base.transpose(1, 0, 2)[:, 0], op, comm=comm)[0]
        ro = xs.copy()
        ro.flags.writeable = False
        out["reduce_scatter read-only"] = comm.reduce_scatter(ro, op)[0]
        out["reduce_scatter async"] = comm.reduce_scatter(xs, op, async_op=True).wait()[0]
        out["reduce_scatter async hot"] = comm.reduce_scatter(xs, op, async_op=True).wait()[0]  # (where it has one)
        for name, c in comms.items():
            out[f"reduce_scatter {name}"] = c.reduce_scatter(xs.copy(), op)[0]
            out[f"reduce_scatter {name} hot"] = c.reduce_scatter(xs.copy(), op)[0]
            out[f"reduce_scatter {name} async"] = c.reduce_scatter(xs, op, async_op=True).wait()[0]
            out[f"reduce_scatter {name} async hot"] = c.reduce_scatter(xs, op, async_op=True).wait()[0]
            into(f"{name} out", np.empty(block, xs.dtype), lambda o, c=c: c.reduce_scatter(xs, op, out=o))
            for i in range(2):
                into(f"{name} async out {i}", np.empty(block, xs.dtype),
                     lambda o, c=c: c.reduce_scatter(xs, op, out=o, async_op=True).wait())
        for i in range(2):  # the second: the hot path, into out
            into(f"out {i}", np.empty(block, xs.dtype), lambda o: coll.reduce_scatter(xs, op, out=o, comm=comm))
        into("out strided", np.empty((1, 2 * xs.shape[1]), xs.dtype)[:, ::2],
             lambda o: coll.reduce_scatter(xs, op, out=o, comm=comm))
        into("async out", np.empty(block, xs.dtype),
             lambda o: coll.reduce_scatter(xs, op, out=o, comm=comm, async_op=True).wait())
        mixed = xs.copy()  # out inside x: this rank's own block of x receives the result
        mine = mixed[comm.rank:comm.rank + 1]
        assert coll.reduce_scatter(mixed, op, out=mine, comm=comm) is mine
        out["reduce_scatter out inside x"] = mine[0].copy()
        if dtype != "longdouble":
            staging(comm, monkeypatch)
            out["reduce_scatter device (host staging)"] = coll.reduce_scatter(OnDevice(xs), op, comm=comm).values[0]
            into("device out", OnDevice(np.empty(block, xs.dtype)),
                 lambda o: coll.reduce_scatter(OnDevice(xs), op, out=o, comm=comm))
    if dtype != "longdouble":
        out["reduce_scatter torch"] = to_numpy(coll.reduce_scatter(as_lib(xs, dtype, "torch"), op, comm=comm)[0],
                                               dtype)
        out["reduce_scatter torch hot"] = to_numpy(coll.reduce_scatter(as_lib(xs, dtype, "torch"), op,
                                                                       comm=comm)[0], dtype)
        import torch

        t = as_lib(xs, dtype, "torch")
        for i in range(2):
            o = torch.empty(block, dtype=t.dtype)
            assert coll.reduce_scatter(t, op, out=o, comm=comm) is o
            out[f"reduce_scatter torch out {i}"] = to_numpy(o[0], dtype)
        for i in range(2):  # (the second: the asynchronous hot path, where the pair has one)
            o = torch.empty(block, dtype=t.dtype)
            assert coll.reduce_scatter(t, op, out=o, comm=comm, async_op=True).wait() is o
            out[f"reduce_scatter torch async out {i}"] = to_numpy(o[0], dtype)
            got = coll.reduce_scatter(t, op, comm=comm, async_op=True).wait()
            out[f"reduce_scatter torch async {i}"] = to_numpy(got[0], dtype)
        for transport in device_stand_ins(comm):
            got = transport.reduce_scatter(as_lib(xs, dtype, "torch"), None, op)
            out[f"reduce_scatter {transport.name} (CPU tensors standing in)"] = to_numpy(got[0], dtype)
        group, opts = torch_group(comm, op, "ReduceScatterOptions")
        blocks = as_lib(xs, dtype, "torch")
        for i in range(2):  # (the second: the asynchronous hot path, where the pair has one)
            mine = blocks[0].clone()
            assert group.reduce_scatter_single(mine, blocks.reshape(-1), opts).wait()
            out[f"reduce_scatter torch.distributed backend {i}"] = to_numpy(mine, dtype)
        strided = torch.zeros(2 * blocks.shape[1], dtype=blocks.dtype)[::2]  # not contiguous: through a copy
        assert group.reduce_scatter_single(strided, blocks.reshape(-1), opts).wait()
        out["reduce_scatter torch.distributed backend, strided output"] = to_numpy(strided, dtype)
    return {k: np.roll(v, -comm.rank) for k, v in out.items()}  # block r was x rolled by r


@pytest.mark.parametrize(("dtype", "op"), pairs(), ids=[f"{d}-{o}" for d, o in pairs()])
def test_every_path_gives_the_documented_bits(comm, comms, dtype, op, monkeypatch):
    x = inputs(dtype, op, comm.rank)
    want = reference(dtype, op, comm.size)
    results = {}
    if dtype != "bfloat16":
        results.update(numpy_paths(x, op, comm, comms))
    if dtype not in ("longdouble", "uint16"):
        results.update(torch_paths(x, dtype, op, comm, comms))
    results.update(reduce_scatter_paths(x, dtype, op, comm, comms, monkeypatch))
    if dtype == "bfloat16":  # the reference is float32; bfloat16 rounds it (small integers: exactly)
        import torch

        want = torch.from_numpy(want).to(torch.bfloat16).float().numpy()
    norm = lambda a: a
    if kind(dtype) == "c" and op == "prod":  # the sign of a zero part depends on the MPI's order of the
        norm = lambda a: np.asarray(a) + 0  # complex products (non-associative): +0 for -0
    want = norm(want)
    wrong = {name: why for name, got in results.items() if (why := same_bits(norm(to_numpy(got, dtype)), want))}
    assert not wrong, f"{dtype} {op} at {comm.size} ranks: " + "; ".join(f"{k}: {v}" for k, v in wrong.items())
    assert len(results) >= 5


@pytest.mark.parametrize("dtype", ["bool", "int8", "float16", "float64", "longdouble", "complex64"])
def test_gather_every_path_gives_every_rank_s_bits(comm, comms, dtype):
    """gather moves bytes: every path (hot and general, strided, read-only, asynchronous, every
    communicator's transport, torch, the device stand-ins, the torch backend's gather) gives root each
    rank's input bit for bit, NaN payloads and signed zeros included; None elsewhere."""
    x = inputs(dtype, "max" if kind(dtype) in "biuf" else "sum", comm.rank)
    want = np.stack([inputs(dtype, "max" if kind(dtype) in "biuf" else "sum", r) for r in range(comm.size)])
    root = comm.size - 1
    got = {"numpy": coll.gather(x.copy(), root, comm=comm), "numpy again": coll.gather(x.copy(), root, comm=comm),
           "async": coll.gather(x, root, comm=comm, async_op=True).wait()}
    base = np.zeros((2,) + x.shape, x.dtype)
    base[1] = x
    got["strided"] = coll.gather(base.T[:, 1], root, comm=comm)
    ro = x.copy()
    ro.flags.writeable = False
    got["read-only"] = coll.gather(ro, root, comm=comm)
    for name, c in comms.items():
        got[name] = c.gather(x, root)
        got[f"{name} async"] = c.gather(x, root, async_op=True).wait()
    if dtype != "longdouble":
        import torch

        t = as_lib(x, dtype, "torch")
        got["torch"] = coll.gather(t, root, comm=comm)
        for transport in device_stand_ins(comm):
            got[f"{transport.name} (CPU tensors standing in)"] = transport.gather(t, None, root)
        group, _ = torch_group(comm, "sum", "AllreduceOptions")
        import torch.distributed as dist

        opts = dist.GatherOptions()
        opts.rootRank = root
        outs = [[torch.empty_like(t) for _ in range(comm.size)]] if comm.rank == root else []
        assert group.gather(outs, [t], opts).wait()
        got["torch.distributed backend"] = torch.stack(outs[0]) if outs else None
    for name, g in got.items():
        if comm.rank != root:
            assert g is None, name
        else:
            why = same_bits(to_numpy(g, dtype), want)
            assert not why, f"gather {name}: {why}"


@pytest.mark.parametrize("dtype", ["bool", "int8", "float16", "bfloat16", "float64", "longdouble", "complex64"])
def test_allgather_every_path_gives_every_rank_s_bits(comm, comms, dtype, monkeypatch):
    """allgather moves bytes: every path gives every rank each rank's input bit for bit (NaN payloads and
    signed zeros included), as a new array and written into ``out=`` (which it returns): the hot path (a
    second call) and the general path (strided ``out``, ``x`` inside ``out`` as ``out[rank]``), asynchronous
    (its hot path: a second asynchronous call), every communicator's transport, torch tensors, the device
    path (host staging, stand-in arrays), and the torch backend's ``all_gather_into_tensor``, straight into
    its output and through a copy."""
    from support.device import OnDevice, staging

    op = "max" if kind(dtype) in "biuf" else "sum"
    x = inputs(dtype, op, comm.rank)
    want = np.stack([inputs(dtype, op, r) for r in range(comm.size)])
    rows = (comm.size, *x.shape)
    got = {}

    def into(name, out, call):
        result = call(out)
        assert result is out, f"allgather {name}: out= returns out itself"
        got[name] = out

    if dtype != "bfloat16":  # (NumPy has no bfloat16 of its own; its inputs are float32)
        got["numpy"] = coll.allgather(x, comm=comm)
        got["async"] = coll.allgather(x, comm=comm, async_op=True).wait()
        got["async hot"] = coll.allgather(x, comm=comm, async_op=True).wait()  # (the asynchronous hot path)
        for i in range(2):  # the second call: the hot path, into out
            into(f"numpy out {i}", np.empty(rows, x.dtype), lambda o: coll.allgather(x, out=o, comm=comm))
        into("numpy out strided", np.empty((2 * comm.size, *x.shape), x.dtype)[::2],
             lambda o: coll.allgather(x, out=o, comm=comm))
        inside = np.empty(rows, x.dtype)
        inside[comm.rank] = x
        into("numpy x inside out", inside, lambda o: coll.allgather(o[comm.rank], out=o, comm=comm))
        for i in range(2):  # (the second: the asynchronous hot path)
            into(f"numpy async out {i}", np.empty(rows, x.dtype),
                 lambda o: coll.allgather(x, out=o, comm=comm, async_op=True).wait())
        for name, c in comms.items():
            got[name] = c.allgather(x)
            for i in range(2):
                into(f"{name} out {i}", np.empty(rows, x.dtype), lambda o, c=c: c.allgather(x, out=o))
                into(f"{name} async out {i}", np.empty(rows, x.dtype),
                     lambda o, c=c: c.allgather(x, out=o, async_op=True).wait())
        if dtype != "longdouble":  # (no CUDA library has it)
            staging(comm, monkeypatch)
            got["device (host staging)"] = coll.allgather(OnDevice(x), comm=comm).values
            into("device out", OnDevice(np.empty(rows, x.dtype)), lambda o: coll.allgather(OnDevice(x), out=o, comm=comm))
            got["device out"] = got["device out"].values
    if dtype != "longdouble":
        import torch

        t = as_lib(x, dtype, "torch")
        got["torch"] = coll.allgather(t, comm=comm)
        for i in range(2):
            into(f"torch out {i}", torch.empty(rows, dtype=t.dtype), lambda o: coll.allgather(t, out=o, comm=comm))
        into("torch out strided", torch.empty((2 * comm.size, *x.shape), dtype=t.dtype)[::2],
             lambda o: coll.allgather(t, out=o, comm=comm))
        inside = torch.empty(rows, dtype=t.dtype)
        inside[comm.rank] = t
        into("torch x inside out", inside, lambda o: coll.allgather(o[comm.rank], out=o, comm=comm))
        for i in range(2):  # (the second: the asynchronous hot path, where the dtype is the tensor's own)
            got[f"torch async {i}"] = coll.allgather(t, comm=comm, async_op=True).wait()
            into(f"torch async out {i}", torch.empty(rows, dtype=t.dtype),
                 lambda o: coll.allgather(t, out=o, comm=comm, async_op=True).wait())
        group, _ = torch_group(comm, "sum", "AllreduceOptions")
        for i in range(2):  # (the second: the asynchronous hot path)
            flat = torch.empty(comm.size * t.numel(), dtype=t.dtype)  # contiguous: gathered straight into it
            group._allgather_base(flat, t).wait()  # (c10d passes its AllgatherOptions)
            got[f"torch.distributed backend {i}"] = flat.reshape(rows)
        cols = torch.empty((x.size, comm.size), dtype=t.dtype).T  # not contiguous: through a copy
        group._allgather_base(cols, t.reshape(1, -1)).wait()
        got["torch.distributed backend, strided output"] = cols.reshape(rows)
    if dtype == "bfloat16":  # the reference is float32; bfloat16 rounds it (small integers: exactly)
        import torch

        want = torch.from_numpy(want).to(torch.bfloat16).float().numpy()
    for name, g in got.items():
        why = same_bits(to_numpy(g, dtype), want)
        assert not why, f"allgather {name}: {why}"
    assert len(got) >= 8


@pytest.mark.parametrize("dtype", ["float32", "longdouble"])
@pytest.mark.parametrize("shape", [(67,), (3, 5, 7)])
def test_reduce_leaves_non_root_inputs_untouched(comm, dtype, shape):
    """min/max of floats (ordered integers; longdouble: flags) on a rank that only contributes: its array
    stays bit for bit as it was, n-d included."""
    for op in ("min", "max"):
        x = inputs(dtype, op, comm.rank)
        x = np.resize(x, shape)
        before = x.copy()
        coll.reduce(x, op, 0, comm=comm)
        if comm.rank != 0:
            assert same_bits(x, before) is None, (op, same_bits(x, before))

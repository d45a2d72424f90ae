"""JAX arrays and optax for real (issues 13 and 14): every collective (reduce_scatter, alltoall, async
handles, object collectives and sub-communicators included), pytrees with optax states, and
``DistributedOptimizer(optax.adam(...))`` with gradient accumulation, at any world size.

    timeout 300 mpiexec -n 3 python tests/mpi_pytest.py tests/mpi/test_jax.py -q -x

JAX arrays are immutable: every collective returns a new ``jax.Array`` (same dtype, shape and device)
and leaves its input as it was. Run with JAX's defaults (no ``jax_enable_x64``: float32 and int32 are
JAX's widest types then), as users do.
"""

import numpy as np
import pytest

import collectives as coll

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")

DTYPES = ["bool", "int8", "uint8", "int16", "int32", "uint32", "float16", "bfloat16", "float32", "complex64"]
OPS = ["sum", "prod", "min", "max", "mean"]


def legal(dtype: str, op: str) -> bool:
    if dtype == "bool":
        return op in ("min", "max")
    if dtype.startswith("complex"):
        return op in ("sum", "prod", "mean")
    return op != "mean" or dtype.startswith(("float", "bfloat"))


def values(dtype: str, rank: int, count: int = 37) -> np.ndarray:
    """Rank ``rank``'s input as float64 values exactly representable in ``dtype`` (small: products of
    three ranks stay exact; integers near the top of int8/uint8/int16 wrap on sum)."""
    k = np.arange(count)
    if dtype == "bool":
        return ((k + rank) % 3 != 0).astype(np.float64)
    if dtype in ("int8", "uint8", "int16"):
        return ((k * 7 + rank * 50) % 120).astype(np.float64)
    return ((k + rank) % 4 + 1).astype(np.float64)


def as_jax(v: np.ndarray, dtype: str):
    if dtype == "bool":
        return jnp.asarray(v != 0)
    return jnp.asarray(v).astype(getattr(jnp, dtype))


def reference(dtype: str, op: str, size: int) -> np.ndarray:
    xs = [np.asarray(as_jax(values(dtype, r), dtype)) for r in range(size)]
    wide = [x.astype(np.complex128 if dtype.startswith("complex") else
                     np.float64 if dtype.startswith(("float", "bfloat")) else
                     np.bool_ if dtype == "bool" else np.int64) for x in xs]
    fold = {"sum": np.add, "mean": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    out = wide[0]
    for x in wide[1:]:
        out = fold(out, x)
    if op == "mean":
        out = out / size
    return np.asarray(jnp.asarray(out).astype(xs[0].dtype))  # the dtype's wrap / rounding, as JAX casts


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_every_op(comm, dtype):
    for op in OPS:
        if not legal(dtype, op):
            continue
        x = as_jax(values(dtype, comm.rank), dtype)
        before = np.asarray(x).copy()
        y = coll.allreduce(x, op=op)
        assert isinstance(y, jax.Array) and y.dtype == x.dtype and y.shape == x.shape, (op, type(y))
        np.testing.assert_array_equal(np.asarray(x), before)  # the input is untouched
        want = reference(dtype, op, comm.size)
        if op == "mean":  # a sum (exact here) divided in the dtype, or in float32 for 16-bit floats
            tol = 1e-2 if dtype in ("float16", "bfloat16") else 1e-6
            np.testing.assert_allclose(np.asarray(y).astype(np.complex128), want.astype(np.complex128), rtol=tol)
        else:  # integers wrap like JAX's own casts; small floats and their products are exact
            np.testing.assert_array_equal(np.asarray(y), want, f"{op} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_reduce_and_allgather(comm, dtype):
    root = comm.size - 1
    x = as_jax(values(dtype, comm.rank).reshape(37, 1), dtype)
    b = coll.broadcast(x, root=root)
    assert isinstance(b, jax.Array) and b.dtype == x.dtype and b.shape == x.shape
    np.testing.assert_array_equal(np.asarray(b), np.asarray(as_jax(values(dtype, root).reshape(37, 1), dtype)))
    g = coll.allgather(x)
    assert isinstance(g, jax.Array) and g.shape == (comm.size, 37, 1) and g.dtype == x.dtype
    for r in range(comm.size):
        np.testing.assert_array_equal(np.asarray(g[r]), np.asarray(as_jax(values(dtype, r).reshape(37, 1), dtype)))
    op = "max" if legal(dtype, "max") else "sum"
    r = coll.reduce(x, op=op, root=root)
    assert isinstance(r, jax.Array) and r.dtype == x.dtype
    if comm.rank == root:
        np.testing.assert_array_equal(np.asarray(r).reshape(-1), reference(dtype, op, comm.size))
    else:
        np.testing.assert_array_equal(np.asarray(r), np.asarray(x))  # non-root ranks get x back


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_every_op_is_the_allreduce_block(comm, dtype):
    n, r = comm.size, comm.rank
    for op in OPS:
        if not legal(dtype, op):
            with pytest.raises(TypeError, match="op="):
                coll.reduce_scatter(as_jax(np.zeros(2 * n), dtype), op=op)
            continue
        full = np.concatenate([values(dtype, comm.rank, 2 * n)]).reshape(2 * n)
        x = as_jax(full, dtype)
        before = np.asarray(x).copy()
        y = coll.reduce_scatter(x, op=op)
        assert isinstance(y, jax.Array) and y.dtype == x.dtype and y.shape == (2,), (op, type(y))
        np.testing.assert_array_equal(np.asarray(x), before)  # the input is untouched
        block = np.asarray(coll.allreduce(x, op=op))[2 * r:2 * r + 2]
        assert np.asarray(y).tobytes() == block.tobytes(), f"{op} {dtype}: not allreduce's block, bit for bit"
        h = coll.reduce_scatter(x, op=op, async_op=True)
        assert np.asarray(h.wait()).tobytes() == block.tobytes(), f"{op} {dtype}: async differs"


@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_sends_block_j_to_rank_j(comm, dtype):
    n, r = comm.size, comm.rank

    def block(src, dst):  # what rank src sends rank dst: distinct everywhere
        return as_jax(values(dtype, src * n + dst, 3), dtype)

    x = jnp.concatenate([block(r, j) for j in range(n)])
    want = np.asarray(jnp.concatenate([block(i, r) for i in range(n)]))
    for y in (coll.alltoall(x), coll.alltoall(x, async_op=True).wait()):
        assert isinstance(y, jax.Array) and y.dtype == x.dtype and y.shape == x.shape
        assert np.asarray(y).tobytes() == want.tobytes()


def test_async_collectives_return_new_jax_arrays(comm):
    n = comm.size
    x = jnp.full((4,), float(comm.rank), dtype=jnp.float32)
    handles = [coll.allreduce(x, op="mean", async_op=True), coll.broadcast(x, root=n - 1, async_op=True),
               coll.allgather(x, async_op=True), coll.reduce(x, op="sum", root=0, async_op=True)]
    mean, bcast, gathered, reduced = [h.wait() for h in reversed(handles)][::-1]
    assert all(isinstance(y, jax.Array) for y in (mean, bcast, gathered, reduced))
    np.testing.assert_array_equal(np.asarray(x), np.full(4, float(comm.rank)))  # immutable input untouched
    np.testing.assert_allclose(np.asarray(mean), np.full(4, (n - 1) / 2))
    np.testing.assert_array_equal(np.asarray(bcast), np.full(4, float(n - 1)))
    assert gathered.shape == (n, 4) and [float(g[0]) for g in gathered] == [float(i) for i in range(n)]
    if comm.rank == 0:
        np.testing.assert_array_equal(np.asarray(reduced), np.full(4, float(sum(range(n)))))


def test_object_collectives_and_split_with_jax_pytrees(comm):
    n, r = comm.size, comm.rank
    params, state = adam_state(r)
    got = coll.broadcast_object({"params": params, "state": state}, root=n - 1)
    want_params, _ = adam_state(n - 1)
    for a, b in zip(jax.tree_util.tree_leaves(got["params"]), jax.tree_util.tree_leaves(want_params)):
        assert isinstance(a, jax.Array) and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert type(got["state"]) is type(state)  # optax's namedtuples survive the pickle
    everyone = coll.allgather_object(jnp.float32(r))
    assert [float(v) for v in everyone] == [float(i) for i in range(n)]
    sub = coll.world().split(r % 2, key=-r)
    try:
        y = sub.allreduce(jnp.full((2,), float(r)), op="sum")
        members = [i for i in range(n) if i % 2 == r % 2]
        assert isinstance(y, jax.Array) and float(y[0]) == float(sum(members))
        z = sub.reduce_scatter(jnp.arange(2 * sub.size, dtype=jnp.int32), op="sum")
        assert z.tolist() == [sub.size * (2 * sub.rank), sub.size * (2 * sub.rank + 1)]
    finally:
        sub.close()


def test_bad_input_is_refused_before_communication(comm):
    with pytest.raises(TypeError, match="mean"):
        coll.allreduce(jnp.arange(3), op="mean")  # int32
    with pytest.raises(TypeError):
        coll.allreduce(jnp.ones(3, dtype=bool), op="sum")
    with pytest.raises(ValueError):
        coll.broadcast(jnp.ones(3), root=comm.size)
    if comm.size > 1:
        with pytest.raises(ValueError, match="divisible"):
            coll.reduce_scatter(jnp.ones(comm.size + 1), op="sum")
    with pytest.raises(ValueError, match="at least one dimension"):
        coll.alltoall(jnp.ones(()))


def test_a_tracer_inside_jit_is_told_to_be_called_outside_jit(comm):
    """DistributedOptimizer's update, allreduce and allreduce_tree inside jax.jit: a TypeError (before any
    communication, on every rank) saying to call it outside jit, not to use synchronize()."""
    opt = coll.DistributedOptimizer(optax.sgd(0.1), comm=comm)
    params = {"w": jnp.ones(3)}
    state = opt.init(params)
    with pytest.raises(TypeError, match=r"update\(\) was called inside jax.jit.*Call update outside jit") as info:
        jax.jit(lambda g: opt.update(g, state, params))({"w": jnp.ones(3)})
    assert "synchronize" not in str(info.value)
    for call in (lambda g: coll.allreduce(g["w"], comm=comm), lambda g: coll.allreduce_tree(g, comm=comm)):
        with pytest.raises(TypeError, match="a JAX tracer.*call it outside jit") as info:
            jax.jit(call)({"w": jnp.ones(3)})
        assert "use synchronize()" not in str(info.value)
    updates, _ = opt.update({"w": jnp.full(3, float(comm.rank))}, state, params)  # outside jit: works
    assert np.allclose(np.asarray(updates["w"]), -0.1 * (comm.size - 1) / 2)


def adam_state(rank: int):
    params = {"dense": {"w": jnp.full((3, 2), float(rank)), "b": jnp.zeros(2) + rank}, "scale": jnp.float32(rank)}
    opt = optax.adam(1e-2)
    state = opt.init(params)
    grads = jax.tree_util.tree_map(lambda p: p * 0 + rank + 1.0, params)
    _, state = opt.update(grads, state, params)  # count 1, moments rank-dependent
    return params, state


def test_synchronize_optax_state_keeps_namedtuples_and_int32_counts(comm):
    root = comm.size - 1
    params, state = adam_state(comm.rank)
    want_params, want_state = adam_state(root)
    got = coll.synchronize({"params": params, "opt": state}, root=root)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure({"params": params, "opt": state})
    adam = got["opt"][0]
    assert type(adam).__name__ == "ScaleByAdamState"  # the NamedTuple itself, not a plain tuple
    assert isinstance(adam.count, jax.Array) and adam.count.shape == () and adam.count.dtype == jnp.int32
    assert int(adam.count) == 1
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves({"params": want_params,
                                                                                 "opt": want_state})):
        assert isinstance(a, jax.Array) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_allreduce_tree_of_an_optax_state(comm):
    _, state = adam_state(comm.rank)
    got = coll.allreduce_tree(state, op="max")
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(state)
    assert got[0].count.dtype == jnp.int32 and int(got[0].count) == 1
    _, top = adam_state(comm.size - 1)  # the moments grow with the rank: max is the last rank's
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(top)):
        assert isinstance(a, jax.Array) and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    mean = coll.allreduce_tree({"g": jnp.full(5, float(comm.rank)), "h": [jnp.ones(2, jnp.bfloat16)]})
    np.testing.assert_allclose(np.asarray(mean["g"]), (comm.size - 1) / 2)
    assert mean["h"][0].dtype == jnp.bfloat16


@pytest.mark.parametrize("k", [1, 3])
def test_distributed_adam_with_accumulation_matches_one_process(comm, k):
    """``DistributedOptimizer(optax.adam)`` with ``backward_passes_per_step=k``, against optax.adam on one
    process fed the mean over ranks and micro-batches (as optax.MultiSteps defines accumulation)."""

    def loss(p, xb):
        return jnp.mean((xb @ p["w"] + p["b"] - jnp.sin(xb[:, :1])) ** 2)

    grad = jax.jit(jax.grad(loss))
    params = coll.synchronize({"w": jnp.full((2, 1), 0.3), "b": jnp.zeros(1)})
    dist = coll.DistributedOptimizer(optax.adam(5e-2), backward_passes_per_step=k)
    ref_opt = optax.adam(5e-2)
    state, ref_params = dist.init(params), params
    ref_state = ref_opt.init(ref_params)
    rng = np.random.default_rng(0)
    for step in range(2 * k):
        batches = [jnp.asarray(rng.standard_normal((8, 2)), dtype=jnp.float32) for _ in range(comm.size)]
        updates, state = dist.update(grad(params, batches[comm.rank]), state, params)
        params = optax.apply_updates(params, updates)
        if step % k == 0:
            micro = []
        micro.append(jax.tree_util.tree_map(lambda *g: sum(g) / comm.size, *[grad(ref_params, b) for b in batches]))
        if step % k == k - 1:
            mean = jax.tree_util.tree_map(lambda *g: sum(g) / k, *micro)
            ref_updates, ref_state = ref_opt.update(mean, ref_state, ref_params)
            ref_params = optax.apply_updates(ref_params, ref_updates)
    for name in ("w", "b"):
        assert isinstance(params[name], jax.Array)
        np.testing.assert_allclose(np.asarray(params[name]), np.asarray(ref_params[name]), rtol=2e-5, atol=1e-6)
    same = coll.allgather(params["w"])  # identical bits on every rank
    assert all(np.array_equal(np.asarray(same[0]), np.asarray(same[r])) for r in range(comm.size))

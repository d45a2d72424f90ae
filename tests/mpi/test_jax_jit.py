"""``collectives.jax`` inside ``jax.jit`` (issue 37): every collective equal to the eager call bit for bit,
for every op and dtype the eager call accepts; the same refusals at trace time; gradients against their
analytic values; vmap, scan and fori_loop; the whole optax training step in one ``jit`` against the eager
one; a rank that retraced with another shape is a ``MismatchError`` on every rank, never a hang or wrong data.

    timeout 600 mpiexec -n 3 python tests/mpi_pytest.py tests/mpi/test_jax_jit.py -q -x --timeout 240
"""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest

import collectives as coll
from support.comms import communicator

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
cj = pytest.importorskip("collectives.jax")

DTYPES = ["bool", "int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64", "complex64"]
OPS = ["sum", "prod", "min", "max", "mean"]


def x64(dtype: str):
    """JAX's 64-bit types exist only with x64 on: on for those dtypes alone (the others run as users do)."""
    if not dtype.endswith("64") or dtype == "complex64":
        return contextlib.nullcontext()
    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # an older JAX: the experimental spelling
        from jax.experimental import enable_x64 as enable
    return enable(True)


def values(dtype: str, rank: int, count: int = 12):
    """Rank ``rank``'s input: distinct per rank, small (products of three ranks stay exact; int8/uint8
    sums wrap), with a fraction for the floats so that mean's division rounds."""
    k = np.arange(count)
    if dtype == "bool":
        return jnp.asarray((k + rank) % 3 != 0)
    if dtype in ("int8", "uint8"):
        v = (k * 37 + rank * 90) % 200
    else:
        v = (k + rank) % 5 + 1 + (0.37 * k if dtype.startswith(("float", "bfloat", "complex")) else 0)
    return jnp.asarray(v).astype(getattr(jnp, dtype))


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def eager_or_error(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs), None
    except (TypeError, ValueError) as exc:
        return None, type(exc)


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_inside_jit_is_the_eager_call_bit_for_bit(comm, dtype):
    with x64(dtype):
        x = values(dtype, comm.rank)
        for op in OPS:
            want, refused = eager_or_error(coll.allreduce, x, op=op)
            f = jax.jit(lambda v, op=op: cj.allreduce(v, op=op))
            if refused:  # the same refusal, at trace time (nothing sent: the next call still pairs up)
                with pytest.raises(refused):
                    f(x)
                continue
            got = f(x)
            assert isinstance(got, jax.Array) and same_bits(got, want), (op, dtype, got, want)
            assert same_bits(cj.allreduce(x, op=op), want), (op, dtype, "eager collectives.jax")


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_allgather_reduce_scatter_alltoall_bit_for_bit(comm, dtype):
    n = comm.size
    with x64(dtype):
        x = jnp.concatenate([values(dtype, comm.rank + j, 3) for j in range(n)])  # n blocks of 3
        for root in range(n):
            assert same_bits(jax.jit(lambda v, r=root: cj.broadcast(v, root=r))(x), coll.broadcast(x, root=root))
        assert same_bits(jax.jit(cj.allgather)(x), coll.allgather(x))
        assert same_bits(jax.jit(cj.alltoall)(x), coll.alltoall(x))
        for op in OPS:
            want, refused = eager_or_error(coll.reduce_scatter, x, op=op)
            f = jax.jit(lambda v, op=op: cj.reduce_scatter(v, op=op))
            if refused:
                with pytest.raises(refused):
                    f(x)
                continue
            assert same_bits(f(x), want), (op, dtype)


def test_allreduce_tree_is_the_eager_call_bit_for_bit(comm):
    r = comm.rank
    tree = {"w": values("float32", r).reshape(3, 4), "h": [values("bfloat16", r), values("float16", r, 5)],
            "c": values("complex64", r, 2)}
    for op in ("mean", "sum"):
        got = jax.jit(lambda t, op=op: cj.allreduce_tree(t, op=op))(tree)
        want = coll.allreduce_tree(tree, op=op)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(tree)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert same_bits(a, b), op
    with pytest.raises(TypeError, match="mean"):
        jax.jit(cj.allreduce_tree)({"i": jnp.arange(3)})  # integer mean: refused at trace time
    assert cj.allreduce_tree({}) == {}


def test_refusals_at_trace_time_leave_the_communicator_usable(comm):
    n = comm.size
    with pytest.raises(ValueError, match="unknown op"):
        jax.jit(lambda v: cj.allreduce(v, op="avg"))(jnp.ones(2))
    with pytest.raises(TypeError, match="op must be a string"):
        cj.allreduce(jnp.ones(2), op=None)
    with pytest.raises(TypeError):
        jax.jit(lambda v: cj.allreduce(v, op="sum"))(jnp.ones(2, dtype=bool))
    with pytest.raises(ValueError):
        jax.jit(lambda v: cj.broadcast(v, root=n))(jnp.ones(2))
    with pytest.raises(TypeError):
        jax.jit(lambda v: cj.broadcast(v, root=0.0))(jnp.ones(2))
    with pytest.raises(ValueError, match="at least one dimension"):
        jax.jit(cj.alltoall)(jnp.ones(()))
    if n > 1:
        with pytest.raises(ValueError, match="divisible"):
            jax.jit(cj.reduce_scatter)(jnp.ones(n + 1))
    with pytest.raises(TypeError, match="Communicator"):
        cj.allreduce(jnp.ones(2), comm="world")
    # nothing was sent: the next collective pairs up as usual
    assert jax.jit(cj.allreduce)(jnp.ones(2)).tolist() == [float(n)] * 2


def test_collectives_keep_program_order_in_one_computation_and_across(comm):
    n, r = comm.size, comm.rank

    @jax.jit
    def several(x):
        a = cj.allreduce(x)
        cj.barrier()
        b = cj.broadcast(x * 2, root=n - 1)
        c = cj.allgather(x[:1])
        return a, b, c

    x = jnp.full(3, float(r + 1))
    for _ in range(3):  # three computations in a row, each with four ordered collectives
        a, b, c = several(x)
        assert a.tolist() == [n * (n + 1) / 2] * 3
        assert b.tolist() == [2.0 * n] * 3
        assert c[:, 0].tolist() == [float(i + 1) for i in range(n)]
        cj.barrier()  # eagerly too
        coll.barrier()  # and the library's own eager call between jitted ones


def test_an_eager_call_waits_for_the_collectives_of_a_dispatched_computation(comm):
    """XLA runs a costly computation on its own thread after the call that dispatched it has returned: the
    eager collective that follows must neither overtake its collective (on the other ranks it would meet
    the wrong one) nor be refused by the thread guard while that collective runs (issue 37's bug on JAX
    0.4.38: ``synchronize`` refused after a jitted step)."""
    n = comm.size

    @jax.jit
    def costly(x):
        for _ in range(6):
            x = jnp.tanh(x @ x)
        return cj.allreduce(x, op="max")

    x = jnp.eye(384, dtype=jnp.float32) * 0.5
    for i in range(6):
        y = costly(x + comm.rank)  # may still be running when the next line starts
        z = coll.allreduce(np.full(2, float(i + comm.rank)))  # eager, NumPy: no JAX array to wait for
        assert z.tolist() == [float(n * i + n * (n - 1) // 2)] * 2
        h = coll.allreduce(np.ones(1), async_op=True)  # and a handle's wait()
        assert h.wait()[0] == n
        assert same_bits(y, costly(x + n - 1))  # max over ranks: the last rank's (tanh is increasing)


def test_the_flight_recorder_names_the_line_in_the_jitted_function(comm):
    from collectives._comm import engine_of  # the record as the dumps see it (Engine.trace_entries)

    def step(x):
        return cj.allreduce(x, op="mean") * 2  # the call site the record must name

    line = step.__code__.co_firstlineno + 1
    jax.jit(step)(jnp.ones(3))
    rec = engine_of(comm).trace_entries()[-1]
    assert rec["collective"] == "allreduce" and rec["op"] == "mean" and rec["state"] == "completed", rec
    assert rec["site"][1:] == [line, "step"] and rec["site"][0].endswith("test_jax_jit.py"), rec
    assert "collectives.jax (jit)" in rec["path"] and "asynchronous" in rec["path"], rec
    jax.jit(jax.grad(lambda v: jnp.sum(step(v))))(jnp.ones(3))  # the gradient's allreduce: the same line
    rec = engine_of(comm).trace_entries()[-1]
    assert rec["site"][1:] == [line, "step"], rec


def test_scan_and_fori_loop_bodies(comm):
    n = comm.size
    x = values("float32", comm.rank)

    def body(i, v):
        return cj.allreduce(v, op="mean") * 1.5 + i

    got = jax.jit(lambda v: jax.lax.fori_loop(0, 4, body, v))(x)
    want = x
    for i in range(4):
        want = jnp.asarray(coll.allreduce(want, op="mean")) * 1.5 + i
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)

    def step(carry, row):
        total = cj.allreduce(row)
        return carry + total, cj.allgather(row)

    rows = jnp.arange(12.0).reshape(4, 3) + comm.rank
    carry, gathered = jax.jit(lambda rs: jax.lax.scan(step, jnp.zeros(3), rs))(rows)
    assert gathered.shape == (4, n, 3)
    assert same_bits(carry, sum(np.asarray(coll.allreduce(rows[i])) for i in range(4)).astype(np.float32))


def test_gradients_are_the_analytic_ones(comm):
    n, r = comm.size, comm.rank
    w = jnp.arange(1.0, 5.0) * (r + 1)  # each rank's weights: sum over ranks = arange(1, 5) * n(n+1)/2
    total = n * (n + 1) / 2
    x = jnp.full(4, float(r))

    def grad(f):
        return np.asarray(jax.jit(jax.grad(f))(x))

    # L = sum_ranks <w_r, allreduce(x)>: dL/dx_r = sum_ranks w
    np.testing.assert_allclose(grad(lambda v: jnp.vdot(w, cj.allreduce(v))), np.arange(1.0, 5.0) * total)
    np.testing.assert_allclose(grad(lambda v: jnp.vdot(w, cj.allreduce(v, op="mean"))), np.arange(1.0, 5.0) * total / n,
                               rtol=1e-6)
    # L = sum_ranks <w_r, x_root>: root gets sum_ranks w, the others zeros
    for root in range(n):
        want = np.arange(1.0, 5.0) * total if r == root else np.zeros(4)
        np.testing.assert_allclose(grad(lambda v, root=root: jnp.vdot(w, cj.broadcast(v, root=root))), want)
    # L = sum_ranks sum_i c_i <w_r, x_i> (allgather, row i weighted i + 1): dL/dx_r = (r + 1) sum_ranks w
    rows = jnp.arange(1.0, n + 1.0)[:, None]
    np.testing.assert_allclose(grad(lambda v: jnp.sum(rows * w * cj.allgather(v))), (r + 1) * np.arange(1.0, 5.0) * total)
    # L = sum_ranks <u_r, alltoall(x)_r> with u_r's block i = i + 10 r: dL/dx_r's block j = j's u block r
    if 4 % n == 0:
        b = 4 // n
        u = jnp.repeat(jnp.arange(n) + 10.0 * r, b)
        want = np.repeat([r + 10.0 * j for j in range(n)], b)
        np.testing.assert_allclose(grad(lambda v: jnp.vdot(u, cj.alltoall(v))), want)
    xs = jnp.full(2 * n, float(r))
    g = np.asarray(jax.grad(lambda v: jnp.vdot(jnp.full(2, r + 1.0), cj.reduce_scatter(v)))(xs))
    np.testing.assert_allclose(g, np.repeat(np.arange(1.0, n + 1), 2))  # block j: rank j's weight
    tree_g = jax.grad(lambda t: jnp.vdot(w, cj.allreduce_tree(t, op="sum")["a"]))({"a": x})
    np.testing.assert_allclose(np.asarray(tree_g["a"]), np.arange(1.0, 5.0) * total)
    for op in ("min", "max", "prod"):
        with pytest.raises(TypeError, match="not defined"):
            jax.grad(lambda v, op=op: cj.allreduce(v, op=op).sum())(x)
    # a stop_gradient around a non-differentiable op is fine
    assert grad(lambda v: (v * jax.lax.stop_gradient(cj.allreduce(v, op="max"))).sum()).tolist() == [n - 1.0] * 4


def test_vmap_is_the_collective_of_the_stacked_array(comm):
    n, r = comm.size, comm.rank
    xs = jnp.arange(6.0).reshape(2, 3) + r
    if tuple(int(p) for p in re.findall(r"\d+", jax.__version__)[:3]) < (0, 8, 2):  # no rule: JAX's refusal
        with pytest.raises(ValueError, match="vmap"):
            jax.vmap(cj.allreduce)(xs)
        return
    assert same_bits(jax.jit(jax.vmap(cj.allreduce))(xs), coll.allreduce(xs))
    assert same_bits(jax.vmap(lambda v: cj.broadcast(v, root=n - 1))(xs), coll.broadcast(xs, root=n - 1))
    g = jax.vmap(cj.allgather)(xs)
    assert g.shape == (2, n, 3) and same_bits(g, jnp.moveaxis(jnp.asarray(coll.allgather(xs)), 0, 1))
    blocks = jnp.arange(2.0 * n * 2).reshape(2, 2 * n) + 10 * r  # each element: n blocks of 2
    rs = jax.vmap(cj.reduce_scatter)(blocks)
    assert rs.shape == (2, 2)
    for k in range(2):
        assert same_bits(rs[k], coll.reduce_scatter(blocks[k]))
        assert same_bits(jax.vmap(cj.alltoall)(blocks)[k], coll.alltoall(blocks[k]))
    # vmap over another argument only: one call, broadcast over the batch
    out = jax.vmap(lambda s, v: s * cj.allreduce(v), in_axes=(0, None))(jnp.arange(2.0), xs[0])
    assert same_bits(out[1], coll.allreduce(xs[0]))
    tree = jax.vmap(cj.allreduce_tree)({"a": xs})
    assert same_bits(tree["a"], coll.allreduce(xs, op="mean"))


def test_the_jitted_training_step_is_the_eager_one_after_20_steps(comm):
    optax = pytest.importorskip("optax")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        import train_jax
    finally:
        sys.path.pop(0)
    jitted = train_jax.train(steps=20, n=256, jit_whole_step=True)
    eager = train_jax.train(steps=20, n=256, jit_whole_step=False)
    for a, b in zip(jax.tree_util.tree_leaves(jitted), jax.tree_util.tree_leaves(eager)):
        assert same_bits(a, b)
    assert optax is not None


@pytest.mark.parametrize("differs", ["shape", "dtype"])
def test_a_rank_that_retraced_with_another_shape_is_a_mismatch_on_every_rank(comm, differs):
    """One rank calls the jitted function with one more element (or int32 elements): it retraces and runs
    another allreduce; the fingerprint beside the transfer shows it, and every rank raises (JAX wraps the
    callback's MismatchError in its runtime error), bounded by a deadline communicator, no data written."""
    with communicator(COLLECTIVES_TIMEOUT=60) as c:
        f = jax.jit(lambda v: cj.allreduce(v, comm=c))
        assert f(jnp.ones(4)).tolist() == [float(c.size)] * 4  # compiled once, used by every rank
        odd = c.size > 1 and c.rank == c.size - 1
        x = jnp.ones(5 if odd and differs == "shape" else 4, jnp.int32 if odd and differs == "dtype" else jnp.float32)
        if c.size == 1:
            assert f(x).tolist() == [1.0] * 4
            return
        with pytest.raises(Exception) as info:
            f(x).block_until_ready()
        err = info.value
        assert isinstance(err, coll.MismatchError) or (
            isinstance(err, RuntimeError) and "MismatchError" in str(err)), repr(err)[:2000]
        assert ("int32" in str(err)) if differs == "dtype" else ("5" in str(err)), str(err)[-3000:]
    assert comm.allreduce(np.ones(1))[0] == comm.size  # the world communicator is untouched

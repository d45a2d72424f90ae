"""Reproducible sums (issue 36): the same bits at any number of ranks, for any split of the same units.

The global data (units: rows of random values with extreme exponents, cancelling pairs, subnormals, and
rows holding NaN, inf and -0.0) is made from a seed on every rank. The reference is the reproducible sum
of all units on a communicator of one rank (``comm.split(color=comm.rank)``), computed on every rank; the
sums of the same units split among sub-communicators of every size from 1 to the world size, in several
splits (round robin, blocks, all on one rank, reversed rank order), asynchronous or not, must equal it
byte for byte; ``allreduce(..., reproducible=True)`` (one unit per rank), ``reduce`` and
``reduce_scatter`` must give the bits of the same units through ``allreduce_units``. Every element is
checked against the exact sum (``fractions.Fraction``) within the documented bound, and the specials
against IEEE addition. Mismatched calls (reproducible on some ranks, ordinary on others) raise
MismatchError where the library's checks see them (checked mode, asynchronous calls, the deadline
transport).

    timeout 600 mpiexec -n 3 python tests/mpi_pytest.py tests/mpi/test_reproducible.py -q -x
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from fractions import Fraction

import numpy as np
import pytest

import collectives as coll
from support.comms import communicator

DTYPES = ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"]
UNITS = 7  # units of global data: not a multiple of 2 or 3, so every split is uneven somewhere
COUNT = 203  # elements per unit


def _real(dtype: str) -> np.dtype:
    return np.dtype({"bfloat16": "float32", "complex64": "float32", "complex128": "float64"}.get(dtype, dtype))


def global_units(dtype: str, seed: int = 0, units: int = UNITS, count: int = COUNT, specials: bool = True):
    """The global data: ``units`` rows of ``count`` elements (the same on every rank), in ``dtype``'s
    real parts (float64 values that are exact in ``dtype``)."""
    rng = np.random.default_rng(seed)
    real = _real(dtype)
    parts = 2 if dtype.startswith("complex") else 1
    n = count * parts
    fin = np.finfo(np.float16 if dtype == "float16" else real)
    lo = int(np.log2(float(fin.smallest_subnormal))) + 1
    hi = int(np.log2(float(fin.max))) - 4
    if dtype == "bfloat16":
        lo = -130
    e = rng.integers(lo, hi, size=(units, n))
    x = rng.standard_normal((units, n)) * np.exp2(e.astype(np.float64))
    narrow = rng.random(n) < 0.5  # half the elements: a narrow range (sums that are exact in fixed point)
    x[:, narrow] = np.round(rng.standard_normal((units, int(narrow.sum()))) * 64) / 8
    cancel = rng.random(n) < 0.15  # cancelling pairs: +v in one unit, -v in another
    x[units - 1, cancel] = -x[0, cancel]
    tiny = rng.random(n) < 0.05  # subnormals of the dtype
    x[:, tiny] = rng.integers(-5, 6, size=(units, int(tiny.sum()))) * float(fin.smallest_subnormal)
    if specials:
        x[:, 0] = -0.0  # every term -0.0: -0.0
        x[1:, 1] = 0.0
        x[0, 1] = -0.0  # -0.0 and +0.0: +0.0
        x[2 % units, 2] = np.nan
        x[3 % units, 3] = np.inf
        x[4 % units, 4] = np.inf
        x[5 % units, 4] = -np.inf  # +inf and -inf: NaN
        x[:, 5] = -np.inf
        x[:, 6] = 0.0
        x[0, 6], x[units - 1, 6] = 5.0, -5.0  # an exact cancellation: +0.0
    return to_dtype(x, dtype)


def to_dtype(x: np.ndarray, dtype: str):
    """float64 values (real parts side by side for complex) as a NumPy array of ``dtype`` (bfloat16: a
    torch tensor)."""
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    real = _real(dtype)
    with np.errstate(all="ignore"):
        v = x.astype(real)
    return v.view(np.dtype(dtype)) if dtype.startswith("complex") else v


def as_float64(a) -> np.ndarray:
    """Any result (NumPy or torch, real or complex) as float64 real parts."""
    if not isinstance(a, np.ndarray):
        a = a.float().numpy() if str(a.dtype) == "torch.bfloat16" else a.numpy()
    if a.dtype.kind == "c":
        a = a.view(a.real.dtype)
    return a.astype(np.float64)


def raw(a) -> bytes:
    if isinstance(a, np.ndarray):
        return a.tobytes()
    import torch

    return a.view(torch.int16).numpy().tobytes() if a.dtype == torch.bfloat16 else a.numpy().tobytes()


@contextlib.contextmanager
def alone(comm):
    """A communicator of this rank alone (collective over ``comm``)."""
    solo = comm.split(color=comm.rank)
    try:
        yield solo
    finally:
        solo.close()


@contextlib.contextmanager
def first(comm, s: int, reverse: bool = False):
    """The first ``s`` ranks of ``comm`` as a communicator (None elsewhere), ranked in reverse with
    ``reverse``. Collective over ``comm``."""
    sub = comm.split(color=0 if comm.rank < s else None, key=-comm.rank if reverse else comm.rank)
    try:
        yield sub
    finally:
        if sub is not None:
            sub.close()


def splits(units: int, size: int) -> dict[str, list[list[int]]]:
    """Ways to share ``units`` units among ``size`` ranks: unit indices per rank."""
    ids = list(range(units))
    cuts = np.array_split(np.array(ids), size)
    return {
        "round-robin": [ids[r::size] for r in range(size)],
        "blocks": [c.tolist() for c in cuts],
        "all-on-last": [[] for _ in range(size - 1)] + [ids[::-1]],
        "reversed-blocks": [c.tolist()[::-1] for c in cuts[::-1]],
    }


def take(units, rows: list[int]):
    if isinstance(units, np.ndarray):
        return units[rows] if rows else units[:0]
    import torch

    return units[torch.tensor(rows, dtype=torch.long)] if rows else units[:0]


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_split_at_every_size_gives_the_bits_of_one_rank(comm, dtype, op):
    data = global_units(dtype, seed=2 * DTYPES.index(dtype) + (op == "mean"))
    with alone(comm) as solo:
        want = raw(solo.allreduce_units(data, op))
    for s in range(1, comm.size + 1):
        for reverse in (False, True):
            with first(comm, s, reverse) as sub:
                if sub is None:
                    continue
                for name, share in splits(UNITS, s).items():
                    mine = take(data, share[sub.rank])
                    got = sub.allreduce_units(mine, op)
                    assert raw(got) == want, (s, reverse, name)
                    got = sub.allreduce_units(mine, op, async_op=True).wait()
                    assert raw(got) == want, (s, reverse, name, "async")


def exact_bound_holds(result: np.ndarray, units: np.ndarray, op: str, words: int, dtype: str) -> None:
    """Every element within the documented bound of the exact sum (``Fraction``), and NaN, inf and the
    sign of zero as IEEE addition gives them (``result``, ``units``: float64 real parts)."""
    from collectives import _reproducible

    real = np.dtype(np.float16) if dtype == "float16" else _real(dtype)
    n = units.shape[0]
    for j in range(result.size):
        r, col = float(result[j]), units[:, j]
        if not np.isfinite(col).all() or (col == 0).all():
            ieee = functools.reduce(operator.add, col.tolist())  # IEEE: NaN, inf and the zero's sign in any order
            if op == "mean":
                ieee /= n
            assert (math.isnan(r) and math.isnan(ieee)) or (r == ieee and math.copysign(1, r) == math.copysign(1, ieee)), \
                (j, r, ieee)
            continue
        exact = sum((Fraction(float(v)) for v in col), Fraction(0))
        if op == "mean":
            exact /= n
        if math.isinf(r):
            assert abs(exact) > float(np.finfo(real).max), (j, r)
            continue
        e = max(math.frexp(float(v))[1] for v in col)  # |x| < 2**e for every term
        ulp = ulp_of(r, dtype)
        quantum = Fraction(2) ** (e - _reproducible.S * words)
        bound = n * quantum + Fraction(ulp) / 2 if op == "sum" else quantum + 2 * Fraction(ulp)
        assert abs(Fraction(r) - exact) <= bound, (j, r, float(exact), float(bound))


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_within_the_bound_of_the_exact_sum(comm, dtype, op):
    data = global_units(dtype, seed=7, units=UNITS, count=61)
    share = splits(UNITS, comm.size)["round-robin"][comm.rank]
    got = comm.allreduce_units(take(data, share), op)
    words = 2 if _real(dtype) == np.float64 else 1
    exact_bound_holds(as_float64(got).reshape(-1), as_float64(data).reshape(UNITS, -1), op, words, dtype)


def test_float16_sums_are_correctly_rounded(comm):
    """float16 terms are exact in the fixed point: the result is the exact sum rounded once."""
    data = global_units("float16", seed=3, specials=False)
    got = comm.allreduce_units(take(data, splits(UNITS, comm.size)["blocks"][comm.rank]), "sum")
    exact = [sum((Fraction(float(v)) for v in data[:, j]), Fraction(0)) for j in range(COUNT)]
    want = np.array([float(v) for v in exact]).astype(np.float16)  # float64 of the exact sum: exact here
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_one_unit_per_rank_collectives_give_the_units_bits(comm, dtype, op):
    """allreduce, reduce and reduce_scatter with reproducible=True (blocking and asynchronous): the bits
    of allreduce_units of the ranks' arrays, as units."""
    size = comm.size
    data = global_units(dtype, seed=11, units=size, count=8 * size)
    with alone(comm) as solo:
        want = raw(solo.allreduce_units(data, op))
    mine = take(data, [comm.rank])[0]
    for async_op in (False, True):
        x = mine.clone() if not isinstance(mine, np.ndarray) else mine.copy()
        h = comm.allreduce(x, op, reproducible=True, async_op=async_op)
        got = h.wait() if async_op else h
        assert got is x and raw(got) == want
        x = mine.clone() if not isinstance(mine, np.ndarray) else mine.copy()
        h = coll.reduce(x, op, root=size - 1, reproducible=True, async_op=async_op)
        got = h.wait() if async_op else h
        assert raw(got) == (want if comm.rank == size - 1 else raw(mine))
        x = mine.clone() if not isinstance(mine, np.ndarray) else mine.copy()
        h = coll.reduce_scatter(x.reshape(size, -1), op, reproducible=True, async_op=async_op)
        got = h.wait() if async_op else h
        block = len(want) // size
        assert raw(got) == want[comm.rank * block:(comm.rank + 1) * block]
        assert raw(x) == raw(mine)  # reduce_scatter leaves x as it was


def test_read_only_strided_and_torch_inputs(comm):
    torch = pytest.importorskip("torch")
    data = global_units("float32", seed=5, units=comm.size, count=40)
    with alone(comm) as solo:
        want = solo.allreduce_units(data, "sum")
    mine = data[comm.rank]
    ro = mine.copy()
    ro.flags.writeable = False
    got = comm.allreduce(ro, "sum", reproducible=True)
    assert got is not ro and got.tobytes() == want.tobytes() and ro.tobytes() == mine.tobytes()
    strided = np.repeat(mine, 2)[::2]
    assert comm.allreduce(strided, "sum", reproducible=True) is strided and strided.tobytes() == want.tobytes()
    t = torch.from_numpy(mine.copy()).requires_grad_(True)
    got = comm.allreduce(t, "sum", reproducible=True)
    assert got is t and got.detach().numpy().tobytes() == want.tobytes()


def test_large_arrays_through_shared_memory_and_pieces(comm):
    """Arrays past the shared-memory threshold, and MPI calls cut in pieces: the same bits."""
    n = 70_000  # 560 KiB of words: the node-shared window (256 KiB and up)
    data = global_units("float32", seed=9, units=3, count=n, specials=False)
    with alone(comm) as solo:
        want = solo.allreduce_units(data, "sum").tobytes()
    share = splits(3, comm.size)["blocks"][comm.rank]
    assert comm.allreduce_units(data[share], "sum").tobytes() == want
    if comm.backend != "mpi":
        return
    for env in ({"COLLECTIVES_MAX_COUNT": 4099}, {"COLLECTIVES_SHM": 0}, {"COLLECTIVES_TIMEOUT": 300}):
        with communicator(**env) as c:
            assert c.allreduce_units(data[share], "sum").tobytes() == want, env
            assert c.allreduce_units(data[share], "sum", async_op=True).wait().tobytes() == want, env


def test_the_communicators_default(comm):
    """comm.reproducible (COLLECTIVES_REPRODUCIBLE): float sums and means reproducible, twice (never a
    cached ordinary call), other pairs unchanged; reproducible=False still the ordinary call."""
    data = global_units("float32", seed=2, units=comm.size, count=30, specials=False)
    with alone(comm) as solo:
        want = solo.allreduce_units(data, "sum").tobytes()
    ordinary = comm.allreduce(data[comm.rank].copy(), "sum")  # the ordinary call, cached by the hot path
    assert not comm.reproducible
    comm.reproducible = True
    try:
        for _ in range(2):
            assert comm.allreduce(data[comm.rank].copy(), "sum").tobytes() == want
        assert comm.allreduce(data[comm.rank].copy(), "sum", reproducible=False).tobytes() == ordinary.tobytes()
        assert comm.allreduce(np.ones(3, np.int64), "sum").tolist() == [comm.size] * 3
        assert comm.allreduce(np.ones(3), "max").tolist() == [1.0] * 3
        with first(comm, comm.size) as child:  # a split starts with its parent's default
            assert child.reproducible
            assert child.allreduce(data[comm.rank].copy(), "sum").tobytes() == want
    finally:
        comm.reproducible = False
    assert comm.allreduce(data[comm.rank].copy(), "sum").tobytes() == ordinary.tobytes()


@pytest.mark.parametrize("bad, error, words", [
    (dict(op="max"), ValueError, "op='sum' and op='mean'"),
    (dict(op="prod"), ValueError, "op='sum' and op='mean'"),
    (dict(dtype="int64"), TypeError, "integer sums are exact"),
    (dict(dtype="longdouble"), TypeError, "float16, bfloat16, float32, float64"),
    (dict(reproducible="yes"), TypeError, "True, False or None"),
])
def test_bad_calls_raise_before_anything_moves(comm, bad, error, words):
    x = np.arange(4, dtype=bad.get("dtype", "float32"))
    before = x.copy()
    for fn in (coll.allreduce, coll.reduce):
        with pytest.raises(error, match=words):
            fn(x, bad.get("op", "sum"), reproducible=bad.get("reproducible", True))
        assert x.tobytes() == before.tobytes()
    if "reproducible" not in bad:
        with pytest.raises(error, match=words):
            coll.allreduce_units(x[None], bad.get("op", "sum"))
    with pytest.raises(ValueError, match="stack of units"):
        coll.allreduce_units(np.array(1.0, dtype=np.float32))
    assert comm.allreduce(np.ones(2), "sum").tolist() == [comm.size] * 2  # the communicator still works


def test_no_units_anywhere(comm):
    empty = np.zeros((0, 3), dtype=np.float32)
    assert comm.allreduce_units(empty, "sum").tobytes() == np.zeros(3, np.float32).tobytes()
    assert np.isnan(comm.allreduce_units(empty, "mean")).all()


@pytest.mark.skipif(coll.world().size < 2 or coll.world().backend != "mpi", reason="needs two or more MPI ranks")
@pytest.mark.parametrize("mode", ["checked", "async", "deadline", "shared memory", "device, checked",
                                  "device, deadline"])
def test_reproducible_against_ordinary_is_a_mismatch(comm, mode, monkeypatch):
    """``shared memory``: both calls through the node-shared window (the reproducible one in its one pass),
    unchecked and blocking: the window's own comparison of the calls names the op, buffers untouched.
    ``device``: arrays in device memory (host staging, with stand-ins for the device): agreed on in
    checked mode, compared beside the staged transfer by the deadline transport."""
    from support.device import OnDevice, staging

    env = {"COLLECTIVES_TIMEOUT": 60} if mode.endswith("deadline") else {}
    if mode == "shared memory":
        env = {"COLLECTIVES_SHM_THRESHOLD": 64}
    with communicator(**env) as c:
        c.check = mode.endswith("checked")
        x = np.full(4096 if mode == "shared memory" else 8, 1.0 + c.rank, dtype=np.float32)
        before = x.copy()
        if mode.startswith("device"):
            staging(c, monkeypatch)
            x = OnDevice(x)
        reproducible = c.rank == c.size - 1
        with pytest.raises(coll.MismatchError) as info:
            h = c.allreduce(x, "sum", reproducible=reproducible, async_op=mode == "async")
            if mode == "async":
                h.wait()
        assert "reproducible sum" in str(info.value), str(info.value)
        if mode in ("checked", "shared memory", "device, checked"):  # refused before anything moved (or was written)
            assert (x.values if mode.startswith("device") else x).tobytes() == before.tobytes()


PRECISION = {"float16": (11, -24), "bfloat16": (8, -133), "float32": (24, -149), "float64": (53, -1074)}


def ulp_of(r: float, dtype: str) -> float:
    """The spacing of ``dtype``'s values at ``r`` (its binade's; complex: of a part)."""
    bits, tiny = PRECISION[{"complex64": "float32", "complex128": "float64"}.get(dtype, dtype)]
    return math.ldexp(1.0, max(math.frexp(r)[1] - bits, tiny)) if r else math.ldexp(1.0, tiny)


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_allreduce_tree_at_every_size_and_bucket_size(comm, op):
    """allreduce_tree(reproducible=True): each float leaf the bits of allreduce_units of the ranks' leaves,
    at every size, for every bucket size, blocking and asynchronous; integer leaves exact as ever."""
    names = ("float32", "float64", "float16", "complex64")
    data = {name: global_units(name, seed=20 + i, units=comm.size, count=40 + 9 * i) for i, name in enumerate(names)}
    for s in range(1, comm.size + 1):
        with first(comm, s) as sub:
            if sub is None:
                continue
            with alone(sub) as solo:
                want = {name: solo.allreduce_units(d[:s], op).tobytes() for name, d in data.items()}
            for bucket_bytes in (64, 1024, 1 << 20):
                for async_op in (False, True):
                    tree = {name: d[sub.rank].copy() for name, d in data.items()}
                    if op == "sum":  # (the mean of an integer leaf is refused)
                        tree["steps"] = np.arange(3, dtype=np.int64) + sub.rank
                    h = sub.allreduce_tree(tree, op, bucket_bytes=bucket_bytes, reproducible=True, async_op=async_op)
                    out = h.wait() if async_op else h
                    for name in names:
                        assert out[name].tobytes() == want[name], (s, bucket_bytes, async_op, name)
                    if op == "sum":
                        assert out["steps"].tolist() == [i * s + s * (s - 1) // 2 for i in range(3)]


def test_allreduce_tree_bad_calls(comm):
    with pytest.raises(ValueError, match="op='sum' and op='mean'"):
        coll.allreduce_tree({"w": np.ones(2)}, "max", reproducible=True)
    with pytest.raises(TypeError, match=r"\['w'\].*float16, bfloat16, float32, float64"):
        coll.allreduce_tree({"w": np.ones(2, dtype=np.longdouble)}, "sum", reproducible=True)
    with pytest.raises(TypeError, match="True, False or None"):
        coll.allreduce_tree({"w": np.ones(2)}, "sum", reproducible=1)
    assert coll.allreduce_tree({"w": np.ones(2)}, "max", reproducible=False)["w"].tolist() == [1.0, 1.0]


MICRO = 6  # micro-batches of the global batch: the units of the world-size-invariant step
STEPS = 20


def _torch_training(c, torch):
    """K steps of a small MLP, each step's gradient the reproducible mean of one unit per micro-batch
    (this rank's share of the global batch): the recipe of docs/guide-data-parallel.md."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(MICRO, 4, 5, generator=g)
    y = torch.randn(MICRO, 4, 1, generator=g)
    params = list(model.parameters())
    for _ in range(STEPS):
        units = []
        for i in range(c.rank, MICRO, c.size):  # this rank's micro-batches, one backward pass each
            model.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x[i]), y[i]).backward()
            units.append(torch.cat([p.grad.reshape(-1) for p in params]))
        stack = torch.stack(units) if units else torch.zeros(0, sum(p.numel() for p in params))
        mean = coll.allreduce_units(stack, "mean", comm=c)
        offset = 0
        for p in params:
            p.grad = mean[offset:offset + p.numel()].reshape(p.shape).clone()
            offset += p.numel()
        opt.step()
    return b"".join(p.detach().numpy().tobytes() for p in params)


def _jax_training(c, jax, optax):
    jnp = jax.numpy
    key = jax.random.PRNGKey(0)
    k1, k2, k3 = jax.random.split(key, 3)
    params = {"w": jax.random.normal(k1, (5, 8)) * 0.3, "v": jax.random.normal(k2, (8,)) * 0.3}
    x = jax.random.normal(k3, (MICRO, 4, 5))
    y = jnp.sum(x, axis=-1)

    def loss(p, xb, yb):
        return jnp.mean((jnp.tanh(xb @ p["w"]) @ p["v"] - yb) ** 2)

    grad = jax.jit(jax.grad(loss))
    opt = optax.adam(1e-2)
    state = opt.init(params)
    for _ in range(STEPS):
        units = [grad(params, x[i], y[i]) for i in range(c.rank, MICRO, c.size)]
        mean = {}
        for name in params:
            stack = (np.stack([np.asarray(u[name]) for u in units]) if units
                     else np.zeros((0,) + params[name].shape, np.float32))
            mean[name] = jnp.asarray(coll.allreduce_units(stack, "mean", comm=c))
        updates, state = opt.update(mean, state, params)
        params = optax.apply_updates(params, updates)
    return b"".join(np.asarray(params[k]).tobytes() for k in sorted(params))


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_training_steps_are_the_same_bits_at_every_size(comm, framework):
    """The world-size-invariant step: K steps of an MLP on a fixed global batch of micro-batches give
    parameters bitwise identical at every number of ranks (sub-communicators of every size)."""
    if framework == "torch":
        torch = pytest.importorskip("torch")
        torch.set_num_threads(1)
        run = lambda c: _torch_training(c, torch)
    else:
        jax = pytest.importorskip("jax")
        optax = pytest.importorskip("optax")
        run = lambda c: _jax_training(c, jax, optax)
    with alone(comm) as solo:
        want = run(solo)
    for s in range(2, comm.size + 1):
        with first(comm, s) as sub:
            if sub is not None:
                assert run(sub) == want, s


def test_distributed_optimizer_under_the_default(comm):
    """COLLECTIVES_REPRODUCIBLE=1: DistributedOptimizer's gradient reductions (overlapped buckets, one
    fused allreduce_tree, sharded state's reduce-scatter) are reproducible sums of one unit per rank:
    every mode gives the parameters of the recipe with one micro-batch per rank, bit for bit."""
    torch = pytest.importorskip("torch")
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend (a communicator made under the variable)")
    torch.set_num_threads(1)

    def run(c, mode):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(c.size, 4, 5, generator=g), torch.randn(c.size, 4, 1, generator=g)
        inner = torch.optim.Adam(model.parameters(), lr=1e-2)
        opt = inner if mode == "recipe" else coll.DistributedOptimizer(
            inner, comm=c, overlap=mode != "fused", shard_state=mode == "sharded", bucket_bytes=256)
        params = list(model.parameters())
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x[c.rank]), y[c.rank]).backward()
            if mode == "recipe":
                flat = torch.cat([p.grad.reshape(-1) for p in params])[None]
                mean = coll.allreduce_units(flat, "mean", comm=c)
                offset = 0
                for p in params:
                    p.grad = mean[offset:offset + p.numel()].reshape(p.shape).clone()
                    offset += p.numel()
            opt.step()
        if mode != "recipe":
            opt.close()
        return b"".join(p.detach().numpy().tobytes() for p in params)

    with communicator(COLLECTIVES_REPRODUCIBLE=1) as c:
        assert c.reproducible
        want = run(c, "recipe")
        for mode in ("overlap", "fused", "sharded"):
            assert run(c, mode) == want, mode


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_distributed_optimizer_reproducible_at_every_size(comm, framework):
    """DistributedOptimizer(..., reproducible=True): every backward pass (torch) or every gradient tree of
    update()'s list (optax) is one unit; 20 steps on a fixed global batch give parameters bitwise identical
    at every number of ranks (the world communicator and sub-communicators of every size;
    tests/crash/test_reproducible_jobs.py runs the same steps in a job of 4 ranks)."""
    from support import steps

    if framework == "torch":
        pytest.importorskip("torch")
        run = steps.torch_steps
    else:
        pytest.importorskip("jax")
        pytest.importorskip("optax")
        run = steps.jax_steps
    with alone(comm) as solo:
        want = run(solo)
    assert run(comm) == want
    for s in range(2, comm.size):
        with first(comm, s, reverse=True) as sub:  # also a rank order other than the world's
            if sub is not None:
                assert run(sub) == want, s


@pytest.mark.parametrize("op", ["mean", "sum"])
def test_reproducible_optimizer_units(comm, op):
    """What a unit is: a parameter unused in some backward passes contributes zeros to those units; one
    without gradient in every unit on every rank keeps ``.grad`` None and its value; ``average_gradients()``
    writes the units' mean into ``.grad`` (for clipping) and ``step()`` does not sum again; ``zero_grad()``
    between the backward passes of a step drops nothing."""
    torch = pytest.importorskip("torch")
    a, b, c = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    opt = coll.DistributedOptimizer(torch.optim.SGD([a, b, c], lr=1.0), op=op, comm=comm, reproducible=True)
    for i in range(comm.rank, 6, comm.size):  # six units in all, whatever the number of ranks
        opt.zero_grad()
        loss = (a * (i + 1)).sum() + (b.sum() if i % 2 == 0 else 0)
        loss.backward()
        assert a.grad is None  # taken by the wrapper: the next pass starts from nothing
    opt.average_gradients()
    scale = 6 if op == "sum" else 1
    assert a.grad.tolist() == [3.5 * scale] * 2  # (1 + ... + 6) / 6
    assert b.grad.tolist() == [0.5 * scale] * 2  # three units of 1, three of 0
    assert c.grad is None
    opt.step()
    assert a.detach().tolist() == [-3.5 * scale] * 2 and b.detach().tolist() == [-0.5 * scale] * 2
    assert c.detach().tolist() == [0.0, 0.0]
    opt.close()


def test_reproducible_optimizer_refuses_before_anything_moves(comm):
    """What cannot be reproducible is refused at construction (or at the call), with a typed error that says
    why, on every rank alike and before any communication."""
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([p], lr=0.1)
    for kwargs, error, words in [
        ({"compression": "fp16"}, ValueError, "compression"),
        ({"shard_state": True}, ValueError, "shard_state"),
        ({"backward_passes_per_step": 2}, ValueError, "one unit"),
        ({"op": "max"}, ValueError, "not a sum"),
        ({"reproducible": 1}, TypeError, "True or False"),
    ]:
        with pytest.raises(error, match=words):
            coll.DistributedOptimizer(sgd, comm=comm, **{"reproducible": True, **kwargs})
    with pytest.raises(TypeError, match="complex64"):
        coll.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))]),
                                  comm=comm, reproducible=True)
    opt = coll.DistributedOptimizer(sgd, comm=comm, reproducible=True)
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: 0.0)
    opt.close()

    class SGD:  # an optax-like optimizer
        init = staticmethod(lambda params: ())
        update = staticmethod(lambda g, s, params=None: ({k: -v for k, v in g.items()}, s))

    dist = coll.DistributedOptimizer(SGD(), comm=comm, reproducible=True)
    params = {"w": np.zeros(2, np.float32)}
    state = dist.init(params)
    with pytest.raises(TypeError, match="list of gradient trees"):
        dist.update({"w": np.ones(2, np.float32)}, state, params)
    with pytest.raises(ValueError, match="needs params"):
        dist.update([], state)
    with pytest.raises(ValueError, match="structure"):
        dist.update([{"w": np.ones(2, np.float32), "v": np.ones(1, np.float32)}], state, params)
    units = [{"w": np.full(2, float(i), np.float32)} for i in range(comm.rank, 4, comm.size)]
    updates, _ = dist.update(units, state, params)  # ranks past the fourth have no unit: params gives the tree
    assert updates["w"].tolist() == [-1.5, -1.5]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_split_path_gives_the_same_bits(comm, dtype):
    """Large blocking allreduces take the words' reduce-scatter, decode a block per rank and allgather the
    values (Communicator._summing_split): the bits of the one-allreduce path. The size at which it starts
    is the communicator's SPLIT_BYTES, a private threshold set to 0 here (no public name can choose the
    path: it is an implementation detail with the same bits by design, which this test checks)."""
    data = global_units(dtype, seed=40 + DTYPES.index(dtype), count=29 * comm.size)
    mine = take(data, list(range(comm.rank, UNITS, comm.size)))
    with alone(comm) as solo:
        want = {op: raw(coll.allreduce_units(data, op, comm=solo)) for op in ("sum", "mean")}
    one = take(data, [comm.rank % UNITS])
    plain = {op: raw(coll.allreduce(one[0].clone() if not isinstance(one, np.ndarray) else one[0].copy(), op,
                                    comm=comm, reproducible=True)) for op in ("sum", "mean")}
    comm.SPLIT_BYTES = 0
    try:
        for op in ("sum", "mean"):
            assert raw(coll.allreduce_units(mine, op, comm=comm)) == want[op], op
            x = one[0].clone() if not isinstance(one, np.ndarray) else one[0].copy()
            assert raw(coll.allreduce(x, op, comm=comm, reproducible=True)) == plain[op], op
    finally:
        del comm.SPLIT_BYTES


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_node_shared_window_sums_every_ranks_terms_at_once(comm, dtype, monkeypatch):
    """allreduce(reproducible=True), every rank on one node, from the shared-memory threshold: the window's one pass
    (each rank sums its slice over every rank's terms at once, ``_reproducible.sum_terms``), in pieces of
    a small slot, plain and under the deadline, gives the bits of the same units summed on one rank, and
    of the general path's two collectives (``COLLECTIVES_SHM=0``); ``allreduce_units`` takes it where every
    rank holds one unit (they vote), not where rank 0 holds two. The pass gives the same bits by design,
    so the test counts its uses through the private ``shm.Reducer.allreduce_exact`` (no public name says
    which path a call took) to be sure that it ran where it should."""
    if comm.backend != "mpi":
        pytest.skip("the node-shared window is the MPI transport's")
    from collectives._backends import shm

    passes = []
    one_pass = shm.Reducer.allreduce_exact
    monkeypatch.setattr(shm.Reducer, "allreduce_exact", lambda self, *a, **k: passes.append(1) or one_pass(self, *a, **k))
    data = global_units(dtype, seed=60 + DTYPES.index(dtype), units=comm.size, count=3001)
    rows = [0, *range(comm.size)]  # rank 0 holds its unit twice
    with alone(comm) as solo:
        want = {op: raw(solo.allreduce_units(data, op)) for op in ("sum", "mean")}
        uneven = {op: raw(solo.allreduce_units(take(data, rows), op)) for op in ("sum", "mean")}
    small = {"COLLECTIVES_SHM_THRESHOLD": 64, "COLLECTIVES_SHM_SLOT_BYTES": 65536}
    for env in (small, {**small, "COLLECTIVES_TIMEOUT": 300}, {"COLLECTIVES_SHM": 0}):
        with communicator(**env) as c:
            for op in ("sum", "mean"):
                before = len(passes)
                mine = take(data, [c.rank])
                x = mine[0].copy() if isinstance(mine, np.ndarray) else mine[0].clone()
                assert raw(c.allreduce(x, op, reproducible=True)) == want[op], (env, op)
                kept = raw(mine)
                assert raw(c.allreduce_units(mine, op)) == want[op], (env, op, "units")
                assert raw(mine) == kept, (env, op)  # (the pass reads the unit where it lies: never writes it)
                through = c.size > 1 and env.get("COLLECTIVES_SHM") != 0
                assert len(passes) - before == (2 if through else 0), (env, op, len(passes) - before)
                if c.size > 1:  # units: one pass only where every rank holds one unit
                    before = len(passes)
                    mine = take(data, [c.rank] * (1 + (c.rank == 0)))
                    assert raw(c.allreduce_units(mine, op)) == uneven[op], (env, op)
                    assert len(passes) == before, (env, op)


# ---- arrays in device (CUDA) memory: the host path's reproducible sum of a host copy, on every device
# transport (DeviceTransport.reproducible); here through host staging with stand-ins for the device ----

DEVICE_DTYPES = ["float16", "float32", "float64", "complex64"]  # (bfloat16: the stand-in holds NumPy values)


@pytest.mark.parametrize("transport", ["host-staging", "cuda-aware-mpi"])
@pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "checked"])
def test_device_arrays_give_the_bits_of_host_arrays(comm, monkeypatch, checked, transport):
    """allreduce, reduce, reduce_scatter (reproducible=True, blocking and asynchronous), allreduce_units
    (uneven splits) and allreduce_tree's device leaves: the bits of the same calls on host arrays, x
    written as on the host path, one record and (checked mode) one agreement per call. Every device
    transport stages them alike (``DeviceTransport.reproducible``; NCCL's runs in tests/gpu)."""
    from collectives._backends import cuda
    from collectives._comm import engine_of  # the record's sequence number: one record per device call
    from support.device import OnDevice, staging

    if transport == "cuda-aware-mpi" and comm.backend != "mpi":
        pytest.skip("CUDA-aware MPI needs the MPI backend")
    before, comm.check = comm.check, checked
    try:
        staging(comm, monkeypatch, cuda.HostStagingTransport if transport == "host-staging" else
                cuda.CudaAwareMPITransport)
        engine = engine_of(comm)
        size, rank = comm.size, comm.rank
        for dtype in DEVICE_DTYPES:
            data = global_units(dtype, seed=31, units=size, count=8 * size)
            with alone(comm) as solo:
                want = solo.allreduce_units(data, "sum").tobytes()
            mine = data[rank]
            for async_op in (False, True):
                def run(call, *args, async_op=async_op, **kw):
                    seq = engine.trace_seq()
                    h = call(*args, async_op=async_op, **kw)
                    got = h.wait() if async_op else h
                    assert engine.trace_seq() == seq + 1, call
                    return got

                x = OnDevice(mine)
                assert run(comm.allreduce, x, "sum", reproducible=True) is x and x.values.tobytes() == want
                x = OnDevice(mine)
                assert run(comm.reduce, x, "sum", size - 1, reproducible=True) is x
                assert x.values.tobytes() == (want if rank == size - 1 else mine.tobytes())
                x = OnDevice(mine.reshape(size, -1))
                got = run(comm.reduce_scatter, x, "sum", reproducible=True)
                block = len(want) // size
                assert got.values.tobytes() == want[rank * block:(rank + 1) * block]
                assert x.values.tobytes() == mine.tobytes()
                share = splits(size, size)["all-on-last"][rank]
                got = run(comm.allreduce_units, OnDevice(take(data, share)), "mean")
                with alone(comm) as solo:
                    assert got.values.tobytes() == solo.allreduce_units(data, "mean").tobytes()
        comm.reproducible = True  # COLLECTIVES_REPRODUCIBLE=1: device sums too; reproducible=False: ordinary
        try:
            x = OnDevice(mine)
            assert comm.allreduce(x, "sum").values.tobytes() == want
            if transport == "host-staging":  # (the stand-in has no device memory for MPI's own calls)
                y = OnDevice(mine)
                ordinary = comm.allreduce(mine.copy(), "sum", reproducible=False)
                assert comm.allreduce(y, "sum", reproducible=False).values.tobytes() == ordinary.tobytes()
        finally:
            comm.reproducible = False
        names = ("float32", "float64", "float16", "complex64")
        data = {n: global_units(n, seed=40 + i, units=size, count=30 + 7 * i) for i, n in enumerate(names)}
        for op in ("sum", "mean"):
            with alone(comm) as solo:
                want = {n: solo.allreduce_units(d, op).tobytes() for n, d in data.items()}
            for async_op in (False, True):  # device leaves and host leaves, in buckets of 64 bytes
                tree = {n: OnDevice(d[rank]) if i % 2 else d[rank].copy() for i, (n, d) in enumerate(data.items())}
                if op == "sum" and transport == "host-staging":  # an integer device leaf: exact, as ever
                    tree["steps"] = OnDevice(np.arange(3, dtype=np.int32) + rank)
                h = comm.allreduce_tree(tree, op, bucket_bytes=64, reproducible=True, async_op=async_op)
                out = h.wait() if async_op else h
                for i, n in enumerate(names):
                    assert (out[n].values if i % 2 else out[n]).tobytes() == want[n], (n, op, async_op)
                if "steps" in tree:
                    assert out["steps"].values.tolist() == [i * size + size * (size - 1) // 2 for i in range(3)]
    finally:
        comm.check = before


@pytest.mark.parametrize("transport", ["host-staging", "cuda-aware-mpi"])
def test_a_trees_device_leaves_are_summed_a_bucket_at_a_time(comm, monkeypatch, transport):
    """allreduce_tree(reproducible=True) with many device leaves of several dtypes and sizes (an empty one
    too): each leaf the bits of the same leaf in host memory, for every bucket size, blocking and
    asynchronous; and the leaves go through host memory a bucket at a time, not a leaf at a time: with
    buckets of 1 MiB, one host collective per dtype; with 256 bytes, packs of at most 256 bytes, or one
    leaf. (What crosses to the host is seen only by the transport's ``reproducible``, wrapped here to log
    it: no public name shows how many host collectives a device call made.)"""
    from collectives._backends import cuda
    from support.device import OnDevice, staging

    if transport == "cuda-aware-mpi" and comm.backend != "mpi":
        pytest.skip("CUDA-aware MPI needs the MPI backend")
    t = staging(comm, monkeypatch, cuda.HostStagingTransport if transport == "host-staging" else
                cuda.CudaAwareMPITransport)
    staged = []
    real = t.reproducible
    monkeypatch.setattr(t, "reproducible", lambda x, *a: (staged.append((x.values.dtype.name, x.values.nbytes)),
                                                          real(x, *a))[1])
    size, rank = comm.size, comm.rank
    counts = {"float32": (5, 17, 0, 40, 3, 90), "float64": (9, 1, 33), "complex64": (4, 12)}
    data = {f"{name}/{i}": global_units(name, seed=60 + 7 * j + i, units=size, count=n, specials=n >= 7)
            for j, (name, ns) in enumerate(counts.items()) for i, n in enumerate(ns)}
    for op in ("sum", "mean"):
        with alone(comm) as solo:
            want = {k: solo.allreduce_units(d, op).tobytes() for k, d in data.items()}
        for bucket_bytes in (256, 1 << 20):
            for async_op in (False, True):
                tree = {k: OnDevice(d[rank]) for k, d in data.items()}
                tree["host"] = data["float32/1"][rank].copy()  # a host leaf beside them
                staged.clear()
                h = comm.allreduce_tree(tree, op, bucket_bytes=bucket_bytes, reproducible=True, async_op=async_op)
                out = h.wait() if async_op else h
                for k in data:
                    assert out[k] is tree[k] and out[k].values.tobytes() == want[k], (k, op, bucket_bytes, async_op)
                assert out["host"].tobytes() == want["float32/1"]
                for name, ns in counts.items():  # every leaf's bytes crossed once, in its dtype's calls
                    assert sum(b for d, b in staged if d == name) == sum(ns) * np.dtype(name).itemsize, staged
                if bucket_bytes == 1 << 20:
                    assert sorted(d for d, _ in staged) == sorted(counts), staged
                else:
                    leaves = {n * np.dtype(name).itemsize for name, ns in counts.items() for n in ns}
                    assert all(b <= bucket_bytes or b in leaves for _, b in staged), staged
                    assert len(staged) < len(data), staged


def test_device_bad_calls_are_the_host_paths_errors(comm, monkeypatch):
    """A device array's reproducible call that the host path refuses: the same error, word for word, before
    anything moves, x untouched; the communicator still works."""
    from support.device import OnDevice, staging

    staging(comm, monkeypatch)
    for dtype, op in (("int64", "sum"), ("float32", "max"), ("float32", "prod")):
        x = np.arange(4, dtype=dtype)
        with pytest.raises((TypeError, ValueError)) as host:
            comm.allreduce(x.copy(), op, reproducible=True)
        d = OnDevice(x)
        with pytest.raises(type(host.value)) as dev:
            comm.allreduce(d, op, reproducible=True)
        assert str(dev.value) == str(host.value) and d.values.tobytes() == x.tobytes()
    assert comm.allreduce(OnDevice(np.ones(2)), "sum").values.tolist() == [comm.size] * 2

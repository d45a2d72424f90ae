"""The NaN check (``COLLECTIVES_CHECK_NAN=1``, issue 35): a floating reduction whose input holds NaN or inf
on some rank raises the same NonFiniteError on every rank, naming each such rank and the first such element,
before anything moves; every input is left as it was and the communicator stays usable; finite inputs give
the same bits as with the check off. Through every front end: the collectives (blocking and asynchronous),
allreduce_tree, DistributedOptimizer (both ways), the torch backend. At any world size: the NaN is on the
last rank, the inf (where the test has one) on rank 0 (at one rank: both on rank 0, the first one named)."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as coll
from collectives._comm import engine_of
from support.comms import communicator, settings

N = 12


@pytest.fixture(scope="module")
def checked(comm):
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend (communicators made with the setting)")
    with communicator(COLLECTIVES_CHECK_NAN=1) as c:
        yield c


@pytest.fixture(scope="module")
def plain(comm):
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend")
    with communicator() as c:
        yield c


def poisoned(c, case: str, dtype=np.float32) -> tuple[np.ndarray, dict]:
    """This rank's input (N elements, rank-dependent finite values) and what every rank must be told:
    ``{rank: (where, index, value)}``. ``case``: "nan" (the last rank, index 5), "inf" (rank 0: -inf at
    index 2) or "both" (at one rank: the -inf at index 2 comes first)."""
    x = (np.arange(N) + 10 * c.rank).astype(dtype)
    expected: dict = {}
    if case in ("inf", "both"):
        expected[0] = ("", 2, "-inf")
    if case in ("nan", "both"):
        expected.setdefault(c.size - 1, ("", 5, "nan"))
    if c.rank == c.size - 1 and case in ("nan", "both"):
        x[5] = np.nan
    if c.rank == 0 and case in ("inf", "both"):
        x[2] = -np.inf
    return x, expected


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def as_lib(x, lib: str):
    if lib == "numpy":
        return x
    torch = pytest.importorskip("torch")
    return torch.from_numpy(x.copy())


def to_numpy(x):
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


CALLS = {
    "allreduce": lambda c, x: c.allreduce(x),
    "allreduce mean": lambda c, x: c.allreduce(x, "mean"),
    "allreduce max": lambda c, x: c.allreduce(x, "max"),
    "allreduce async": lambda c, x: c.allreduce(x, async_op=True).wait(),
    "reduce": lambda c, x: c.reduce(x, root=c.size - 1),
    "reduce_scatter": lambda c, x: c.reduce_scatter(x.reshape(c.size, -1) if hasattr(x, "reshape") else x),
    "reduce_scatter async": lambda c, x: c.reduce_scatter(x.reshape(c.size, -1), async_op=True).wait(),
}


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("case", ["nan", "inf", "both"])
@pytest.mark.parametrize("call", list(CALLS))
def test_every_rank_raises_naming_the_ranks(checked, call, case, lib):
    c = checked
    base, expected = poisoned(c, case)
    if call.startswith("reduce_scatter"):
        base = np.concatenate([base] * c.size)  # divisible by the size; the bad elements stay where they were
    x = as_lib(base.copy(), lib)

    def finite():  # a finite call of the same kind: it works (before, and after the refusals: usable)
        y = as_lib(np.ones(base.size, np.float32), lib)
        out = CALLS[call](c, y)
        if call in ("allreduce", "allreduce async", "reduce_scatter", "reduce_scatter async"):
            assert np.all(to_numpy(out) == c.size)

    finite()  # (the blocking allreduce and reduce_scatter now have a hot path: the check is in its cached call)
    for _ in range(2):
        with pytest.raises(coll.NonFiniteError) as info:
            CALLS[call](c, x)
        err = info.value
        assert err.found == expected, (err.found, expected)
        assert err.collective == call.split()[0]
        for r, (_, index, value) in expected.items():
            assert f"rank {r} ({value} at index {index})" in str(err), str(err)
        assert same_bits(to_numpy(x), base), "the input changed"
    if call == "allreduce" or (call == "reduce_scatter" and lib == "numpy"):  # (torch's has none)
        # the refused calls took the hot path (what the record shows: a private, the only place it is seen)
        last = engine_of(c).trace_entries()[-1]
        assert last["path"] == "hot path" and last["state"] == "failed", last
        assert last["error"].startswith("NonFiniteError"), last
    finite()


@pytest.mark.parametrize("dtype", ["float16", "float64", "complex64", "bfloat16"])
def test_other_float_dtypes(checked, dtype):
    c = checked
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch")
        x = torch.arange(N, dtype=torch.bfloat16) + c.rank
        if c.rank == c.size - 1:
            x[7] = float("inf")
        expected = {c.size - 1: ("", 7, "inf")}
    else:
        x = (np.arange(N) + c.rank).astype(dtype)
        if c.rank == c.size - 1:
            x[7] = complex(1, np.nan) if dtype.startswith("complex") else np.nan
        expected = {c.size - 1: ("", 7, "nan")}
    with pytest.raises(coll.NonFiniteError) as info:
        c.allreduce(x)
    assert info.value.found == expected


def test_integers_are_not_checked_and_an_overflowing_sum_is_finite(checked):
    c = checked
    ints = np.full(4, 7, np.int32)
    c.allreduce(ints)
    assert np.all(ints == 7 * c.size)
    big = np.full(8, np.finfo(np.float32).max / 2, np.float32)  # the scan's sum overflows; every value finite
    c.allreduce(big, "max")
    assert np.all(big == np.finfo(np.float32).max / 2)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "prod"])
def test_finite_inputs_give_the_same_bits_as_without_the_check(checked, plain, op, lib):
    rng = np.random.default_rng(1000 + checked.rank)
    base = rng.standard_normal(4 * 3 * checked.size).astype(np.float32)
    for call in ("allreduce", "allreduce async", "reduce_scatter"):
        if call == "reduce_scatter" and op == "prod":
            continue
        fn = {"allreduce": lambda c, x: c.allreduce(x, op),
              "allreduce async": lambda c, x: c.allreduce(x, op, async_op=True).wait(),
              "reduce_scatter": lambda c, x: c.reduce_scatter(x, op)}[call]
        outs = []
        for c in (checked, plain, checked):  # twice on the checked one: the general path both times
            outs.append(to_numpy(fn(c, as_lib(base.copy(), lib))).copy())
        assert same_bits(outs[0], outs[1]) and same_bits(outs[2], outs[1]), call
    tree = {"a": base.copy(), "b": [base[:5].astype(np.float64), np.float32(1.5)], "n": 3}
    on = coll.allreduce_tree({"a": tree["a"].copy(), "b": [tree["b"][0].copy(), tree["b"][1]], "n": 3}, op="sum",
                             comm=checked)
    off = coll.allreduce_tree({"a": tree["a"].copy(), "b": [tree["b"][0].copy(), tree["b"][1]], "n": 3}, op="sum",
                              comm=plain)
    assert same_bits(on["a"], off["a"]) and same_bits(on["b"][0], off["b"][0]) and on["b"][1] == off["b"][1]
    assert on["n"] == off["n"] == 3 * checked.size


@pytest.mark.parametrize("async_op", [False, True])
def test_allreduce_tree_names_the_leaf(checked, async_op):
    c = checked
    tree = {"a": np.ones(3), "b": [np.ones((2, 3), np.float32), np.float64(2.0)], "c": 4.0}
    if c.rank == c.size - 1:
        tree["b"][0][1, 1] = np.nan
    if c.rank == 0:
        tree["b"][1] = np.float64(np.inf)
    expected = {c.size - 1: ("leaf ['b'][0]", 4, "nan")}  # at one rank: the first leaf with one (in the tree's order)
    if c.size > 1:
        expected[0] = ("leaf ['b'][1]", 0, "inf")
    before = {"a": tree["a"].copy(), "b0": tree["b"][0].copy()}
    with pytest.raises(coll.NonFiniteError) as info:
        h = coll.allreduce_tree(tree, op="mean", comm=c, async_op=async_op)
        if async_op:
            h.wait()
    assert info.value.found == expected, info.value.found
    for r, (where, index, value) in expected.items():
        assert f"rank {r} ({value} at index {index} of {where})" in str(info.value), str(info.value)
    assert same_bits(tree["a"], before["a"]) and same_bits(tree["b"][0], before["b0"])
    out = coll.allreduce_tree({"a": np.ones(3)}, op="sum", comm=c)  # usable
    assert np.all(out["a"] == c.size)


@pytest.mark.parametrize("overlap", [True, False])
def test_distributed_optimizer_step_names_the_parameter(checked, overlap):
    torch = pytest.importorskip("torch")
    c = checked
    p = torch.nn.Parameter(torch.ones(8))
    q = torch.nn.Parameter(torch.ones(5))
    opt = coll.DistributedOptimizer(torch.optim.SGD([p, q], lr=1.0), comm=c, overlap=overlap)
    w = torch.arange(8, dtype=torch.float32)
    if c.rank == c.size - 1:
        w[3] = float("nan")
    ((p * w).sum() + q.sum()).backward()
    with pytest.raises(coll.NonFiniteError) as info:
        opt.step()
    found = info.value.found
    assert sorted(found) == [c.size - 1], found
    where, index, value = found[c.size - 1]
    assert (index, value) == (3, "nan") and "param_groups'][0][0]" in where, found
    assert torch.equal(p.detach(), torch.ones(8)) and torch.equal(q.detach(), torch.ones(5))  # no step taken
    # the next step with finite gradients averages as usual
    opt.zero_grad()
    ((p * torch.arange(8, dtype=torch.float32)).sum() + q.sum()).backward()
    opt.step()
    assert torch.equal(p.detach(), 1 - torch.arange(8, dtype=torch.float32))
    assert torch.equal(q.detach(), torch.zeros(5))


def test_the_torch_backend(comm):
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend")
    import collectives.torch_backend  # noqa: F401 - registers the backend

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("collectives")
    try:
        with settings(COLLECTIVES_CHECK_NAN=1):
            group = dist.new_group(list(range(comm.size)))
        t = torch.arange(N, dtype=torch.float32) + comm.rank
        if comm.rank == comm.size - 1:
            t[5] = float("nan")
        before = t.clone()
        with pytest.raises(coll.NonFiniteError) as info:
            dist.all_reduce(t, group=group)
        assert info.value.found == {comm.size - 1: ("", 5, "nan")}
        assert torch.equal(t.isnan(), before.isnan()) and torch.equal(t.nan_to_num(), before.nan_to_num())
        inp = torch.cat([t] * comm.size)
        out = torch.empty(N)
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        with pytest.raises(coll.NonFiniteError) as info:
            scatter(out, inp, group=group)
        assert info.value.found == {comm.size - 1: ("", 5, "nan")}
        ok = torch.ones(4)
        dist.all_reduce(ok, group=group)  # usable
        assert torch.equal(ok, torch.full((4,), float(comm.size)))
        dist.destroy_process_group(group)
    finally:
        if made:
            dist.destroy_process_group()

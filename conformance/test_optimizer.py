"""``DistributedOptimizer`` (its docstring in collectives is the contract), in both shapes:

- torch-like (``param_groups`` and ``step``): ``step`` averages every ``p.grad`` over the ranks, then runs
  the inner step; with ``backward_passes_per_step=k`` the first k-1 steps (and the ``zero_grad`` after
  them) do nothing, so the k-th applies the sum over micro-batches of the rank-mean;
- optax-like (``init``/``update``): ``update`` averages ``grads`` over the ranks, then calls the inner
  ``update``; with k, the first k-1 return zero updates and the k-th uses the mean of the k gradients.

Skipped, with the reason, when the system under test has no ``DistributedOptimizer``.
"""

from __future__ import annotations

import numpy as np
import pytest

from . import _dtypes, _libs, _matrix

TORCHES = ("torch", "torch-cuda")


def _need(sut):
    if not callable(getattr(sut, "DistributedOptimizer", None)):
        pytest.skip("the system under test does not expose DistributedOptimizer")


def _cases(shape):
    cases = []
    for name in _matrix.usable_libs():
        if shape == "torch-like" and name not in TORCHES:
            continue
        if shape == "optax" and name != "jax":  # optax itself: its transformations take JAX arrays
            continue
        for k in (1, 2):
            for op in ("mean", "sum"):
                cases.append(pytest.param(name, k, op, id=f"{name}-k{k}-{op}", marks=_matrix.meta(
                    collective="DistributedOptimizer", lib=name, op=op, aspect=shape)))
    return cases


def _batch(torch, rank, micro, device):
    g = torch.Generator().manual_seed(1000 * rank + micro)
    return (torch.randint(-4, 5, (4, 3), generator=g).float() / 4).to(device)


@pytest.mark.parametrize("lib_name,k,op", _cases("torch-like"))
def test_torch_like(sut, comm, rec, lib_name, k, op):
    _need(sut)
    torch = pytest.importorskip("torch")
    device = _libs.get(lib_name)._device()
    lr = 0.5

    def model0():
        torch.manual_seed(0)  # the same start on every rank
        return torch.nn.Linear(3, 2).to(device)

    def grads(rank, micro):
        m = model0()
        m(_batch(torch, rank, micro, device)).pow(2).sum().backward()
        return [p.grad.detach().cpu().numpy().astype(np.float64) for p in m.parameters()]

    model = model0()
    start = [p.detach().cpu().numpy().copy() for p in model.parameters()]
    opt = sut.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), op=op, backward_passes_per_step=k)
    assert opt.param_groups[0]["lr"] == lr, "everything not overridden is the inner optimizer's"
    for micro in range(k):
        model(_batch(torch, comm.rank, micro, device)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        if micro < k - 1:
            now = [p.detach().cpu().numpy() for p in model.parameters()]
            assert all(np.array_equal(a, b) for a, b in zip(now, start)), (
                f"step {micro + 1} of {k}: the parameters changed while accumulating")
    per_rank = [[sum(gm) for gm in zip(*[grads(r, m) for m in range(k)])] for r in range(comm.size)]
    combined = [sum(g) / (comm.size if op == "mean" else 1) for g in zip(*per_rank)]
    for i, (p, p0, g) in enumerate(zip(model.parameters(), start, combined)):
        want = p0 - lr * g
        got = p.detach().cpu().numpy()
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), f"parameter {i}: got {got}, expected {want}"
    rec.same_on_every_rank("parameters", b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters()))


class _SGDLike:
    """An optax-like optimizer: pure init and update; updates = -lr * grads; counts its updates."""

    lr = 0.5

    @staticmethod
    def init(params):
        return {"count": 0}

    @staticmethod
    def update(grads, state, params=None):
        return {key: -_SGDLike.lr * g for key, g in grads.items()}, {"count": state["count"] + 1}


@pytest.mark.parametrize("lib_name,k,op", _cases("optax-like"))
def test_optax_like(sut, comm, rec, lib_name, k, op):
    _need(sut)
    lib = _libs.get(lib_name)
    spec = _dtypes.ALL["float64"]

    def grad(rank, micro):
        return _dtypes.exact_values(spec, (5,), "sum", _dtypes.seed_of("optax", rank, micro))

    opt = sut.DistributedOptimizer(_SGDLike(), op=op, backward_passes_per_step=k)
    params = {"w": lib.from_bits(np.zeros(5), spec)}
    state = opt.init(params)
    for micro in range(k):
        grads = {"w": lib.from_bits(grad(comm.rank, micro), spec)}
        updates, state = opt.update(grads, state, params)
        if micro < k - 1:
            assert np.array_equal(_libs.host_copy(updates["w"]), np.zeros(5)), "while accumulating, updates are zero"
    mean_over_micro = [sum(grad(r, m) for m in range(k)) / k for r in range(comm.size)]
    combined = sum(mean_over_micro) / (comm.size if op == "mean" else 1)
    want = -_SGDLike.lr * combined
    got = _libs.host_copy(updates["w"])
    assert np.allclose(got, want, rtol=1e-12, atol=0), f"updates {got}, expected {want}"
    inner = getattr(state, "inner_state", None)
    if inner is not None:
        assert inner == {"count": 1}, f"the inner update runs once per {k} calls; inner state {inner}"
    rec.same_on_every_rank("updates", np.ascontiguousarray(got).tobytes())


@pytest.mark.parametrize("lib_name,k,op", _cases("optax"))
def test_optax_itself(sut, comm, rec, lib_name, k, op):
    """optax's own ``sgd`` (a GradientTransformation holding NamedTuple states) with JAX arrays: the k-th
    update is ``-lr`` times the combined mean over the k micro-batches, as for the optax-like fake."""
    _need(sut)
    optax = pytest.importorskip("optax")
    lib = _libs.get(lib_name)
    spec = _dtypes.ALL["float64"]
    lr = 0.5  # a power of two: the updates are exact

    def grad(rank, micro):
        return _dtypes.exact_values(spec, (5,), "sum", _dtypes.seed_of("optax", rank, micro))

    opt = sut.DistributedOptimizer(optax.sgd(lr, momentum=None), op=op, backward_passes_per_step=k)
    params = {"w": lib.from_bits(np.zeros(5), spec)}
    state = opt.init(params)
    for micro in range(k):
        updates, state = opt.update({"w": lib.from_bits(grad(comm.rank, micro), spec)}, state, params)
        assert lib.is_native(updates["w"], params["w"]), f"updates are {type(updates['w']).__name__}"
        if micro < k - 1:
            assert np.array_equal(_libs.host_copy(updates["w"]), np.zeros(5)), "while accumulating, updates are zero"
    combined = sum(sum(grad(r, m) for m in range(k)) / k for r in range(comm.size)) / (comm.size if op == "mean" else 1)
    got = _libs.host_copy(updates["w"])
    assert np.allclose(got, -lr * combined, rtol=1e-12, atol=0), f"updates {got}, expected {-lr * combined}"
    rec.same_on_every_rank("updates", np.ascontiguousarray(got).tobytes())


@pytest.mark.parametrize("x", [pytest.param(v, id=i, marks=_matrix.meta(collective="DistributedOptimizer",
                                                                         aspect="argument errors"))
                               for i, v in (("object", object()), ("dict", {"lr": 1}), ("none", None))])
def test_not_an_optimizer(sut, comm, x):
    _need(sut)
    with pytest.raises(TypeError):
        sut.DistributedOptimizer(x)


@pytest.mark.parametrize("k", [pytest.param(v, id=str(v), marks=_matrix.meta(collective="DistributedOptimizer",
                                                                              aspect="argument errors"))
                               for v in (0, -1, 1.5)])
def test_bad_backward_passes_per_step(sut, comm, k):
    _need(sut)
    with pytest.raises((ValueError, TypeError)):
        sut.DistributedOptimizer(_SGDLike(), backward_passes_per_step=k)


@pytest.mark.parametrize("shape", [pytest.param(s, marks=_matrix.meta(collective="DistributedOptimizer", aspect=s))
                                   for s in ("optax-like", "torch-like")])
def test_already_distributed(sut, comm, shape):
    _need(sut)
    if shape == "torch-like":
        torch = pytest.importorskip("torch")
        inner = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    else:
        inner = _SGDLike()
    once = sut.DistributedOptimizer(inner)
    with pytest.raises(ValueError):
        sut.DistributedOptimizer(once)

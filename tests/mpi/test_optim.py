"""DistributedOptimizer at any world size: torch wrapper, optax-like functions, accumulation."""

import numpy as np
import pytest

import collectives as coll

needs_two = pytest.mark.skipif("coll.world().size < 2", reason="a mismatch needs two ranks")


def rank_mean(comm, fn):
    """The mean over ranks of fn(rank), computed locally."""
    return sum(fn(r) for r in range(comm.size)) / comm.size


# ---------------------------------------------------------------------------------------------------------
# torch


def _params():
    import torch

    return [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2)),
            torch.nn.Parameter(torch.zeros(1))]


def test_torch_step_averages_gradients(comm):
    import torch

    params = _params()
    opt = coll.DistributedOptimizer(torch.optim.SGD(params, lr=1.0), comm=comm)
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(comm.rank + i))
    assert opt.step() is None
    for i, p in enumerate(params):
        np.testing.assert_allclose(p.detach().numpy(), -rank_mean(comm, lambda r, i=i: r + i))
        np.testing.assert_allclose(p.grad.numpy(), rank_mean(comm, lambda r, i=i: r + i))


def test_torch_wrapper_delegates(comm):
    import torch

    params = _params()
    inner = torch.optim.Adam(params, lr=0.01)
    opt = coll.DistributedOptimizer(inner, comm=comm)
    assert not isinstance(opt, torch.optim.Optimizer) and opt.inner is inner
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    assert "DistributedOptimizer(Adam" in repr(opt)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2]
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    opt.zero_grad(set_to_none=False)
    opt.param_groups[0]["lr"] = 0.5
    assert inner.param_groups[0]["lr"] == 0.5
    fresh = torch.optim.Adam(_params(), lr=0.01)
    coll.DistributedOptimizer(fresh, comm=comm).load_state_dict(sd)
    assert float(fresh.state_dict()["state"][0]["step"]) == 1
    # LR schedulers take the inner optimizer and see the same param_groups
    sched = torch.optim.lr_scheduler.StepLR(opt.inner, step_size=1, gamma=0.5)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)


def test_torch_none_gradients_agreed(comm):
    import torch

    params = _params()
    opt = coll.DistributedOptimizer(torch.optim.SGD(params, lr=1.0), comm=comm)
    params[1].grad = torch.full_like(params[1], float(comm.rank))  # others: None on every rank
    opt.step()
    assert params[0].grad is None and params[2].grad is None
    np.testing.assert_allclose(params[1].detach().numpy(), -(comm.size - 1) / 2)


@needs_two
def test_torch_none_gradient_on_one_rank_is_a_mismatch(comm):
    import torch

    params = _params()
    opt = coll.DistributedOptimizer(torch.optim.SGD(params, lr=1.0), comm=comm)
    for p in params:
        p.grad = torch.ones_like(p)
    if comm.rank == 1:
        params[2].grad = None
    with pytest.raises(coll.MismatchError, match=r"\['param_groups'\]\[0\]\[2\]: ranks? 0[,0-9]* ha(?:s|ve) float32 \(1,\), "
                                                 r"ranks? [0-9,]*1[0-9,]* ha(?:s|ve) None"):
        opt.step()
    assert all((p == 0).all() for p in params), "no update happened"
    assert coll.allreduce(np.ones(1), comm=comm).tolist() == [comm.size]


def test_torch_param_groups_order_and_dtypes(comm):
    import torch

    a = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    b = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    c = torch.nn.Parameter(torch.zeros(2))
    opt = coll.DistributedOptimizer(torch.optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 2.0}], lr=1.0),
                                    comm=comm, bucket_bytes=64)
    for i, p in enumerate((a, b, c)):
        p.grad = torch.full_like(p, float(comm.rank + i))
    opt.step()
    want = [rank_mean(comm, lambda r, i=i: r + i) for i in range(3)]
    np.testing.assert_allclose(a.detach().numpy(), -want[0])
    np.testing.assert_allclose(b.detach().float().numpy(), -want[1], rtol=1e-2)
    np.testing.assert_allclose(c.detach().numpy(), -2.0 * want[2])


def test_torch_op_sum_and_average_gradients_once(comm):
    import torch

    p = torch.nn.Parameter(torch.zeros(2))
    opt = coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), op="sum", comm=comm)
    p.grad = torch.ones(2)
    opt.average_gradients()  # e.g. before clipping
    assert p.grad.tolist() == [comm.size] * 2
    opt.step()  # must not reduce again
    assert p.grad.tolist() == [comm.size] * 2 and p.detach().tolist() == [-comm.size] * 2
    p.grad = torch.ones(2)
    opt.step()  # the next step reduces again
    assert p.grad.tolist() == [comm.size] * 2


def test_torch_closure(comm):
    import torch

    p = torch.nn.Parameter(torch.zeros(1))
    opt = coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), comm=comm)

    def closure():
        opt.zero_grad()
        loss = (p * float(comm.rank)).sum()  # d loss / d p = rank
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert float(loss.detach()) == 0.0
    assert float(p.detach()) == pytest.approx(-(comm.size - 1) / 2)
    acc = coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), backward_passes_per_step=2, comm=comm)
    with pytest.raises(ValueError, match="closure"):
        acc.step(closure)


def test_torch_accumulation_every_k_steps(comm):
    import torch

    k = 3
    p = torch.nn.Parameter(torch.zeros(2))
    opt = coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), backward_passes_per_step=k, comm=comm)
    history = []
    for it in range(2 * k):
        opt.zero_grad()  # skipped while accumulating
        (p * float(comm.rank + it)).sum().backward()
        opt.step()
        history.append(p.detach().clone())
        assert opt.accumulating == ((it + 1) % k != 0)
    # nothing changes until the k-th step; then the rank-mean of the sum of k gradients is applied
    first = sum(rank_mean(comm, lambda r, it=it: r + it) for it in range(k))
    second = sum(rank_mean(comm, lambda r, it=it: r + it) for it in range(k, 2 * k))
    for it in range(k - 1):
        assert history[it].tolist() == [0.0, 0.0]
    assert history[k - 1].tolist() == pytest.approx([-first] * 2)
    assert history[2 * k - 2].tolist() == pytest.approx([-first] * 2)
    assert history[2 * k - 1].tolist() == pytest.approx([-first - second] * 2)


def test_synchronize_a_distributed_optimizer(comm):
    import torch

    p = torch.nn.Parameter(torch.zeros(2))
    opt = coll.DistributedOptimizer(torch.optim.SGD([p], lr=0.1 * (comm.rank + 1), momentum=0.5), comm=comm)
    p.grad = torch.ones(2)
    opt.inner.step()  # local state, different lr per rank
    assert coll.synchronize(opt, comm=comm) is opt
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_wrong_arguments():
    import torch

    p = torch.nn.Parameter(torch.zeros(1))
    sgd = torch.optim.SGD([p], lr=1.0)
    with pytest.raises(TypeError, match="torch-like optimizer"):
        coll.DistributedOptimizer(object())
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        coll.DistributedOptimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(TypeError, match="backward_passes_per_step"):
        coll.DistributedOptimizer(sgd, backward_passes_per_step=1.5)
    with pytest.raises(ValueError, match="unknown op"):
        coll.DistributedOptimizer(sgd, op="avg")
    with pytest.raises(ValueError, match="already"):
        coll.DistributedOptimizer(coll.DistributedOptimizer(sgd))


# ---------------------------------------------------------------------------------------------------------
# optax-like: pure init/update functions


class Adam:
    """A hand-written optax-like Adam on trees of NumPy arrays (dicts here)."""

    def __init__(self, lr=0.1, b1=0.9, b2=0.999, eps=1e-8):
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps

    def init(self, params):
        zeros = {k: np.zeros_like(v) for k, v in params.items()}
        return {"count": 0, "mu": zeros, "nu": {k: np.zeros_like(v) for k, v in params.items()}}

    def update(self, grads, state, params=None):
        count = state["count"] + 1
        mu = {k: self.b1 * state["mu"][k] + (1 - self.b1) * g for k, g in grads.items()}
        nu = {k: self.b2 * state["nu"][k] + (1 - self.b2) * g * g for k, g in grads.items()}
        updates = {k: -self.lr * (mu[k] / (1 - self.b1 ** count))
                   / (np.sqrt(nu[k] / (1 - self.b2 ** count)) + self.eps) for k in grads}
        return updates, {"count": count, "mu": mu, "nu": nu}


def test_optax_like_update_averages(comm):
    inner = Adam()
    opt = coll.DistributedOptimizer(inner, comm=comm)
    params = {"w": np.zeros(3), "b": np.zeros(1)}
    state = opt.init(params)
    ref_state = inner.init(params)
    for step in range(3):
        grads = {"w": np.arange(3.0) + comm.rank + step, "b": np.array([comm.rank - 1.0])}
        updates, state = opt.update(grads, state, params)
        mean = {"w": np.arange(3.0) + (comm.size - 1) / 2 + step, "b": np.array([(comm.size - 1) / 2 - 1.0])}
        ref, ref_state = inner.update(mean, ref_state, params)
        for k in params:
            np.testing.assert_allclose(updates[k], ref[k], rtol=1e-12)
    assert isinstance(state, coll._optim.DistributedState) and state.grad_acc is None


def test_optax_like_accumulation(comm):
    inner = Adam()
    k = 2
    opt = coll.DistributedOptimizer(inner, backward_passes_per_step=k, comm=comm)
    params = {"w": np.zeros(2)}
    state = opt.init(params)
    ref_state = inner.init(params)
    for step in range(2 * k):
        grads = {"w": np.full(2, float(comm.rank * 10 + step))}
        updates, state = opt.update(grads, state, params)
        if (step + 1) % k:
            assert updates["w"].tolist() == [0.0, 0.0] and state.mini_step == (step + 1) % k
        else:
            micro = [rank_mean(comm, lambda r, s=s: r * 10.0 + s) for s in range(step + 1 - k, step + 1)]
            ref, ref_state = inner.update({"w": np.full(2, sum(micro) / k)}, ref_state, params)
            np.testing.assert_allclose(updates["w"], ref["w"], rtol=1e-12)
            assert state.mini_step == 0 and state.grad_acc["w"].tolist() == [0.0, 0.0]


def test_optax_like_immutable_grads(comm):
    import array_api_strict as xs

    class SGD:
        init = staticmethod(lambda params: ())
        update = staticmethod(lambda grads, state, params=None: ({k: -g for k, g in grads.items()}, state))

    opt = coll.DistributedOptimizer(SGD(), comm=comm)
    g = xs.asarray(np.full(2, float(comm.rank)))
    updates, _ = opt.update({"w": g}, opt.init({"w": g}))
    assert type(updates["w"]) is type(g)
    np.testing.assert_allclose(np.from_dlpack(updates["w"]), -(comm.size - 1) / 2)
    assert np.from_dlpack(g).tolist() == [float(comm.rank)] * 2, "the caller's immutable grads are untouched"

"""DistributedOptimizer's gradient buckets at any world size: overlap, views, missing gradients, sharded
state, and the equivalence of every way of running it (bit for bit, 20 steps)."""

import gc
import time

import numpy as np
import pytest

import collectives as coll

torch = pytest.importorskip("torch")

needs_two = pytest.mark.skipif("coll.world().size < 2", reason="needs two ranks")
STEPS = 20


class Tied(torch.nn.Module):
    """Tied weights (embedding and output), a buffer, and a parameter no backward pass reaches."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(12, 6)
        self.hidden = torch.nn.Linear(6, 6)
        self.norm = torch.nn.BatchNorm1d(6)  # running_mean/var: buffers (local, not reduced)
        self.unused = torch.nn.Linear(6, 3)  # never called: no gradient on any rank
        self.out = torch.nn.Linear(6, 12, bias=False)
        self.out.weight = self.embed.weight  # tied

    def forward(self, tokens):
        h = torch.relu(self.norm(self.hidden(self.embed(tokens))))
        return self.out(h)


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def batch(kind, comm, step, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * comm.rank + micro)
    if kind == "mlp":
        return torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
    return torch.randint(0, 12, (8,), generator=g), torch.randint(0, 12, (8,), generator=g)


def train(comm, kind, opt_name, *, k=1, steps=STEPS, **options):
    torch.manual_seed(0)
    model = mlp() if kind == "mlp" else Tied()
    if opt_name == "adam":
        inner = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
    opt = coll.DistributedOptimizer(inner, backward_passes_per_step=k, comm=comm, bucket_bytes=512, **options)
    for step in range(steps):
        for micro in range(k):
            opt.zero_grad()
            x, y = batch(kind, comm, step, micro)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model, opt


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def _sums_in_one_order() -> bool:
    """Whether this MPI's blocking and non-blocking allreduce (and reduce_scatter) add the ranks' floats in
    one order: MPICH does; Open MPI's non-blocking collectives (libnbc) add 3+ ranks in another order than
    its blocking ones, so overlap on and off can differ in the last bits there (docs/semantics.md)."""
    from mpi4py import MPI

    return "MPICH" in MPI.Get_library_version()


TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-9, 1e-11), torch.bfloat16: (2e-2, 1e-3)}


def assert_same_params(comm, a, b, msg: str) -> None:
    """Bit for bit where the MPI adds in one order (MPICH; any MPI at 1 or 2 ranks, where a sum has one
    order); else (Open MPI at 3+ ranks) within a few roundings of the parameters' dtype."""
    if comm.size <= 2 or _sums_in_one_order():
        assert torch.equal(a, b), msg
    else:  # the MPI's blocking and non-blocking sums of 3+ ranks add in different orders (semantics.md)
        rtol, atol = TOLERANCE[a.dtype]
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=msg)


CONFIGS = [dict(overlap=False), dict(overlap=True), dict(overlap=True, grad_views=False),
           dict(overlap=True, shard_state=True), dict(overlap=False, shard_state=True),
           dict(overlap=True, grad_views=False, shard_state=True)]


@pytest.mark.parametrize("kind", ["mlp", "tied"])
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
@pytest.mark.parametrize("k", [1, 2])
def test_every_way_gives_the_same_bits(comm, kind, opt_name, k):
    """Overlap on and off, views or copies, sharded state or not: bit-identical parameters after 20 steps,
    and the same on every rank."""
    results = []
    for options in CONFIGS:
        model, _ = train(comm, kind, opt_name, k=k, **options)
        results.append(params_of(model))
    ref = results[0]
    for options, got in zip(CONFIGS[1:], results[1:]):
        for i, (a, b) in enumerate(zip(ref, got)):
            assert_same_params(comm, a, b, f"{options}: parameter {i} differs from overlap=False")
    flat = torch.cat([p.reshape(-1) for p in ref]).numpy()
    every = coll.allgather(flat, comm=comm)
    assert (every == every[0]).all(), "parameters differ between ranks"
    if kind == "tied":
        torch.manual_seed(0)
        untouched = Tied().unused.weight.detach()
        model, _ = train(comm, kind, opt_name, k=k, steps=1, overlap=True, shard_state=True)
        assert torch.equal(model.unused.weight.detach(), untouched) and model.unused.weight.grad is None


def test_the_mean_is_the_full_batch_gradient(comm):
    """Not only equal to each other: right (against one process on the whole batch, SGD without
    momentum, float64)."""
    torch.manual_seed(0)
    model = mlp().double()
    ref = mlp().double()
    ref.load_state_dict(model.state_dict())
    opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, bucket_bytes=1024)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        xs, ys = zip(*(batch("mlp", type("C", (), {"rank": r})(), step, 0) for r in range(comm.size)))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs[comm.rank].double()), ys[comm.rank]).backward()
        opt.step()
        ref_opt.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(ref(x.double()), y) for x, y in zip(xs, ys)) / comm.size
        loss.backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_buckets_reverse_order_and_bound(comm):
    torch.manual_seed(0)
    model = mlp()
    opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, bucket_bytes=4096)
    buckets = opt._engine.buckets
    params = list(model.parameters())
    order = [s.param for b in buckets for s in b.slots]
    assert [id(p) for p in order] == [id(p) for p in reversed(params)]
    for b in buckets:
        assert len(b.slots) == 1 or b.numel * 4 <= 4096


def test_bucket_leaves_during_backward_and_grads_are_views(comm):
    torch.manual_seed(0)
    model = mlp()
    opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, bucket_bytes=4096)
    engine = opt._engine
    x, y = batch("mlp", comm, 0, 0)
    left = []
    real_leave = engine._leave
    engine._leave = lambda b: (left.append(b), real_leave(b))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    engine._leave = real_leave
    assert left == engine.buckets, "every bucket left during backward, in order"
    assert engine.finished, "and backward() returned with every gradient averaged (as DDP)"
    local = [p.grad.clone() for p in model.parameters()]
    every = coll.allgather(torch.cat([g.reshape(-1) for g in local]), comm=comm)
    assert all(torch.equal(every[0], every[r]) for r in range(comm.size)), ".grad is the average after backward"
    opt.step()
    shared = [s for s in engine.slots if not s.bucket.solo]
    solo = [s for s in engine.slots if s.bucket.solo]
    assert shared and solo, "the test wants both kinds"
    for s in shared:
        assert s.param.grad is s.view
        assert s.param.grad.untyped_storage().data_ptr() == s.bucket.flat.untyped_storage().data_ptr()
    for s in solo:  # reduced in its own .grad: no buffer at all
        assert s.bucket.flat is None and s.view is None
    grads = {id(s): s.param.grad for s in solo}
    before = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad(set_to_none=False)  # views kept, zeroed
    assert all(s.param.grad is s.view and not s.view.any() for s in shared)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert all(s.param.grad is s.view for s in shared)
    assert all(s.param.grad is grads[id(s)] for s in solo), "accumulated and reduced in place"
    assert not all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters())), "a new step"


def test_a_replaced_grad_is_detected_and_copied(comm):
    p = torch.nn.Parameter(torch.zeros(3))
    other = torch.nn.Parameter(torch.zeros(2))  # in the same bucket: p.grad becomes a view of it
    opt = coll.DistributedOptimizer(torch.optim.SGD([p, other], lr=1.0), comm=comm)
    (p * float(comm.rank)).sum().backward()
    other.grad = torch.zeros(2)
    opt.step()
    view = next(s.view for s in opt._engine.slots if s.param is p)
    assert p.grad is view
    opt.zero_grad(set_to_none=False)
    mine = torch.full((3,), float(comm.rank + 1))
    p.grad = mine  # the user's own tensor, not the bucket's view
    opt.step()
    want = (comm.size + 1) / 2
    assert p.grad is view and p.grad.tolist() == [want] * 3
    assert mine.tolist() == [float(comm.rank + 1)] * 3, "the user's tensor is left alone"


def test_grad_views_false_keeps_the_users_tensors(comm):
    p = torch.nn.Parameter(torch.zeros(3))
    opt = coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), comm=comm, grad_views=False)
    (p * float(comm.rank)).sum().backward()
    g = p.grad
    opt.step()
    assert p.grad is g and g.tolist() == [(comm.size - 1) / 2] * 3


@pytest.mark.parametrize("shard_state", [False, True])
def test_second_backward_before_step_reduces_again(comm, shard_state):
    """A second backward pass after the round completed (before step()) is reduced anew, as DDP reduces
    every backward pass: the gradient is the sum of both passes' averages (after average_gradients()
    too)."""
    p = torch.nn.Parameter(torch.zeros(3))
    q = torch.nn.Parameter(torch.zeros(2))
    opt = coll.DistributedOptimizer(torch.optim.SGD([p, q], lr=1.0), comm=comm, shard_state=shard_state)
    mean = (comm.size - 1) / 2
    for average in (False, True):
        opt.zero_grad()
        ((p + q.sum()) * float(comm.rank)).sum().backward()
        if average:
            opt.average_gradients()
        ((p + q.sum()) * float(comm.rank + 1)).sum().backward()
        before = p.detach().clone()
        opt.step()
        assert (before - p.detach()).tolist() == [2 * mean + 1] * 3
    assert coll.allreduce(np.ones(1), comm=comm).tolist() == [comm.size]


def test_accumulation_communicates_on_the_last_pass_only(comm):
    k = 3
    p = torch.nn.Parameter(torch.zeros(2))
    opt = coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), backward_passes_per_step=k, comm=comm)
    for it in range(k):
        opt.zero_grad()
        (p * float(comm.rank + it)).sum().backward()
        left = opt._engine.next
        assert left == (1 if it == k - 1 else 0), "buckets leave in the k-th pass only"
        opt.step()
    want = sum((comm.size - 1) / 2 + it for it in range(k))
    assert p.detach().tolist() == pytest.approx([-want] * 2)


@needs_two
def test_missing_grad_on_some_ranks_is_a_mismatch_by_default(comm):
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = coll.DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0), comm=comm)
    loss = a.sum() + (b.sum() if comm.rank != 1 else 0)
    loss.backward()
    with pytest.raises(coll.MismatchError, match=r"\['param_groups'\]\[0\]\[1\]: ranks? [0-9,]+ ha(s|ve) "
                                                 r"float32 \(3,\), rank 1 has None.*missing_grads=\"zero\""):
        opt.step()
    assert a.detach().tolist() == [0.0, 0.0] and b.detach().tolist() == [0.0] * 3, "no update"
    coll.allreduce(np.ones(1), comm=comm)  # the communicator is fine
    opt.zero_grad()
    (a.sum() + b.sum()).backward()
    opt.step()
    assert a.detach().tolist() == [-1.0, -1.0]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("shard_state", [False, True])
def test_missing_grads_zero(comm, overlap, shard_state):
    """Horovod's test_force_allreduce: a branch only some ranks take; those without contribute zeros."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    c = torch.nn.Parameter(torch.zeros(1))  # no gradient anywhere: skipped
    opt = coll.DistributedOptimizer(torch.optim.SGD([a, b, c], lr=1.0), comm=comm, missing_grads="zero",
                                    overlap=overlap, shard_state=shard_state)
    for _ in range(2):
        opt.zero_grad()
        loss = a.sum() + (b.sum() * 2 if comm.rank % 2 == 0 else 0)
        loss.backward()
        if comm.rank % 2 == 0:
            coll.allreduce(np.ones(1), comm=comm)  # a user collective between backward and step
        else:
            coll.allreduce(np.ones(1), comm=comm)
        opt.step()
    takers = len(range(0, comm.size, 2))
    assert a.detach().tolist() == [-2.0, -2.0]
    assert b.detach().tolist() == pytest.approx([-2 * 2.0 * takers / comm.size] * 3)
    assert c.detach().tolist() == [0.0] and c.grad is None
    if not shard_state:
        assert b.grad is not None and b.grad.tolist() == pytest.approx([2.0 * takers / comm.size] * 3)


def test_closure_and_lr_scheduler(comm):
    for shard_state in (False, True):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), comm=comm, shard_state=shard_state)
        sched = torch.optim.lr_scheduler.StepLR(opt.inner, step_size=1, gamma=0.5)

        def closure(opt=opt, p=p):
            opt.zero_grad()
            loss = (p * float(comm.rank)).sum()
            loss.backward()
            return loss

        assert float(opt.step(closure).detach()) == 0.0
        assert float(p.detach()) == pytest.approx(-(comm.size - 1) / 2)
        sched.step()
        opt.step(closure)  # lr 0.5 now (the sharded optimizer takes it from inner)
        assert float(p.detach()) == pytest.approx(-1.5 * (comm.size - 1) / 2)


def test_lbfgs_closure_called_many_times(comm):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(3))
    target = torch.tensor([1.0, 2.0, 3.0]) + comm.rank
    opt = coll.DistributedOptimizer(torch.optim.LBFGS([w], lr=1.0, max_iter=5), comm=comm)

    def closure():
        opt.inner.zero_grad()  # not through the wrapper: the wrapper opens a new round per call itself
        loss = ((w - target) ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    want = torch.tensor([1.0, 2.0, 3.0]) + (comm.size - 1) / 2
    torch.testing.assert_close(w.detach(), want, rtol=1e-4, atol=1e-4)


def test_hooks_leave_with_the_wrapper(comm):
    torch.manual_seed(0)
    model = mlp()
    params = list(model.parameters())
    inner = torch.optim.SGD(params, lr=0.1)
    gc.collect()
    for _ in range(1000):
        opt = coll.DistributedOptimizer(inner, comm=comm)
        del opt
    gc.collect()
    assert all(not p._post_accumulate_grad_hooks for p in params), "hooks left behind"
    from collectives._overlap import Buckets

    assert not [o for o in gc.get_objects() if type(o) is Buckets], "bucket engines left behind"
    opt = coll.DistributedOptimizer(inner, comm=comm)
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in params)
    opt.close()
    assert all(not p._post_accumulate_grad_hooks for p in params)
    x, y = batch("mlp", comm, 0, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()  # no hook fires: nothing is sent


def test_sharded_state_memory(comm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 96), torch.nn.Linear(96, 7))
    _, plain_opt = train_once(comm, model, shard_state=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 96), torch.nn.Linear(96, 7))
    _, sharded_opt = train_once(comm, model, shard_state=True)
    full = plain_opt.state_bytes()
    mine = sharded_opt.state_bytes()
    assert full > 0 and mine <= 1.05 * full / comm.size + 64 * 1024, (mine, full)
    assert not sharded_opt.inner.state, "the inner optimizer holds no state"
    every = coll.allgather(np.array([mine]), comm=comm)
    assert int(every.sum()) <= 1.05 * full + comm.size * 1024


def train_once(comm, model, **options):
    opt = coll.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), comm=comm, **options)
    x = torch.randn(4, 64)
    model(x).sum().backward()
    opt.step()
    return model, opt


def _same_state(a, b):
    assert sorted(a["state"]) == sorted(b["state"]) and a["param_groups"] == b["param_groups"]
    for i in a["state"]:
        for name, v in a["state"][i].items():
            assert torch.equal(v, b["state"][i][name]) if torch.is_tensor(v) else v == b["state"][i][name], (i, name)


@needs_two
def test_sharded_state_dict_on_rank_0_only_is_a_bounded_error_that_names_the_fix(comm, monkeypatch):
    """Horovod's checkpoint idiom, ``if rank == 0: opt.state_dict()``, with shard_state=True (a collective):
    with COLLECTIVES_TIMEOUT, rank 0 raises CollectiveTimeoutError saying to call it on every rank, before
    any transfer of the gather; the optimizer is intact: a call on every rank afterwards gives the state."""
    _, opt = train(comm, "tied", "adam", steps=2, shard_state=True)
    monkeypatch.setenv("COLLECTIVES_TIMEOUT", "1.5")
    monkeypatch.setenv("COLLECTIVES_STALL_WARN_S", "0")  # never: the deadline alone
    flag = np.zeros(1)
    if comm.rank == 0:
        t0 = time.monotonic()
        with pytest.raises(coll.CollectiveTimeoutError, match=r"state_dict\(\) with shard_state=True is collective: "
                           r"every rank must call it.*call `sd = opt.state_dict\(\)` on every rank"):
            opt.state_dict()
        assert 1.4 < time.monotonic() - t0 < 30
        for r in range(1, comm.size):  # now the others may come
            comm.send(flag, dst=r)
    else:
        comm.recv(flag, src=0)
    monkeypatch.delenv("COLLECTIVES_TIMEOUT")
    everyone = opt.state_dict()  # every rank: completes rank 0's meeting of the failed call, then gathers
    _same_state(everyone, opt.state_dict())
    assert len(everyone["state"]) > 0


@needs_two
def test_sharded_state_dict_waiting_for_the_others_warns_and_completes(comm, monkeypatch):
    """Without a deadline, a rank that waits in state_dict() longer than COLLECTIVES_STALL_WARN_S warns once,
    naming the fix, and completes when the others come."""
    _, opt = train(comm, "tied", "adam", steps=2, shard_state=True)
    monkeypatch.delenv("COLLECTIVES_TIMEOUT", raising=False)
    monkeypatch.setenv("COLLECTIVES_STALL_WARN_S", "0.3")
    if comm.rank == 0:
        with pytest.warns(RuntimeWarning, match="every rank must call it") as caught:
            sd = opt.state_dict()
        assert len([w for w in caught if "every rank must call it" in str(w.message)]) == 1
        assert caught[0].filename == __file__  # points at the caller's line
    else:
        time.sleep(4)  # rank 0 warns after 0.3 s
        sd = opt.state_dict()
    _same_state(sd, opt.state_dict())


def test_sharded_state_dict_round_trip(comm):
    """state_dict() of the sharded optimizer is the unsharded one's, bit for bit; load_state_dict of an
    unsharded state continues exactly as the unsharded optimizer does."""
    _, plain = train(comm, "tied", "adam", steps=3, overlap=True)
    _, sharded = train(comm, "tied", "adam", steps=3, shard_state=True)
    a, b = plain.state_dict(), sharded.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for i in a["state"]:
        assert list(a["state"][i]) == list(b["state"][i])
        for name, v in a["state"][i].items():
            assert torch.equal(v, b["state"][i][name]), (i, name)
    # a fresh sharded optimizer loads the unsharded state and steps as the unsharded one does
    torch.manual_seed(0)
    model = Tied()
    opt = coll.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3), comm=comm,
                                    shard_state=True, bucket_bytes=512)
    ref_model = Tied()
    ref = coll.DistributedOptimizer(torch.optim.Adam(ref_model.parameters(), lr=1e-2, weight_decay=1e-3),
                                    comm=comm, bucket_bytes=512)
    ref_model.load_state_dict(model.state_dict())
    ref.load_state_dict(a)
    opt.load_state_dict(a)
    assert not opt.inner.state
    for m, o in ((model, opt), (ref_model, ref)):
        o.zero_grad()
        x, y = batch("tied", comm, 7, 0)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        o.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_sharded_average_gradients_then_clip(comm):
    results = []
    for shard_state in (False, True):
        torch.manual_seed(0)
        model = mlp()
        opt = coll.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), comm=comm,
                                        shard_state=shard_state, bucket_bytes=1024)
        for step in range(3):
            opt.zero_grad()
            x, y = batch("mlp", comm, step, 0)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.average_gradients()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
            opt.step()
        results.append(params_of(model))
    for i, (a, b) in enumerate(zip(*results)):  # (the reduce-scatter is non-blocking, the buckets' allreduce
        assert_same_params(comm, a, b, f"parameter {i}")  # on one node blocking: Open MPI's orders differ)


def test_shard_state_refuses_what_it_cannot_shard(comm):
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="element-wise optimizer.*LBFGS"):
        coll.DistributedOptimizer(torch.optim.LBFGS([p]), shard_state=True, comm=comm)
    with pytest.raises(ValueError, match="missing_grads"):
        coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), missing_grads="skip", comm=comm)
    with pytest.raises(TypeError, match="overlap must be True or False"):
        coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), overlap=1, comm=comm)

    class OptaxLike:
        init = staticmethod(lambda params: ())
        update = staticmethod(lambda g, s, p=None: (g, s))

    with pytest.raises(ValueError, match="shard_state and missing_grads are for torch"):
        coll.DistributedOptimizer(OptaxLike(), shard_state=True, comm=comm)


def test_synchronize_with_buckets(comm):
    torch.manual_seed(comm.rank)
    model = mlp()
    opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm=comm)
    coll.synchronize(model, comm=comm)
    x, y = batch("mlp", comm, 0, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    coll.synchronize(opt, comm=comm)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    every = coll.allgather(flat, comm=comm)
    assert (every == every[0]).all()


@pytest.mark.parametrize("shard_state", [False, True])
def test_add_param_group_joins_the_buckets(comm, shard_state):
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = coll.DistributedOptimizer(torch.optim.Adam([a], lr=0.1), comm=comm, shard_state=shard_state)
    (a * float(comm.rank + 1)).sum().backward()
    opt.step()
    before = opt.state_dict()["state"][0]["exp_avg"].clone()
    opt.add_param_group({"params": [b], "lr": 0.2})
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], before), "the state is carried over"
    opt.zero_grad()
    (a.sum() + (b * float(comm.rank)).sum()).backward()
    opt.step()
    every = coll.allgather(b.detach().numpy().copy(), comm=comm)
    assert (every == every[0]).all()
    assert sorted(opt.state_dict()["state"]) == [0, 1]
    if comm.size > 1:
        assert b.detach().tolist() != [0.0] * 3


@pytest.mark.parametrize("shard_state", [False, True])
def test_frozen_parameters(comm, shard_state):
    """A frozen layer is not waited for (the others leave during backward), is skipped without a further
    collective, and once unfrozen gets its hook and is trained like the rest."""
    torch.manual_seed(0)
    model = mlp()
    model[0].weight.requires_grad_(False)
    opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, bucket_bytes=1024,
                                    shard_state=shard_state)
    engine = opt._engine
    calls = []
    real = engine._settle_missing
    engine._settle_missing = lambda: (calls.append(1), real())[1]
    frozen = model[0].weight.detach().clone()
    for step in range(2):
        opt.zero_grad()
        x, y = batch("mlp", comm, step, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        assert engine.finished
        opt.step()
    assert torch.equal(model[0].weight.detach(), frozen) and model[0].weight.grad is None
    assert not calls, "frozen parameters cost no object allgather"
    model[0].weight.requires_grad_(True)
    opt.zero_grad()
    x, y = batch("mlp", comm, 5, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert not torch.equal(model[0].weight.detach(), frozen)
    every = coll.allgather(model[0].weight.detach().reshape(-1).clone(), comm=comm)
    assert all(torch.equal(every[0], every[r]) for r in range(comm.size))


def test_large_buckets_the_same_bits(comm):
    """Buckets past the shared-memory threshold (the last one takes the blocking shared-memory allreduce
    during backward; on one node every host bucket takes the blocking call as it leaves, across nodes the
    others the non-blocking one; overlap=False reduces the large gradients through shared memory in place):
    still the same bits as each other, 5 steps of Adam."""
    def run(**options):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 300),
                                    torch.nn.Tanh(), torch.nn.Linear(300, 4))
        opt = coll.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), comm=comm,
                                        bucket_bytes=700 << 10, **options)
        for step in range(5):
            g = torch.Generator().manual_seed(100 * step + comm.rank)
            x, y = torch.randn(16, 256, generator=g), torch.randint(0, 4, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return params_of(model), opt

    ref, _ = run(overlap=False)
    for options in (dict(), dict(grad_views=False), dict(shard_state=True)):
        got, opt = run(**options)
        buckets = opt._engine.buckets  # private: which call each bucket takes is seen nowhere else
        assert buckets[-1].numel * 4 >= 256 << 10
        if not options:
            mid = buckets[:-1]
            assert any(b.numel * 4 < 64 << 10 for b in mid), "the layout has a small bucket before the last"
            one_node = 1 < comm.size == comm.local_size
            assert all(b.blocking == one_node for b in mid), "one node: every bucket blocks as it leaves"
        for i, (a, b) in enumerate(zip(ref, got)):
            assert_same_params(comm, a, b, f"{options}: parameter {i}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_other_dtypes_and_ops_the_same_bits(comm, dtype, op):
    def run(**options):
        torch.manual_seed(0)
        model = mlp().to(getattr(torch, dtype))
        opt = coll.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), comm=comm, op=op,
                                        bucket_bytes=2048, **options)
        for step in range(4):
            x, y = batch("mlp", comm, step, 0)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x.to(getattr(torch, dtype))), y).backward()
            opt.step()
        return params_of(model)

    ref = run(overlap=False)
    for options in (dict(), dict(grad_views=False), dict(shard_state=True)):
        for i, (a, b) in enumerate(zip(ref, run(**options))):
            assert_same_params(comm, a, b, f"{options}: parameter {i}")


def test_a_sharded_optimizer_is_not_pickled(comm):
    import copy
    import pickle

    p = torch.nn.Parameter(torch.zeros(3))
    opt = coll.DistributedOptimizer(torch.optim.Adam([p]), shard_state=True, comm=comm)
    assert "shard_state=True" in repr(opt)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(opt)
    with pytest.raises(TypeError, match="load_state_dict"):
        copy.deepcopy(opt)
    plain = coll.DistributedOptimizer(torch.optim.Adam([p]), comm=comm)
    twin = copy.deepcopy(plain)  # a copy gets buckets (and hooks) of its own, on the copied parameters
    assert twin._engine is not plain._engine and twin._engine.slots[0].param is not p


def test_a_solo_parameter_is_reduced_in_its_own_grad(comm):
    """One parameter per bucket (a large one, or bucket_bytes): its .grad is reduced where it is, whatever
    zero_grad did, as allreduce_tree's solo leaves; a gradient missing there still takes the buffer."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), comm=comm)
    for set_to_none in (True, False, True):
        opt.zero_grad(set_to_none=set_to_none)
        (p * float(comm.rank)).sum().backward()
        g = p.grad
        opt.step()
        assert p.grad is g and g.tolist() == [(comm.size - 1) / 2] * 4
    assert opt._engine.buckets[0].flat is None


@needs_two
def test_horovods_rank_0_checkpoint_with_sharded_state_is_an_error_on_every_rank(comm):
    """``if rank == 0: opt.state_dict()`` while the other ranks go on to their next step: the meeting of
    state_dict() and the others' gradient buckets meet on the gradient communicator, their fingerprints
    differ, and every rank raises MismatchError naming the fix (rank 0 in state_dict(), the others in
    step()), without a deadline. A communicator of its own: the failed gradient communicator is its."""
    from support.comms import communicator

    with communicator() as c:
        _, opt = train(c, "tied", "adam", steps=2, shard_state=True)
        with pytest.raises(coll.MismatchError, match=r"state_dict\(\) or add_param_group\(\), which are collective.*"
                           r"call `sd = opt.state_dict\(\)` on every rank"):
            if c.rank == 0:
                opt.state_dict()  # Horovod's checkpoint idiom
            else:
                train_more(c, opt)


def train_more(c, opt):
    model_params = [p for g in opt.inner.param_groups for p in g["params"]]
    opt.zero_grad()
    sum((p * p).sum() for p in model_params).backward()
    opt.step()

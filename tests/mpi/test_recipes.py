"""The training loops people really write, with DistributedOptimizer in every mode (overlap on, off, sharded
state), against DDP over a gloo group made in this job and against one process on the whole batch.

Bits: at 1 and 2 ranks the parameters are those of DDP(gloo) bit for bit (a sum of two has one order, and
DDP's division of each gradient by the number of ranks before the sum gives the same bits as our one
division after it when that number is a power of two); at 3 ranks within a few float32 roundings
(docs/guide-data-parallel.md, "AMP and other loops"). Tiny models and few steps: this file is in CI.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest

import collectives as coll

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
F = torch.nn.functional

MODES = {"overlap": dict(overlap=True), "off": dict(overlap=False), "sharded": dict(shard_state=True)}
STEPS = 6


@pytest.fixture(scope="module")
def gloo(comm):
    """A gloo process group of every rank of this job (through a file store in a directory rank 0 makes),
    beside the library's communicators, for DDP(gloo) references."""
    if comm.size > 1 and comm.local_size != comm.size:
        pytest.skip("the file store needs every rank on one node")
    from mpi4py import MPI

    made = not dist.is_initialized()
    root = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="recipes-") if comm.rank == 0 else None, root=0)
    store = dist.FileStore(os.path.join(root, "store"), comm.size)
    if made:
        dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size)
        group = dist.group.WORLD
    else:  # another module's default group: a gloo group beside it
        group = dist.new_group(backend="gloo")
    yield group
    if made:
        dist.destroy_process_group()
    else:
        dist.destroy_process_group(group)


def same(comm, got, want, what: str) -> None:
    """Bit for bit at 1 and 2 ranks; at 3+ ranks within float32 roundings (see the module docstring)."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if comm.size <= 2:
            assert torch.equal(a, b), f"{what}: parameter {i} differs by {(a - b).abs().max().item():.3g}"
        else:
            rtol, atol = TOLERANCE[a.dtype]
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=f"{what}: parameter {i}")


TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-10, 1e-12), torch.bfloat16: (2 ** -7, 2 ** -9)}


def params(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def mlp(seed: int = 0, width: int = 16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))


def data(step: int, rank: int, n: int = 4):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def wrap(model, mode, comm, gloo, make_opt):
    """(the module to call, the optimizer to step): DDP(gloo) for ``mode="ddp"``, else ours."""
    if mode == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=gloo)
        return ddp, make_opt(ddp.parameters())
    return model, coll.DistributedOptimizer(make_opt(model.parameters()), comm=comm, **MODES[mode])


# ---------------------------------------------------------------------------------------------------------
# AMP: GradScaler and autocast (bfloat16 on CPU)


def amp_train(mode, comm, gloo, *, overflow_rank=None, adam=False, fused=False):
    """SGD (or Adam) under GradScaler and autocast; at step 2, ``overflow_rank``'s loss is inf (its
    gradients inf/NaN there only). Returns the parameters, the scales seen and the steps taken."""
    def make_opt(ps):
        return torch.optim.Adam(ps, lr=1e-2, fused=fused) if adam else torch.optim.SGD(ps, lr=0.1, momentum=0.9)

    net, opt = wrap(mlp(), mode, comm, gloo, make_opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    scales = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = data(step, comm.rank)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x), y)
        if step == 2 and comm.rank == overflow_rank:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if mode == "off":
            opt.average_gradients()  # overlap=False: before GradScaler looks at .grad (Horovod's synchronize())
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    module = net.module if mode == "ddp" else net
    return params(module), scales


@pytest.mark.parametrize("mode", list(MODES))
def test_amp_grad_scaler_as_ddp(comm, gloo, mode):
    """GradScaler + autocast: the parameters of DDP(gloo) with the same scaler (sharded state unscales
    its averaged share, not the .grad it does not use)."""
    want, want_scales = amp_train("ddp", comm, gloo)
    got, scales = amp_train(mode, comm, gloo)
    assert scales == want_scales
    same(comm, got, want, f"AMP {mode}")


@pytest.mark.parametrize("mode", list(MODES))
def test_amp_overflow_on_one_rank(comm, gloo, mode):
    """One rank's gradients overflow: every rank skips that step and backs off, as DDP (no hang)."""
    want, want_scales = amp_train("ddp", comm, gloo, overflow_rank=0)
    got, scales = amp_train(mode, comm, gloo, overflow_rank=0)
    assert scales == want_scales and scales[2] == scales[1] / 2, scales
    same(comm, got, want, f"AMP {mode}, overflow on rank 0")
    every = coll.allgather(torch.cat([p.reshape(-1) for p in got]), comm=comm)
    assert all(torch.equal(every[0], every[r]) for r in range(comm.size))


@pytest.mark.parametrize("mode", ["overlap", "sharded"])
def test_amp_fused_adam(comm, gloo, mode):
    """Adam(fused=True) takes the scale and the inf flag itself (GradScaler's protocol): handed on."""
    want, want_scales = amp_train("ddp", comm, gloo, overflow_rank=comm.size - 1, adam=True, fused=True)
    got, scales = amp_train(mode, comm, gloo, overflow_rank=comm.size - 1, adam=True, fused=True)
    assert scales == want_scales
    same(comm, got, want, f"AMP fused Adam {mode}")


@pytest.mark.parametrize("width", [37, 300])
def test_fused_adam_sharded_bit_for_bit(comm, width):
    """Adam(fused=True) with sharded state: bit for bit the unsharded optimizer. The CPU kernel's scalar
    tail rounds otherwise than its vector body; each rank's piece of a parameter is stepped as a tensor of
    its own, cut at multiples of 64 elements of the parameter, so that its tail is the parameter's (guide,
    "Why the bits do not differ"). Widths that are no multiple of a vector width; at 300, blocks cut the first
    weight (1800 elements) inside it at 2 and 3 ranks."""
    out = {}
    for fused in (False, True):
        for shard in (False, True):
            torch.manual_seed(0)
            model = mlp(width=width)
            opt = coll.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused), comm=comm,
                                            shard_state=shard)
            for step in range(STEPS):
                opt.zero_grad()
                x, y = data(step, comm.rank)
                F.cross_entropy(model(x), y).backward()
                opt.step()
            out[fused, shard] = params(model)
    for fused in (False, True):  # the same reduction on both sides (the library's): exact at every size
        for i, (a, b) in enumerate(zip(out[fused, True], out[fused, False], strict=True)):
            assert torch.equal(a, b), f"fused={fused}: parameter {i} differs by {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("options", [dict(), dict(shard_state=True), dict(compression="bf16")])
def test_amp_overlap_false_needs_average_gradients(comm, options):
    """overlap=False: GradScaler would look at un-averaged .grad; a clear error on every rank."""
    model = mlp()
    opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, overlap=False,
                                    **options)
    scaler = torch.amp.GradScaler("cpu")
    x, y = data(0, comm.rank)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    with pytest.raises(RuntimeError, match="average_gradients"):
        scaler.step(opt)
    assert "found_inf" not in vars(opt)
    opt.average_gradients()  # and the loop goes on
    scaler.step(opt)
    scaler.update()


def test_amp_sharded_unscale_needs_average_gradients(comm):
    """shard_state=True: scaler.unscale_ before step would unscale .grad, which the step does not use."""
    model = mlp()
    opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, shard_state=True)
    scaler = torch.amp.GradScaler("cpu")
    x, y = data(0, comm.rank)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="average_gradients"):
        scaler.step(opt)


@pytest.mark.parametrize("mode", list(MODES))
def test_amp_unscale_then_clip(comm, gloo, mode):
    """scaler.unscale_(opt), clip_grad_norm_, scaler.step(opt): with average_gradients() first where the
    mode needs it (overlap=False, sharded state), the parameters of DDP."""
    out = {}
    for m in ("ddp", mode):
        net, opt = wrap(mlp(), m, comm, gloo, lambda ps: torch.optim.SGD(ps, lr=0.5))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = data(step, comm.rank)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(net(x), y)
            scaler.scale(loss).backward()
            if m in ("off", "sharded"):
                opt.average_gradients()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            scaler.step(opt)
            scaler.update()
        out[m] = params(net.module if m == "ddp" else net)
    same(comm, out[mode], out["ddp"], f"AMP clip {mode}")


# ---------------------------------------------------------------------------------------------------------
# a GAN: two models, two optimizers, module.zero_grad(), the generator's loss through the discriminator


def gan_train(mode, comm, gloo, steps=4, once=False):
    """The DCGAN tutorial's loop: D steps on a real and a fake batch (two backward passes), then G on D's
    verdict of the fake batch (its backward passes through D, whose gradients D's next zero_grad drops).
    ``once``: DDP reduces D's two passes once (the first under no_sync)."""
    torch.manual_seed(0)
    netG = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
    netD = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LeakyReLU(0.2), torch.nn.Linear(8, 1))
    adam = lambda ps: torch.optim.Adam(ps, lr=2e-3, betas=(0.5, 0.999))
    G, optG = wrap(netG, mode, comm, gloo, adam)
    D, optD = wrap(netD, mode, comm, gloo, adam)
    bce = torch.nn.BCEWithLogitsLoss()
    for step in range(steps):
        real, _ = data(step, comm.rank)
        noise = torch.randn(4, 3, generator=torch.Generator().manual_seed(7 * step + comm.rank))
        D.zero_grad()
        with D.no_sync() if once else contextlib.nullcontext():
            bce(D(real), torch.ones(4, 1)).backward()
        fake = G(noise)
        bce(D(fake.detach()), torch.zeros(4, 1)).backward()
        optD.step()
        G.zero_grad()
        bce(D(fake), torch.ones(4, 1)).backward()
        optG.step()
    unwrap = (lambda m: m.module) if mode == "ddp" else (lambda m: m)
    return params(unwrap(G)) + params(unwrap(D))


@pytest.mark.parametrize("mode", list(MODES))
def test_gan_two_optimizers_module_zero_grad(comm, gloo, mode):
    """With overlap each backward pass is reduced, as DDP does: D's two passes add up (the second reduces
    the first's average plus its own gradients), G's pass through D is reduced and dropped by D's next
    zero_grad. overlap=False and sharded state reduce D's accumulated sum once: DDP with no_sync for
    D's first pass."""
    want = gan_train("ddp", comm, gloo, once=mode != "overlap")
    same(comm, gan_train(mode, comm, gloo), want, f"GAN {mode}")


def test_second_backward_with_op_sum_needs_zeroed_grads(comm):
    p = torch.nn.Parameter(torch.ones(3))
    opt = coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), comm=comm, op="sum")
    (p * 2).sum().backward()
    with pytest.raises(RuntimeError, match="second backward pass .* op='sum'|op='sum'.*second backward"):
        (p * 2).sum().backward()
    opt.zero_grad()
    (p * 2).sum().backward()
    p.grad = None  # zeroed between the passes: reduced anew
    (p * 3).sum().backward()
    opt.step()
    assert p.detach().tolist() == [1.0 - 3.0 * comm.size] * 3


# ---------------------------------------------------------------------------------------------------------
# the model cast after wrapping


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("cast", ["double", "bfloat16"])
def test_model_cast_after_wrapping(comm, gloo, mode, cast):
    """model.double() (or .to(dtype)) after DistributedOptimizer was made: the buckets follow (laid out
    anew at the next round), and the parameters are those of DDP made on the cast model."""
    dtype = {"double": torch.float64, "bfloat16": torch.bfloat16}[cast]
    out = {}
    for m in ("ddp", mode):
        model = mlp().to(dtype) if m == "ddp" else mlp()  # DDP: cast before wrapping (its buckets are fixed)
        net, opt = wrap(model, m, comm, gloo, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        net.to(dtype)
        for step in range(3):
            opt.zero_grad()
            x, y = data(step, comm.rank)
            F.cross_entropy(net(x.to(dtype)), y).backward()
            opt.step()
        out[m] = params(net.module if m == "ddp" else net)
    assert all(p.dtype == dtype for p in out[mode])
    same(comm, out[mode], out["ddp"], f"{cast} {mode}")


# ---------------------------------------------------------------------------------------------------------
# everyday loops, each against DDP(gloo) trained the same way


class TiedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)
        self.hidden = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, 10, bias=False)
        self.out.weight = self.embed.weight  # tied

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


class Checkpointed(torch.nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.a, self.b, self.c = torch.nn.Linear(6, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.relu(self.a(x))
        h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant)  # recomputed in backward
        return self.c(h)


def fit(mode, comm, gloo, *, model=None, steps=STEPS, k=1, lr=0.1, clip=None, schedule=False, freeze=False,
        ema=False, tokens=False, compiled=False):
    """``steps`` optimizer steps of SGD with momentum (``k`` micro-batches each: ours with
    backward_passes_per_step=k, DDP with no_sync for all but the last); returns the parameters (and
    the EMA's)."""
    torch.manual_seed(0)
    module = model() if model is not None else mlp()
    if freeze:
        module[0].requires_grad_(False)  # frozen for the first two steps, then trained
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(module, process_group=gloo)
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
        inner = opt
    elif mode == "single":  # one process on every rank's batch
        net = module
        opt = inner = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
    else:
        net = module
        inner = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
        opt = coll.DistributedOptimizer(inner, comm=comm, backward_passes_per_step=k, **MODES[mode])
    call = torch.compile(net, backend="aot_eager") if compiled else net
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=2, gamma=0.5) if schedule else None
    averaged = None
    if ema:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        averaged = AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    x = y = None
    for step in range(steps):
        if freeze and step == 2:
            module[0].requires_grad_(True)
        opt.zero_grad()
        for micro in range(k):
            x, y = data(step * k + micro, comm.rank)
            if tokens:
                x = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(step * 10 + comm.rank))
                y = (x + 1) % 10
            sync = mode != "ddp" or micro == k - 1
            with contextlib.nullcontext() if sync else net.no_sync():
                if mode == "single":
                    batches = [data(step * k + micro, r) for r in range(comm.size)]
                    sum(F.cross_entropy(call(bx), by) for bx, by in batches).div(comm.size).backward()
                else:
                    F.cross_entropy(call(x), y).backward()
            if mode not in ("ddp", "single") and micro < k - 1:
                opt.step()  # accumulating: no communication, no update
        if clip is not None:
            if mode != "ddp":
                opt.average_gradients()
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        if averaged is not None:
            averaged.update_parameters(module)
    out = params(module)
    return out + (params(averaged.module) if averaged is not None else [])


RECIPES = {
    "clip through average_gradients": dict(clip=0.05),
    "lr scheduler": dict(schedule=True),
    "tied weights": dict(model=TiedNet, tokens=True),
    "checkpoint": dict(model=lambda: Checkpointed(reentrant=False)),
    "ema weights": dict(ema=True),
    "accumulation (no_sync)": dict(k=2),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("mode", list(MODES))
def test_recipe_as_ddp(comm, gloo, recipe, mode):
    options = RECIPES[recipe]
    same(comm, fit(mode, comm, gloo, **options), fit("ddp", comm, gloo, **options), f"{recipe}, {mode}")


@pytest.mark.parametrize("mode", list(MODES))
def test_frozen_then_unfrozen(comm, gloo, mode):
    """A layer frozen when the optimizer is made, trained from step 2: its gradients are reduced from
    then on. (DDP leaves a parameter frozen at construction out of its buckets for good: unfrozen, it
    trains apart on every rank; so the reference is one process on every rank's batch.)"""
    got = fit(mode, comm, gloo, freeze=True)
    want = fit("single", comm, gloo, freeze=True)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"parameter {i}")
    every = coll.allgather(torch.cat([p.reshape(-1) for p in got]), comm=comm)
    assert all(torch.equal(every[0], every[r]) for r in range(comm.size))


@pytest.mark.parametrize("mode", list(MODES))
def test_reentrant_checkpoint(comm, gloo, mode):
    """torch.utils.checkpoint(use_reentrant=True): the recomputation's inner backward pass runs the hooks
    and completes a round of its own; the outer pass reduces again (the inner parameters' average
    reduced anew: their own value at 2 ranks). DDP refuses this loop without static_graph: the reference is
    DDP with use_reentrant=False."""
    got = fit(mode, comm, gloo, model=lambda: Checkpointed(reentrant=True))
    same(comm, got, fit("ddp", comm, gloo, model=lambda: Checkpointed(reentrant=False)), f"reentrant {mode}")


@pytest.mark.parametrize("mode", list(MODES))
def test_two_models_one_optimizer(comm, gloo, mode):
    out = {}
    for m in ("ddp", mode):
        torch.manual_seed(0)
        a, b = mlp(seed=1), mlp(seed=2)
        if m == "ddp":
            a, b = (torch.nn.parallel.DistributedDataParallel(n, process_group=gloo) for n in (a, b))
            opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
        else:
            opt = coll.DistributedOptimizer(torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1),
                                            comm=comm, **MODES[m])
        for step in range(STEPS):
            opt.zero_grad()
            x, y = data(step, comm.rank)
            (F.cross_entropy(a(x), y) + F.cross_entropy(b(x), y)).backward()
            opt.step()
        out[m] = params(a) + params(b)
    same(comm, out[mode], out["ddp"], f"two models, {mode}")


def _compile_works() -> bool:
    try:
        f = torch.compile(torch.nn.Linear(2, 1), backend="aot_eager")
        f(torch.ones(1, 2)).sum().backward()
        return True
    except Exception:  # noqa: BLE001 - any reason torch.compile cannot run on this build
        return False


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_model(comm, gloo, mode):
    """A torch.compile'd model (backend aot_eager: AOTAutograd's compiled backward, no C++ compiler
    needed, so CI stays lean): the post-accumulate-grad hooks still fire on the leaves."""
    if not _compile_works():
        pytest.skip("torch.compile is not available on this build")
    same(comm, fit(mode, comm, gloo, compiled=True, steps=3), fit("ddp", comm, gloo, compiled=True, steps=3),
         f"compiled, {mode}")


# ---------------------------------------------------------------------------------------------------------
# compression: gradients travel in float16 / bfloat16, averaged in float32


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
@pytest.mark.parametrize("mode", list(MODES))
def test_compression_rule(comm, mode, compression):
    """The average is round_narrow(sum over ranks, in float32, of round_narrow(g_r) / size), then cast
    back: the same on every rank and in every mode."""
    narrow = {"fp16": torch.float16, "bf16": torch.bfloat16}[compression]
    shapes = [(5, 3), (7,), (1,)]
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = coll.DistributedOptimizer(torch.optim.SGD(ps, lr=1.0), comm=comm, compression=compression, **MODES[mode])

    def grad(r, i):
        return torch.randn(shapes[i], generator=torch.Generator().manual_seed(10 * r + i)) * 1.001

    if mode == "overlap":
        sum((p * grad(comm.rank, i)).sum() for i, p in enumerate(ps)).backward()
    else:
        for i, p in enumerate(ps):
            p.grad = grad(comm.rank, i)
    opt.step()
    for i, p in enumerate(ps):
        acc = sum(grad(r, i).to(narrow).float() for r in range(comm.size)) / comm.size
        want = -acc.to(narrow).float()
        assert torch.equal(p.detach(), want), f"parameter {i}"
    assert not torch.equal(ps[0].detach(), -sum(grad(r, 0) for r in range(comm.size)) / comm.size), "narrowed"


@pytest.mark.parametrize("mode", list(MODES))
def test_compression_as_ddp_fp16_hook(comm, gloo, mode):
    """Against DDP with fp16_compress_hook (which divides in float16 before a float16 sum): within float16
    roundings of the gradients."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    out = {}
    for m in ("ddp", mode):
        torch.manual_seed(0)
        model = mlp()
        if m == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(model, process_group=gloo)
            net.register_comm_hook(gloo, default_hooks.fp16_compress_hook)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
        else:
            net = model
            opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm,
                                            compression="fp16", **MODES[m])
        for step in range(3):
            opt.zero_grad()
            x, y = data(step, comm.rank)
            F.cross_entropy(net(x), y).backward()
            opt.step()
        out[m] = params(model)
    for a, b in zip(out[mode], out["ddp"]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_compression_arguments(comm):
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="compression must be"):
        coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), comm=comm, compression="int8")
    with pytest.raises(ValueError, match="op='max'"):
        coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), comm=comm, compression="fp16", op="max")

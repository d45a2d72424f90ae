"""DistributedOptimizer's gradient buckets on CUDA tensors (NCCL, or host staging): overlap, views and
sharded state give the same parameters on every rank, and those of overlap=False (not run without a GPU)."""

from __future__ import annotations

import pytest

import collectives as coll

CONFIGS = [dict(overlap=False), dict(overlap=True), dict(overlap=True, grad_views=False),
           dict(overlap=True, shard_state=True)]


def _train(torch, comm, index, options, steps=5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda(index)
    opt = coll.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), comm=comm, bucket_bytes=2048,
                                    **options)
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g).cuda(index)
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize(index)
    return model, opt


def test_gradient_buckets_on_cuda(comm, dev):
    if dev.name != "torch":
        pytest.skip("torch optimizer")
    torch = dev.xp
    results = []
    for options in CONFIGS:
        model, opt = _train(torch, comm, dev.index, options)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = coll.allgather(flat, comm=comm)
        assert all(torch.equal(gathered[0], gathered[r]) for r in range(comm.size)), f"{options}: ranks differ"
        if options.get("overlap") and options.get("grad_views", True) and not options.get("shard_state"):
            for s in opt._engine.slots:
                if not s.bucket.solo:
                    assert s.param.grad is s.view and s.view.is_cuda
        results.append(flat)
    for options, flat in zip(CONFIGS[1:], results[1:]):
        # NCCL may sum in another order for a bucket than for the tree's group: close, not bit for bit
        torch.testing.assert_close(flat, results[0], rtol=1e-5, atol=1e-6, msg=f"{options} vs overlap=False")


def test_sharded_state_memory_on_cuda(comm, dev):
    if dev.name != "torch":
        pytest.skip("torch optimizer")
    torch = dev.xp
    _, plain = _train(torch, comm, dev.index, {}, steps=1)
    _, sharded = _train(torch, comm, dev.index, dict(shard_state=True), steps=1)
    assert sharded.state_bytes() <= 1.05 * plain.state_bytes() / comm.size + 64 * 1024


def _same_everywhere(torch, comm, model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = coll.allgather(flat, comm=comm)
    assert all(torch.equal(gathered[0], gathered[r]) for r in range(comm.size)), "ranks differ"
    return flat


def test_compression_on_cuda(comm, dev):
    """compression="fp16"/"bf16" on CUDA buckets (alltoall and allgather of the narrow type): the same
    parameters on every rank and in every mode."""
    if dev.name != "torch":
        pytest.skip("torch optimizer")
    torch = dev.xp
    for compression in ("fp16", "bf16"):
        flats = [_same_everywhere(torch, comm, _train(torch, comm, dev.index, dict(compression=compression, **o))[0])
                 for o in (dict(), dict(overlap=False), dict(shard_state=True))]
        assert all(torch.equal(flats[0], f) for f in flats[1:]), compression


def test_grad_scaler_on_cuda(comm, dev):
    """GradScaler and float16 autocast on CUDA, with rank 0 overflowing at step 1: every rank skips alike
    (no hang), in every mode."""
    if dev.name != "torch":
        pytest.skip("torch optimizer")
    torch = dev.xp
    for options in (dict(), dict(shard_state=True)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda(dev.index)
        opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2), comm=comm, **options)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
        g = torch.Generator().manual_seed(comm.rank)
        scales = []
        for step in range(4):
            x = torch.randn(8, 16, generator=g).cuda(dev.index)
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().square().mean()
            if step == 1 and comm.rank == 0:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        assert scales[1] == scales[0] / 2, scales
        assert coll.allgather_object(scales, comm=comm) == [scales] * comm.size
        _same_everywhere(torch, comm, model)

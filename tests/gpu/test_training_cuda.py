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

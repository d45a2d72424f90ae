"""The torch.distributed backend "collectives" on CUDA tensors: the same public collectives route them to
the device transports (NCCL, CUDA-aware MPI or host staging). Run by scripts/gpu_check.sh at 1 and 2 ranks.
"""

from __future__ import annotations

import os

import numpy as np
import pytest


@pytest.fixture(scope="module")
def pg(comm):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():  # (set up before the function-scoped gate of conftest: the same rule)
        if os.environ.get("COLLECTIVES_TEST_REQUIRE_GPU", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail("COLLECTIVES_TEST_REQUIRE_GPU=1, but torch sees no GPU", pytrace=False)
        pytest.skip("torch sees no GPU")
    import torch.distributed as dist

    import collectives.torch_backend  # noqa: F401 - registers the backend

    torch.cuda.set_device(comm.local_rank % torch.cuda.device_count())
    dist.init_process_group("collectives")
    yield dist.distributed_c10d._get_default_group()
    dist.destroy_process_group()


def test_cuda_collectives_through_torch(pg, comm, dev):
    if dev.name != "torch":
        pytest.skip("torch.distributed takes torch tensors")
    import torch
    import torch.distributed as dist

    d = f"cuda:{dev.index}"
    t = torch.full((1000,), float(comm.rank + 1), device=d)
    dist.all_reduce(t)
    assert (t == comm.size * (comm.size + 1) / 2).all()
    t = torch.full((8,), float(comm.rank + 1), device=d, dtype=torch.bfloat16)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert (t == comm.size).all()
    out = torch.empty(2 * comm.size, device=d)
    dist.all_gather_into_tensor(out, torch.full((2,), float(comm.rank), device=d))
    assert out.cpu().tolist() == [float(r) for r in range(comm.size) for _ in range(2)]
    rs = torch.empty(2, device=d)
    dist.reduce_scatter_tensor(rs, torch.ones(2 * comm.size, device=d))
    assert (rs == comm.size).all()
    b = torch.full((3,), float(comm.rank), device=d)
    dist.broadcast(b, src=comm.size - 1)
    assert (b == comm.size - 1).all()


def test_ddp_on_cuda_equals_one_process(pg, comm, dev):
    if dev.name != "torch":
        pytest.skip("DDP is torch's")
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    d = f"cuda:{dev.index}"

    def net(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Linear(33, 17), torch.nn.Tanh(),
                                   torch.nn.Linear(17, 3)).double()

    def batch(step):
        g = torch.Generator().manual_seed(1000 + step)
        return (torch.randn(4 * comm.size, 7, generator=g, dtype=torch.float64),
                torch.randn(4 * comm.size, 3, generator=g, dtype=torch.float64))

    model = DDP(net(seed=comm.rank).to(d), device_ids=[dev.index], bucket_cap_mb=1e-3)  # rank 0's parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = net(seed=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mine = slice(4 * comm.rank, 4 * comm.rank + 4)
    for step in range(4):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine].to(d)), y[mine].to(d)).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    torch.cuda.synchronize()
    assert len(model.reducer._get_zeros_like_grad_buckets()) >= 3
    for p, q in zip(model.module.parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.detach().cpu().numpy(), q.detach().numpy(), rtol=1e-10, atol=1e-12)

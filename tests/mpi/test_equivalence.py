"""Data-parallel training equals single-process training on the whole batch, at any world size.

Each rank trains on its equal shard of every batch with DistributedOptimizer(torch.optim.Adam); since the
shards are equal, the mean over ranks of the per-shard mean losses is the full-batch mean loss, so the
averaged gradient is the full-batch gradient. The reference (one process, whole batch) is computed
locally on every rank.
"""

import numpy as np
import pytest

import collectives as coll
from support.comms import gather_objects

STEPS = 12
PER_RANK = 6


def batches(total, dtype, n=3):
    import torch

    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        x = (torch.rand(total, 1, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)
        out.append((x, x ** 3))
    return out


def model_for(seed, dtype):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(dtype)


def reference(data, dtype):
    import torch

    model = model_for(0, dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = data[step % len(data)]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def gathered_bits(comm, params):
    return gather_objects(b"".join(p.detach().numpy().tobytes() for p in params))


def tolerances(dtype):
    import torch

    return dict(rtol=1e-9, atol=1e-11) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_data_parallel_equals_whole_batch(comm, dtype_name):
    import torch

    dtype = getattr(torch, dtype_name)
    data = batches(PER_RANK * comm.size, dtype)
    want = reference(data, dtype)

    model = model_for(comm.rank, dtype)  # every rank starts differently ...
    opt = torch.optim.Adam(model.parameters(), lr=0.5 * (comm.rank + 1))
    coll.synchronize(model, root=0, comm=comm)  # ... until rank 0's parameters win
    opt.param_groups[0]["lr"] = 1e-2
    dist = coll.DistributedOptimizer(opt, comm=comm)
    shards = [(coll.shard(x, comm=comm), coll.shard(y, comm=comm)) for x, y in data]
    assert all(len(x) == PER_RANK for x, _ in shards)
    for step in range(STEPS):
        x, y = shards[step % len(shards)]
        dist.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        dist.step()

    for got, ref in zip(model.parameters(), want):
        np.testing.assert_allclose(got.detach().numpy(), ref.numpy(), **tolerances(dtype))
    assert len(set(gathered_bits(comm, model.parameters()))) == 1, "every rank holds identical parameters"


def test_accumulation_equals_whole_batch(comm):
    """k micro-batches per rank, loss divided by k, stepped every k-th step: still the full batch."""
    import torch

    k = 2
    dtype = torch.float64
    data = batches(PER_RANK * comm.size, dtype)
    want = reference(data, dtype)

    model = model_for(0, dtype)
    dist = coll.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                     backward_passes_per_step=k, comm=comm)
    shards = [(coll.shard(x, comm=comm), coll.shard(y, comm=comm)) for x, y in data]
    for step in range(STEPS):
        x, y = shards[step % len(shards)]
        for m in range(k):
            part = slice(m * PER_RANK // k, (m + 1) * PER_RANK // k)
            dist.zero_grad()
            (torch.nn.functional.mse_loss(model(x[part]), y[part]) / k).backward()
            dist.step()

    for got, ref in zip(model.parameters(), want):
        np.testing.assert_allclose(got.detach().numpy(), ref.numpy(), **tolerances(dtype))
    assert len(set(gathered_bits(comm, model.parameters()))) == 1


def test_optimizer_state_synchronized_then_training_continues_identically(comm):
    """Resume: rank 0 has trained state; after synchronize(model) and synchronize(optimizer) every rank
    continues exactly like rank 0 would alone."""
    import torch

    dtype = torch.float64
    data = batches(PER_RANK * comm.size, dtype)
    model = model_for(comm.rank, dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2 * (comm.rank + 1))
    for step in range(comm.rank + 1):  # different state on every rank
        x, y = data[step % len(data)]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    coll.synchronize({"model": model, "opt": opt}, root=0, comm=comm)
    dist = coll.DistributedOptimizer(opt, comm=comm)
    for step in range(3):
        x, y = data[step % len(data)]
        dist.zero_grad()
        torch.nn.functional.mse_loss(model(coll.shard(x, comm=comm)), coll.shard(y, comm=comm)).backward()
        dist.step()
    assert len(set(gathered_bits(comm, model.parameters()))) == 1
    assert float(opt.state_dict()["state"][0]["step"]) == 1 + 3

"""Data-parallel training with torch: Flux's seed example, an MLP 1 => 256 (tanh) => 1 fitted to x^3.

    python examples/train_mlp.py                 # one process
    mpiexec -n 2 python examples/train_mlp.py    # two processes, each on half of the data

What makes it data-parallel (four lines):

1. ``coll.synchronize(model)`` and ``coll.synchronize(optimizer)``: every rank starts from rank 0's
   parameters and optimizer state (here the ranks deliberately start differently);
2. ``coll.shard(x)``: each rank trains on its own equal part of the data set;
3. ``coll.DistributedOptimizer(optimizer)``: ``step()`` averages the gradients over the ranks first, so
   every rank applies the same update and the parameters stay identical.

Since the shards are equal, the averaged gradient is the gradient of the whole data set: the loss curve is
the same on any number of processes (up to rounding).
"""

from __future__ import annotations

import argparse
import time

import torch

import collectives as coll


def main(steps: int = 300, n: int = 1024, lr: float = 1e-2, report: int = 50) -> float:
    comm = coll.init()
    torch.set_num_threads(1)  # a tiny model: one thread per process is fastest, and ranks share the cores

    torch.manual_seed(comm.rank)  # a different start on every rank: synchronize() fixes that
    model = torch.nn.Sequential(torch.nn.Linear(1, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    coll.synchronize(model)  # parameters and buffers: rank 0's, in place
    coll.synchronize(optimizer)  # state and hyper-parameters (lr, betas, ...): rank 0's
    optimizer = coll.DistributedOptimizer(optimizer)

    g = torch.Generator().manual_seed(0)  # the same data set on every rank ...
    x = torch.rand(n, 1, generator=g) * 2 - 1
    y = x ** 3
    x_local, y_local = coll.shard(x), coll.shard(y)  # ... of which each rank takes its part

    start = time.perf_counter()
    loss = torch.zeros(1)
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x_local), y_local)
        loss.backward()
        optimizer.step()  # average gradients over ranks, then Adam
        if step % report == 0 or step == 1:
            mean_loss = coll.allreduce(loss.detach().reshape(1).clone(), op="mean")
            if comm.rank == 0:
                print(f"step {step:4d}  loss {mean_loss.item():.6f}", flush=True)
    final = coll.allreduce(loss.detach().reshape(1).clone(), op="mean").item()
    if comm.rank == 0:
        print(f"final loss {final:.6f} after {steps} steps on {comm.size} process(es), "
              f"{len(x_local)} samples each, {time.perf_counter() - start:.1f} s", flush=True)
    return final


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--samples", type=int, default=1024)
    args = ap.parse_args()
    main(steps=args.steps, n=args.samples)

"""The world-size-invariant training step (issue 36) as the tests run it: K steps of a small MLP on a fixed
global batch of micro-batches, through ``DistributedOptimizer(..., reproducible=True)``, with torch and
with JAX+optax. Each returns the parameters' bytes after the steps; they must be the same at every number
of ranks (``tests/mpi/test_reproducible.py`` on the world communicator of its 1-, 2- and 3-rank jobs and on
sub-communicators of every size, ``tests/crash/test_reproducible_jobs.py`` in a job of 4 ranks).

    mpiexec -n 4 python tests/support/steps.py     # on rank 0: each framework's digest, the job's and one rank's
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np

import collectives as coll

MICRO = 7  # micro-batches of the global batch (the units): not a multiple of 2 or 3, more than 4 ranks hold
STEPS = 20


def torch_steps(comm, steps: int = STEPS, op: str = "mean") -> bytes:
    """K steps of Adam on an MLP, each rank running the backward passes of its micro-batches."""
    import torch

    torch.set_num_threads(1)  # one micro-batch's gradient must be the same bits on every rank
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = coll.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), op=op, comm=comm,
                                    reproducible=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(MICRO, 4, 5, generator=g)
    y = torch.randn(MICRO, 4, 1, generator=g)
    for _ in range(steps):
        opt.zero_grad()
        for i in range(comm.rank, MICRO, comm.size):  # this rank's micro-batches: one backward pass (unit) each
            torch.nn.functional.mse_loss(model(x[i]), y[i]).backward()
        opt.step()
    opt.close()
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


def jax_steps(comm, steps: int = STEPS) -> bytes:
    """K steps of optax's Adam on an MLP, the gradient of each of this rank's micro-batches one unit."""
    import jax
    import optax

    jnp = jax.numpy
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w": jax.random.normal(k1, (5, 8)) * 0.3, "v": jax.random.normal(k2, (8,)) * 0.3}
    x = jax.random.normal(k3, (MICRO, 4, 5))
    y = jnp.sum(x, axis=-1)

    def loss(p, xb, yb):
        return jnp.mean((jnp.tanh(xb @ p["w"]) @ p["v"] - yb) ** 2)

    grad = jax.jit(jax.grad(loss))
    opt = coll.DistributedOptimizer(optax.adam(1e-2), comm=comm, reproducible=True)
    state = opt.init(params)
    for _ in range(steps):
        units = [grad(params, x[i], y[i]) for i in range(comm.rank, MICRO, comm.size)]
        updates, state = opt.update(units, state, params)
        params = optax.apply_updates(params, updates)
    return b"".join(np.asarray(params[k]).tobytes() for k in sorted(params))


def digest(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:16]


if __name__ == "__main__":
    world = coll.init()
    alone = world.split(color=0 if world.rank == 0 else None)  # rank 0 alone: the steps at one rank, this job
    lines = []
    for name, run in (("torch", torch_steps), ("jax", jax_steps)):
        mine = digest(run(world))
        every = world.allgather_object(mine)
        solo = digest(run(alone)) if alone is not None else ""
        lines.append(f"{name} {mine} {'same-on-every-rank' if len(set(every)) == 1 else 'DIFFERENT ' + ' '.join(every)}"
                     f" one-rank {solo}")
    if world.rank == 0:
        print("\n".join(lines), flush=True)
    sys.exit(0)

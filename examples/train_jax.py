"""Data-parallel training with JAX and optax: Flux's seed example, an MLP 1 => 256 (tanh) => 1 fitted to x^3.

    python examples/train_jax.py                 # one process
    mpiexec -n 2 python examples/train_jax.py    # two processes, each on half of the data

The same four steps as examples/train_mlp.py (torch), in JAX's functional style:

1. ``coll.synchronize(params)``: every rank starts from rank 0's parameters (here the ranks deliberately
   initialise with different keys); a pytree in, a pytree of new ``jax.Array`` leaves out;
2. ``coll.shard(x)``: each rank trains on its own equal part of the data set;
3. ``coll.DistributedOptimizer(optax.adam(lr))``: its ``update`` averages the gradients over the ranks
   (one fused allreduce for the whole pytree) before Adam's update, so every rank applies the same update;
4. the gradients come from ``jax.jit(jax.value_and_grad(loss))``; the communication runs outside ``jit``,
   on the host.

At the end every rank checks that its parameters are bit for bit those of rank 0.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import collectives as coll


def init_params(key, hidden: int = 256):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": jax.random.normal(k1, (1, hidden)) * 1.0, "b": jnp.zeros(hidden)},
            "out": {"w": jax.random.normal(k2, (hidden, 1)) / jnp.sqrt(hidden), "b": jnp.zeros(1)}}


def predict(params, x):
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return h @ params["out"]["w"] + params["out"]["b"]


def loss_fn(params, x, y):
    return jnp.mean((predict(params, x) - y) ** 2)


def main(steps: int = 300, n: int = 1024, lr: float = 1e-2, report: int = 50) -> float:
    comm = coll.init()
    params = init_params(jax.random.PRNGKey(comm.rank))  # a different start on every rank ...
    params = coll.synchronize(params)  # ... until synchronize: rank 0's on every rank
    optimizer = coll.DistributedOptimizer(optax.adam(lr))
    opt_state = optimizer.init(params)

    rng = np.random.default_rng(0)  # the same data set on every rank ...
    x = rng.uniform(-1, 1, (n, 1)).astype(np.float32)
    y = x ** 3
    x_local, y_local = jnp.asarray(coll.shard(x)), jnp.asarray(coll.shard(y))  # ... each rank its part

    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
    start = time.perf_counter()
    loss = jnp.zeros(())
    for step in range(1, steps + 1):
        loss, grads = value_and_grad(params, x_local, y_local)
        updates, opt_state = optimizer.update(grads, opt_state, params)  # averaged over ranks, then Adam
        params = optax.apply_updates(params, updates)
        if step % report == 0 or step == 1:
            mean_loss = coll.allreduce(loss, op="mean")
            if comm.rank == 0:
                print(f"step {step:4d}  loss {float(mean_loss):.6f}", flush=True)
    final = float(coll.allreduce(loss, op="mean"))

    # Identical parameters on every rank: rank 0's bytes against everybody's.
    mine = np.concatenate([np.asarray(leaf).ravel() for leaf in jax.tree_util.tree_leaves(params)])
    first = coll.broadcast(mine.copy(), root=0)
    same = coll.allreduce(np.array([np.array_equal(mine.view(np.uint32), first.view(np.uint32))]), op="min")
    if not same[0]:
        raise SystemExit(f"rank {comm.rank}: the parameters differ between ranks")
    if comm.rank == 0:
        print(f"final loss {final:.6f} after {steps} steps on {comm.size} process(es), {len(x_local)} samples "
              f"each, {time.perf_counter() - start:.1f} s; parameters identical on every rank", flush=True)
    return final


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--samples", type=int, default=1024)
    args = ap.parse_args()
    main(steps=args.steps, n=args.samples)

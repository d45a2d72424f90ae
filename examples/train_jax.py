"""Data-parallel training with JAX and optax: Flux's seed example, an MLP 1 => 256 (tanh) => 1 fitted to x^3.

    python examples/train_jax.py                 # one process
    mpiexec -n 2 python examples/train_jax.py    # two processes, each on half of the data
    mpiexec -n 2 python examples/train_jax.py --eager   # the mean and Adam outside jit

The same four steps as examples/train_mlp.py (torch), in JAX's functional style:

1. ``coll.synchronize(params)``: every rank starts from rank 0's parameters (here the ranks deliberately
   initialise with different keys); a pytree in, a pytree of new ``jax.Array`` leaves out;
2. ``coll.shard(x)``: each rank trains on its own equal part of the data set;
3. the whole training step is one ``jax.jit``: forward, ``jax.value_and_grad``, the gradient mean over the
   ranks (``collectives.jax.allreduce_tree``: one fused allreduce of the pytree, inside the compiled step)
   and ``optax.adam``'s update, so every rank applies the same update;
4. ``--eager``: the same step as three calls, the gradient mean between two compiled ones, on the host
   (``coll.allreduce_tree``): the same parameters, bit for bit (tests/mpi/test_jax_jit.py). (Adam's update
   run op by op, outside any ``jit``, as ``coll.DistributedOptimizer(optax.adam(lr))`` runs it, rounds
   differently in the last bit: XLA fuses the update's arithmetic inside ``jit``.)

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
import collectives.jax as cj


def init_params(key, hidden: int = 256):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": jax.random.normal(k1, (1, hidden)) * 1.0, "b": jnp.zeros(hidden)},
            "out": {"w": jax.random.normal(k2, (hidden, 1)) / jnp.sqrt(hidden), "b": jnp.zeros(1)}}


def predict(params, x):
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return h @ params["out"]["w"] + params["out"]["b"]


def loss_fn(params, x, y):
    return jnp.mean((predict(params, x) - y) ** 2)


def train(steps: int = 300, n: int = 1024, lr: float = 1e-2, report: int = 0, jit_whole_step: bool = True):
    """Train for ``steps`` steps; return ``(params, loss)`` (loss: this rank's last). ``jit_whole_step``:
    forward, gradient, gradient mean and Adam's update in one ``jax.jit`` (collectives.jax); else three
    calls: the gradient under ``jit``, the mean on the host (``coll.allreduce_tree``), Adam's update
    under ``jit``: the same bits (the mean's callback is a boundary XLA does not fuse across)."""
    comm = coll.init()
    params = init_params(jax.random.PRNGKey(comm.rank))  # a different start on every rank ...
    params = coll.synchronize(params)  # ... until synchronize: rank 0's on every rank

    rng = np.random.default_rng(0)  # the same data set on every rank ...
    x = rng.uniform(-1, 1, (n, 1)).astype(np.float32)
    y = x ** 3
    x_local, y_local = jnp.asarray(coll.shard(x)), jnp.asarray(coll.shard(y))  # ... each rank its part

    if jit_whole_step:
        optimizer = optax.adam(lr)

        @jax.jit
        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            grads = cj.allreduce_tree(grads, op="mean")  # inside jit: one fused allreduce of the pytree
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
    else:
        optimizer = optax.adam(lr)
        value_and_grad = jax.jit(jax.value_and_grad(loss_fn))

        @jax.jit
        def apply(grads, opt_state, params):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        def step(params, opt_state, x, y):
            loss, grads = value_and_grad(params, x, y)
            grads = coll.allreduce_tree(grads, op="mean")  # on the host, between two compiled calls
            params, opt_state = apply(grads, opt_state, params)
            return params, opt_state, loss

    opt_state = optimizer.init(params)
    loss = jnp.zeros(())
    for i in range(1, steps + 1):
        params, opt_state, loss = step(params, opt_state, x_local, y_local)
        if report and (i % report == 0 or i == 1):
            mean_loss = coll.allreduce(loss, op="mean")
            if comm.rank == 0:
                print(f"step {i:4d}  loss {float(mean_loss):.6f}", flush=True)
    return params, loss


def main(steps: int = 300, n: int = 1024, lr: float = 1e-2, report: int = 50, jit_whole_step: bool = True) -> float:
    comm = coll.init()
    start = time.perf_counter()
    params, loss = train(steps, n, lr, report, jit_whole_step)
    final = float(coll.allreduce(loss, op="mean"))

    # Identical parameters on every rank: rank 0's bytes against everybody's.
    mine = np.concatenate([np.asarray(leaf).ravel() for leaf in jax.tree_util.tree_leaves(params)])
    first = coll.broadcast(mine.copy(), root=0)
    same = coll.allreduce(np.array([np.array_equal(mine.view(np.uint32), first.view(np.uint32))]), op="min")
    if not same[0]:
        raise SystemExit(f"rank {comm.rank}: the parameters differ between ranks")
    if comm.rank == 0:
        print(f"final loss {final:.6f} after {steps} steps on {comm.size} process(es), {n // comm.size} samples "
              f"each, {time.perf_counter() - start:.1f} s; parameters identical on every rank", flush=True)
    return final


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--eager", action="store_true", help="the gradient mean on the host, between two jitted calls")
    args = ap.parse_args()
    main(steps=args.steps, n=args.samples, jit_whole_step=not args.eager)

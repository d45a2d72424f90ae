"""Data-parallel training with NumPy only: the functional (optax-like) path, no framework needed.

    python examples/train_numpy.py
    mpiexec -n 2 python examples/train_numpy.py

An MLP 1 => 64 (tanh) => 1 fitted to x^3, gradients written by hand, and an optimizer in optax's style:
two pure functions ``init(params) -> state`` and ``update(grads, state, params) -> (updates, state)``.
``coll.DistributedOptimizer`` wraps such a pair into another pair whose ``update`` first averages
``grads`` over the ranks. The same code works with optax itself on JAX arrays (call ``update`` outside
``jax.jit``).
"""

from __future__ import annotations

import argparse
import time
from typing import NamedTuple
from collections.abc import Callable

import numpy as np

import collectives as coll


class GradientTransformation(NamedTuple):
    """optax's shape of an optimizer."""

    init: Callable
    update: Callable


def tree_map(fn, *trees):
    """fn over the leaves of dicts of arrays (enough for this example; optax uses jax.tree_util)."""
    return {k: fn(*(t[k] for t in trees)) for k in trees[0]}


def adam(lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    def init(params):
        return {"count": 0, "mu": tree_map(np.zeros_like, params), "nu": tree_map(np.zeros_like, params)}

    def update(grads, state, params=None):
        count = state["count"] + 1
        mu = tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["mu"], grads)
        nu = tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["nu"], grads)
        updates = tree_map(lambda m, v: -lr * (m / (1 - b1 ** count)) / (np.sqrt(v / (1 - b2 ** count)) + eps),
                           mu, nu)
        return updates, {"count": count, "mu": mu, "nu": nu}

    return GradientTransformation(init, update)


def init_params(rng, hidden=64):
    return {"w1": rng.normal(0, 1.0, (1, hidden)), "b1": np.zeros(hidden),
            "w2": rng.normal(0, 1 / np.sqrt(hidden), (hidden, 1)), "b2": np.zeros(1)}


def loss_and_grads(params, x, y):
    """Mean squared error of the MLP on (x, y), and its gradient with respect to every parameter."""
    h = np.tanh(x @ params["w1"] + params["b1"])
    pred = h @ params["w2"] + params["b2"]
    err = pred - y
    loss = float(np.mean(err ** 2))
    d_pred = 2 * err / len(x)
    d_h = (d_pred @ params["w2"].T) * (1 - h ** 2)
    grads = {"w2": h.T @ d_pred, "b2": d_pred.sum(0), "w1": x.T @ d_h, "b1": d_h.sum(0)}
    return loss, grads


def main(steps: int = 500, n: int = 1024, lr: float = 1e-2, report: int = 100) -> float:
    comm = coll.init()
    params = init_params(np.random.default_rng(comm.rank))  # different on every rank ...
    params = coll.synchronize(params)  # ... until rank 0's win (in place: NumPy arrays are writable)

    optimizer = coll.DistributedOptimizer(adam(lr))  # update() averages grads over the ranks first
    state = optimizer.init(params)

    rng = np.random.default_rng(0)  # the same data set everywhere; each rank takes its part
    x = rng.uniform(-1, 1, (n, 1))
    x_local = coll.shard(x)
    y_local = x_local ** 3

    start = time.perf_counter()
    loss = 0.0
    for step in range(1, steps + 1):
        loss, grads = loss_and_grads(params, x_local, y_local)
        updates, state = optimizer.update(grads, state, params)
        params = tree_map(np.add, params, updates)
        if step % report == 0 or step == 1:
            mean_loss = coll.allreduce(np.array([loss]), op="mean")[0]
            if comm.rank == 0:
                print(f"step {step:4d}  loss {mean_loss:.6f}", flush=True)
    final = coll.allreduce(np.array([loss]), op="mean")[0]
    if comm.rank == 0:
        print(f"final loss {final:.6f} after {steps} steps on {comm.size} process(es), "
              f"{len(x_local)} samples each, {time.perf_counter() - start:.1f} s", flush=True)
    return float(final)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    args = ap.parse_args()
    main(steps=args.steps)

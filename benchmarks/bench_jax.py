"""collectives.jax inside jax.jit against the eager call on the same data (issue 37), and the jitted MLP step.

    mpiexec -n 2 python benchmarks/bench_jax.py                         # 8 B, 64 KiB, 64 MiB; 7 rounds
    mpiexec -n 2 python benchmarks/bench_jax.py --sizes 8B,1MiB --rounds 3 --no-step

Per size, each round times ``jax.jit(lambda v: cj.allreduce(v))`` and the eager ``coll.allreduce`` of the
same float32 JAX array (sum), in alternating order (a barrier before each; the slowest rank's time; the
result waited for with ``block_until_ready``), and prints every run: time per call of each and their ratio.
The targets (issue 37): the jitted call within 2x the eager one + 20 us up to 64 KiB, within 1.2x at 64 MiB.

The step: examples/train_jax.py's MLP (1 => 256 => 1, 512 samples per rank), the whole step in one
``jit`` (forward, gradient, ``cj.allreduce_tree`` mean, ``optax.adam``) against the eager step
(``jax.jit(jax.value_and_grad)``, then ``coll.DistributedOptimizer(optax.adam)``'s update and
``optax.apply_updates`` outside ``jit``), alternating the same way.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import jax
import jax.numpy as jnp
import optax

import collectives as coll
import collectives.jax as cj
from _common import fmt_time, human, parse_sizes


def timed(comm, fn, calls: int) -> float:
    """Seconds per call of ``fn`` (``calls`` calls, the last result waited for), the slowest rank's."""
    comm.barrier()
    t = time.perf_counter()
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    mine = (time.perf_counter() - t) / calls
    return float(comm.allreduce(np.array([mine]), op="max")[0])


def calls_for(nbytes: int) -> int:
    return 400 if nbytes <= 4096 else 100 if nbytes <= 1 << 20 else 4


def bench_sizes(comm, sizes: list[int], rounds: int) -> None:
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    jitted = jax.jit(cj.allreduce)
    say(f"{'size':>8} {'round':>5} {'first':>6} {'jit':>11} {'eager':>11} {'ratio':>6} {'jit - eager':>12}")
    for nbytes in sizes:
        x = jnp.ones(nbytes // 4, jnp.float32)
        assert np.asarray(jitted(x)).tobytes() == np.asarray(coll.allreduce(x)).tobytes()  # warm, and equal
        calls = calls_for(nbytes)
        ratios = []
        for r in range(rounds):
            order = ("jit", "eager") if r % 2 == 0 else ("eager", "jit")
            got = {}
            for which in order:
                fn = jitted if which == "jit" else coll.allreduce
                got[which] = timed(comm, functools.partial(fn, x), calls)
            ratios.append(got["jit"] / got["eager"])
            say(f"{human(nbytes):>8} {r:5d} {order[0]:>6} {fmt_time(got['jit'])} {fmt_time(got['eager'])} "
                f"{got['jit'] / got['eager']:6.2f} {fmt_time(got['jit'] - got['eager'])}")
        say(f"{human(nbytes):>8} median ratio {np.median(ratios):.2f} over {rounds} rounds of {calls} calls")


def bench_step(comm, rounds: int, steps: int) -> None:
    import train_jax

    say = print if comm.rank == 0 else (lambda *a, **k: None)
    params = coll.synchronize(train_jax.init_params(jax.random.PRNGKey(0)))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(-1, 1, (512, 1)).astype(np.float32))
    y = x ** 3
    adam = optax.adam(1e-2)

    @jax.jit
    def jit_step(params, state):
        _, grads = jax.value_and_grad(train_jax.loss_fn)(params, x, y)
        grads = cj.allreduce_tree(grads, op="mean")
        updates, state = adam.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    dist = coll.DistributedOptimizer(optax.adam(1e-2))
    value_and_grad = jax.jit(jax.value_and_grad(train_jax.loss_fn))

    def eager_step(params, state):
        _, grads = value_and_grad(params, x, y)
        updates, state = dist.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def run(step, state):
        def go():
            p, s = params, state
            for _ in range(steps):
                p, s = step(p, s)
            return p
        return go

    fns = {"jit": run(jit_step, adam.init(params)), "eager": run(eager_step, dist.init(params))}
    for f in fns.values():
        jax.block_until_ready(f())  # compile and warm
    say(f"\nMLP step (train_jax's model, 512 samples per rank), {steps} steps per run")
    say(f"{'round':>5} {'first':>6} {'jit step':>11} {'eager step':>11} {'ratio':>6}")
    ratios = []
    for r in range(rounds):
        order = ("jit", "eager") if r % 2 == 0 else ("eager", "jit")
        got = {w: timed(comm, fns[w], 1) / steps for w in order}
        ratios.append(got["jit"] / got["eager"])
        say(f"{r:5d} {order[0]:>6} {fmt_time(got['jit'])} {fmt_time(got['eager'])} {got['jit'] / got['eager']:6.2f}")
    say(f"step median ratio {np.median(ratios):.2f} over {rounds} rounds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8B,64KiB,64MiB", help="comma list or LO..HI (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=50, help="MLP steps per run")
    ap.add_argument("--no-step", action="store_true", help="skip the MLP step")
    args = ap.parse_args()
    comm = coll.init()
    if comm.rank == 0:
        print(f"{comm.size} ranks, backend {comm.backend}, jax {jax.__version__}, {os.cpu_count()} CPUs")
    bench_sizes(comm, parse_sizes(args.sizes, 4), args.rounds)
    if not args.no_step:
        bench_step(comm, args.rounds, args.steps)


if __name__ == "__main__":
    main()

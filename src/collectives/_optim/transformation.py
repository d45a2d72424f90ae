"""``DistributedOptimizer`` of an optax-like optimizer (two pure functions ``init`` and ``update``): a new
pair of functions whose state nests the inner state (as optax's own wrappers do), averaging the gradients
over the ranks before the inner ``update``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .._arrays import is_tracer
from .._comm import allreduce_tree
from .._tree import is_array, map_leaves


class DistributedState(NamedTuple):
    """The state of a :class:`DistributedTransformation`.

    Attributes:
        inner_state: the inner optimizer's state.
        grad_acc: the gradients accumulated so far (``None`` when ``backward_passes_per_step == 1``).
        mini_step: how many gradients ``grad_acc`` holds.
    """

    inner_state: Any
    grad_acc: Any = None
    mini_step: int = 0


class DistributedTransformation(NamedTuple):
    """An optax-like optimizer (``init``, ``update``) averaging gradients over ranks before updating.

    Made by :func:`DistributedOptimizer`. ``init(params) -> state``;
    ``update(grads, state, params=None, **extra) -> (updates, state)``. The ``grads`` passed in are
    averaged in place where their arrays are writable (NumPy); JAX arrays give new ones.

    Example:
        >>> import numpy as np, collectives as coll
        >>> class Zero:                       # an optax-like optimizer whose updates are -grads
        ...     init = staticmethod(lambda params: None)
        ...     update = staticmethod(lambda g, s, p=None: ({k: -v for k, v in g.items()}, s))
        >>> opt = coll.DistributedOptimizer(Zero(), backward_passes_per_step=2)
        >>> state = opt.init({"w": np.zeros(1)})
        >>> u, state = opt.update({"w": np.ones(1)}, state)       # accumulating: zero updates
        >>> u["w"].tolist(), state.mini_step
        ([0.0], 1)
        >>> u, state = opt.update({"w": np.full(1, 3.0)}, state)  # mean of (1, 3), averaged over ranks
        >>> u["w"].tolist(), state.mini_step
        ([-2.0], 0)
    """

    init: Callable
    update: Callable


def _zeros_like(x):
    if x is None:
        return None
    if is_array(x):
        try:
            from array_api_compat import array_namespace

            return array_namespace(x).zeros_like(x)
        except Exception:  # noqa: BLE001 - a library array_api_compat does not know
            return x * 0
    return type(x)(0)


def _add(a, b):
    return None if a is None else a + b


def _transformation(inner, op: str, k: int, bucket_bytes, comm, reproducible: bool = False) -> DistributedTransformation:
    def init(params):
        acc = map_leaves(_zeros_like, params) if k > 1 else None
        return DistributedState(inner.init(params), acc, 0)

    def update(grads, state, params=None, **extra):
        traced = []
        map_leaves(lambda leaf: traced.append(leaf) if is_tracer(leaf) else None, grads)
        if traced:  # before any communication, on every rank alike (all of them trace the same function)
            raise TypeError("DistributedOptimizer's update() was called inside jax.jit (or vmap, grad, scan): "
                            f"the gradients are JAX tracers ({type(traced[0]).__name__}), which have no values "
                            "to send to the other ranks. Call update outside jit: jit the loss and gradient "
                            "computation (jax.jit(jax.value_and_grad(loss))), call "
                            "`updates, state = opt.update(grads, state, params)` on the arrays it returns, then "
                            "optax.apply_updates (it may be jitted on its own)")
        if reproducible:  # grads: this rank's units, a list of gradient trees (_units)
            from .._units import sum_units

            grads = sum_units(grads, params, op, comm)
            updates, inner_state = inner.update(grads, state.inner_state, params, **extra)
            return updates, DistributedState(inner_state, None, 0)
        if k == 1:
            grads = allreduce_tree(grads, op, comm=comm, bucket_bytes=bucket_bytes)
            updates, inner_state = inner.update(grads, state.inner_state, params, **extra)
            return updates, DistributedState(inner_state, None, 0)
        acc = map_leaves(_add, state.grad_acc, grads)
        step = state.mini_step + 1
        if step < k:
            return map_leaves(_zeros_like, grads), DistributedState(state.inner_state, acc, step)
        mean = map_leaves(lambda a: None if a is None else a / k, acc)
        mean = allreduce_tree(mean, op, comm=comm, bucket_bytes=bucket_bytes)
        updates, inner_state = inner.update(mean, state.inner_state, params, **extra)
        return updates, DistributedState(inner_state, map_leaves(_zeros_like, acc), 0)

    update._collectives_distributed = True  # type: ignore[attr-defined]  # a marker on the function: mypy has no function attributes
    return DistributedTransformation(init, update)

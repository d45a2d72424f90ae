"""DistributedOptimizer: average gradients across ranks, then let the user's optimizer step.

By composition, never by subclassing the user's class: a torch optimizer is wrapped in an object that
delegates everything it does not override; an optax-like optimizer (two pure functions ``init`` and
``update``) is wrapped in a new pair of functions whose state nests the inner state (as optax's own
wrappers do).
"""

from __future__ import annotations

from typing import Any, NamedTuple
from collections.abc import Callable

from . import _dtypes
from ._backends import closed as _closed
from ._comm import _resolve, allreduce_tree
from ._errors import BackendUnavailableError
from ._tree import WRAPPER_ATTRIBUTE, is_array, map_leaves


def DistributedOptimizer(optimizer, *, op: str = "mean", backward_passes_per_step: int = 1,
                         bucket_bytes: int | None = None, comm=None):
    """Wrap an optimizer so that every update uses gradients averaged over all ranks.

    Two kinds of optimizer are accepted:

    - **torch-like** (has ``param_groups`` and ``step``, e.g. ``torch.optim.Adam``): returns a
      :class:`TorchDistributedOptimizer`. Its ``step(closure=None)`` averages every ``p.grad`` over the
      ranks (fused, see :func:`allreduce_tree`; parameters in ``param_groups`` order) and then calls the
      inner ``step``. Everything else (``zero_grad``, ``state_dict``, ``load_state_dict``,
      ``param_groups``, ``state``, ...) is the inner optimizer's. A parameter whose ``.grad`` is ``None``
      must be ``None`` on every rank (else :class:`MismatchError` names it).
    - **optax-like** (has ``init`` and ``update``, pure functions, e.g. an ``optax.GradientTransformation``):
      returns a :class:`DistributedTransformation` ``(init, update)``; ``update(grads, state, params=None)``
      averages ``grads`` over the ranks and then calls the inner ``update``. Call it outside ``jax.jit``
      (the communication runs on the host).

    Gradient accumulation, ``backward_passes_per_step=k`` (Horovod's name): ranks communicate only
    every k-th step.

    - torch: call ``backward()`` and ``step()`` once per micro-batch as usual. The first k-1 ``step()``
      calls do nothing (no communication, no update) and the ``zero_grad()`` calls that follow them are
      skipped too, so ``.grad`` accumulates the k backward passes (torch adds them up); the k-th
      ``step()`` averages the accumulated ``.grad`` over the ranks and calls the inner ``step``. The
      gradient applied is therefore the *sum* over the k micro-batches of the rank-mean (as in torch's
      own accumulation and Horovod): divide your loss by k for a mean. A closure is not supported with
      k > 1.
    - optax-like: each ``update`` adds ``grads`` to an accumulator kept in the state and returns zero
      updates, without communication; the k-th averages the *mean* of the k gradients over the ranks
      and returns the inner optimizer's updates (as ``optax.MultiSteps`` does).

    Args:
        optimizer: a torch-like or optax-like optimizer (see above).
        op: how gradients are combined: ``"mean"`` (default) or ``"sum"`` (any op of :func:`allreduce`).
        backward_passes_per_step: communicate and update every this many steps (default 1).
        bucket_bytes: fused buffer bound for the gradient allreduce (default ``COLLECTIVES_BUCKET_BYTES``).
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).

    Returns:
        A :class:`TorchDistributedOptimizer` or a :class:`DistributedTransformation`.

    Raises:
        TypeError: ``optimizer`` is neither torch-like nor optax-like.
        ValueError: ``backward_passes_per_step`` is not a positive integer, or the optimizer is already
            distributed.

    Example:
        >>> import numpy as np, collectives as coll
        >>> sgd_init = lambda params: ()
        >>> def sgd_update(grads, state, params=None):
        ...     return {k: -0.1 * g for k, g in grads.items()}, state
        >>> class SGD:
        ...     init, update = staticmethod(sgd_init), staticmethod(sgd_update)
        >>> opt = coll.DistributedOptimizer(SGD())
        >>> params = {"w": np.zeros(2)}
        >>> state = opt.init(params)
        >>> grads = {"w": np.full(2, float(coll.world().rank))}      # differs per rank
        >>> updates, state = opt.update(grads, state, params)
        >>> bool(np.allclose(updates["w"], -0.1 * (coll.world().size - 1) / 2))
        True
    """
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
        raise TypeError(f"backward_passes_per_step must be a positive integer, got "
                        f"{type(backward_passes_per_step).__name__}")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    op = _dtypes.check_op(op)
    if isinstance(optimizer, TorchDistributedOptimizer) or getattr(getattr(optimizer, "update", None),
                                                                   "_collectives_distributed", False):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the inner optimizer once")
    c = _resolve(comm)
    if c.closed:  # refused now, not at the first step
        raise BackendUnavailableError(f"DistributedOptimizer: {_closed.MESSAGE}")
    if hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None)):
        return TorchDistributedOptimizer(optimizer, op=op, backward_passes_per_step=backward_passes_per_step,
                                         bucket_bytes=bucket_bytes, comm=c)
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return _transformation(optimizer, op, backward_passes_per_step, bucket_bytes, c)
    raise TypeError(
        f"DistributedOptimizer expects a torch-like optimizer (with param_groups and step) or an optax-like "
        f"one (with init and update functions); got {type(optimizer).__name__}"
    )


# ---------------------------------------------------------------------------------------------------------
# torch


class TorchDistributedOptimizer:
    """A torch optimizer whose ``step`` first averages the gradients over all ranks.

    Made by :func:`DistributedOptimizer`; wraps (does not subclass) the inner optimizer, available as
    ``inner``. Attributes and methods not listed here are the inner optimizer's. LR schedulers check
    ``isinstance(optimizer, torch.optim.Optimizer)``: give them ``inner`` (they change the same
    ``param_groups``).

    Example:
        >>> import torch, collectives as coll
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> model = coll.synchronize(model)              # same start everywhere
        >>> loss = model(torch.ones(4, 2)).pow(2).mean()
        >>> loss.backward()
        >>> opt.step()                                   # averaged gradients, then SGD
        >>> opt.zero_grad()
        >>> opt.param_groups[0]["lr"]
        0.1
    """

    _collectives_distributed = True

    def __init__(self, optimizer, *, op: str = "mean", backward_passes_per_step: int = 1,
                 bucket_bytes: int | None = None, comm=None):
        self.inner = optimizer
        self.comm = _resolve(comm)
        self.op = op
        self.backward_passes_per_step = backward_passes_per_step
        self.bucket_bytes = bucket_bytes
        self._passes = 0  # step() calls since the last real step
        self._averaged = False  # average_gradients() ran since the last step

    def __getattr__(self, name):
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    # A communicator is a resource of this process (an MPI communicator), not data: a copy shares it, and
    # a pickle leaves it out (it could not travel); unpickled, the optimizer uses the default communicator
    # (collectives.world()) of the process that loads it, and the inner optimizer is pickled as torch does.
    def __getstate__(self):
        state = dict(self.__dict__)
        state["comm"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.comm is None:
            from ._comm import world

            self.comm = world()

    def __deepcopy__(self, memo):
        import copy

        memo[id(self.comm)] = self.comm  # shared, not copied
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({self.inner!r}, op={self.op!r}, "
                f"backward_passes_per_step={self.backward_passes_per_step})")

    @property
    def accumulating(self) -> bool:
        """True between the step() calls that only accumulate (k-1 of every k)."""
        return self._passes != 0

    def average_gradients(self) -> None:
        """Average every parameter's ``.grad`` over the ranks now (all ranks must call it).

        For work between averaging and stepping, such as gradient clipping: call this, clip, then
        ``step()``, which will not average again.

        Example:
            >>> import torch, collectives as coll
            >>> p = torch.nn.Parameter(torch.zeros(2))
            >>> opt = coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0))
            >>> p.grad = torch.full((2,), float(coll.world().rank))
            >>> opt.average_gradients()
            >>> _ = torch.nn.utils.clip_grad_norm_([p], max_norm=1.0)
            >>> opt.step()                    # does not average again
            >>> bool((p.grad == p.grad[0]).all())
            True
        """
        params = [p for group in self.inner.param_groups for p in group["params"]]
        tree = {"param_groups": [[p.grad for p in group["params"]] for group in self.inner.param_groups]}
        out = allreduce_tree(tree, self.op, comm=self.comm, bucket_bytes=self.bucket_bytes)
        if out is not tree:  # a gradient that could not be written in place came back as a new tensor
            grads = [g for group in out["param_groups"] for g in group]
            for p, g in zip(params, grads):
                if g is not p.grad:
                    p.grad = g
        self._averaged = True

    def step(self, closure: Callable | None = None):
        """Average the gradients over all ranks, then run the inner optimizer's step.

        With ``backward_passes_per_step=k`` only every k-th call does that; the others return ``None``
        at once. Every rank must call it the same number of times.

        Args:
            closure: as for the inner optimizer (re-evaluates the loss; its gradients are averaged after
                it ran). Not supported with ``backward_passes_per_step > 1``.

        Returns:
            What the inner ``step`` returns (the loss when a closure was given), or ``None`` while
            accumulating.
        """
        k = self.backward_passes_per_step
        if closure is not None and k > 1:
            raise ValueError("step(closure) is not supported with backward_passes_per_step > 1: the closure "
                             "would run one backward pass more than the k accumulated ones")
        self._passes += 1
        if self._passes < k:
            return None
        self._passes = 0
        if closure is None:
            if not self._averaged:
                self.average_gradients()
            self._averaged = False
            return self.inner.step()

        def averaged_closure():
            loss = closure()
            self.average_gradients()
            return loss

        self._averaged = False
        return self.inner.step(averaged_closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner ``zero_grad``, skipped while accumulating (so the k backward passes add up)."""
        if self.accumulating:
            return
        self.inner.zero_grad(set_to_none=set_to_none)


setattr(TorchDistributedOptimizer, WRAPPER_ATTRIBUTE, True)  # synchronize() syncs the inner optimizer


# ---------------------------------------------------------------------------------------------------------
# optax-like


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


def _transformation(inner, op: str, k: int, bucket_bytes, comm) -> DistributedTransformation:
    def init(params):
        acc = map_leaves(_zeros_like, params) if k > 1 else None
        return DistributedState(inner.init(params), acc, 0)

    def update(grads, state, params=None, **extra):
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

    update._collectives_distributed = True
    return DistributedTransformation(init, update)

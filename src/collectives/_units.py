"""The world-size-invariant training step: ``DistributedOptimizer(..., reproducible=True)``.

A rank's gradient is itself a float sum over its share of the batch, so a reproducible allreduce of it
alone is not enough for bits that do not depend on the number of ranks. Here the **unit** of the sum is
one micro-batch's gradient: every unit enters one exact fixed-point sum (:func:`collectives.allreduce_units`)
on its own, whichever rank computed it, so the mean over the global batch's micro-batches is the same bits
at any number of ranks and any split of the micro-batches among them.

- torch (:class:`TorchUnits`): every ``backward()`` pass is one unit. A post-accumulate-grad hook on every
  parameter takes the pass's ``.grad`` (a reference: no copy) and leaves ``.grad`` ``None``, so the next
  pass starts from nothing instead of adding to it; ``step()`` (or ``average_gradients()``) stacks the
  passes since the last step per dtype, one row per unit, and sums them with one ``allreduce_units`` per
  dtype. A parameter that got no gradient in some pass contributes zeros to that unit; one column per
  parameter (1 where it had a gradient) tells every rank which parameters had a gradient on any rank
  (the others keep ``.grad`` ``None`` and are skipped by the inner step, as torch skips them). The stack is
  in host memory, where the sum is computed, whatever the parameters' device: a CUDA gradient is copied
  into its row, and its parameter's sum back to its device.
- optax-like (:func:`sum_units`): ``update`` takes a list of gradient trees, one per micro-batch of this
  rank (possibly empty), and sums them the same way, one ``allreduce_units`` per dtype.
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from ._comm import allreduce_units
from ._tree import flatten, is_array, unflatten

REFUSED = {  # what cannot be combined with reproducible=True, and why (DistributedOptimizer's checks)
    "compression": "compression rounds each rank's gradient sum into a narrow type before the ranks' sum, so "
                   "its bits depend on the number of ranks; drop compression= or reproducible=True",
    "shard_state": "shard_state=True reduce-scatters each rank's accumulated gradient (one term per rank); "
                   "it is not yet combined with the per-micro-batch units of reproducible=True: drop one of them",
    "backward_passes_per_step": "with reproducible=True every backward() pass is one unit and step() sums every "
                                "unit since the last step: call step() once per global batch, after this "
                                "rank's backward passes, and leave backward_passes_per_step at 1",
}


def _torch():
    import torch

    return torch


def _end_of_pass(ref) -> None:
    units = ref()
    if units is not None:
        units.open = False


def _make_hook(ref):
    def hook(param):  # post-accumulate-grad: param.grad holds this backward pass's gradient
        units = ref()
        if units is not None:
            units.take(param)
    return hook


def check_params(params) -> None:
    """TypeError (at construction, before anything moves) for a parameter a reproducible sum cannot take:
    one not of float16, bfloat16, float32 or float64."""
    torch = _torch()
    for p in params:
        if p.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"DistributedOptimizer(reproducible=True) sums float16, bfloat16, float32 and float64 "
                            f"gradients, got a {str(p.dtype).replace('torch.', '')} parameter of shape "
                            f"{tuple(p.shape)}")


class TorchUnits:
    """The units of a torch optimizer's step: every backward pass's gradients (see the module docstring)."""

    def __init__(self, inner, comm, op: str):
        self.inner, self.comm, self.op = inner, comm, op
        self.passes: list[dict] = []  # one dict per backward pass since the last sum: param -> its .grad
        self.open = False  # a backward pass is running (its end-of-pass callback is queued)
        self.handles: list = []
        self.hooked: set[int] = set()
        self.stacks: dict = {}  # dtype -> the units' stack of the last sum (reused while its shape holds)
        self.hook_params()

    def hook_params(self) -> None:
        """A hook on every parameter with ``requires_grad`` not hooked yet (also after ``add_param_group``)."""
        params = [p for group in self.inner.param_groups for p in group["params"]]
        check_params(params)
        ref = weakref.ref(self)
        for p in params:
            if p.requires_grad and id(p) not in self.hooked:
                self.hooked.add(id(p))
                self.handles.append(p.register_post_accumulate_grad_hook(_make_hook(ref)))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.hooked.clear()
        self.passes.clear()
        self.stacks.clear()

    def take(self, param) -> None:
        if not self.open:
            from torch.autograd import Variable

            self.open = True
            self.passes.append({})
            ref = weakref.ref(self)
            Variable._execution_engine.queue_callback(lambda: _end_of_pass(ref))
        self.passes[-1][param] = param.grad
        param.grad = None

    def sum(self) -> None:
        """Every rank's units since the last sum, summed (or averaged) into ``.grad``: collective, one
        ``allreduce_units`` per dtype. Gradients put into ``.grad`` by other means than ``backward()`` (by
        hand) count as one more unit."""
        torch = _torch()
        params = [p for group in self.inner.param_groups for p in group["params"] if p.requires_grad]
        passes, self.passes = self.passes, []
        left = {p: p.grad for p in params if p.grad is not None}
        if left:
            passes.append(left)
        groups: dict = {}  # dtype -> its parameters, in param_groups order
        for p in params:
            groups.setdefault(p.dtype, []).append(p)
        with torch.no_grad():
            for dtype in sorted(groups, key=str):  # the same order on every rank
                ps = groups[dtype]
                sizes = [p.numel() for p in ps]
                n = sum(sizes)
                # one row per unit: the parameters' gradients, then one presence column per parameter (in
                # the buffer of the last step of the same shape: new memory of some MB costs its page faults
                # at every step, about a third of what the sum itself costs)
                shape = (len(passes), n + len(ps))
                stack = self.stacks.get(dtype)
                if stack is None or tuple(stack.shape) != shape:
                    stack = self.stacks[dtype] = torch.empty(shape, dtype=dtype)
                for row, unit in zip(stack, passes):
                    offset = 0
                    for j, (p, size) in enumerate(zip(ps, sizes)):
                        g = unit.get(p)
                        if g is not None:
                            row[offset:offset + size].copy_(g.reshape(-1))
                            row[n + j] = 1
                        else:
                            row[offset:offset + size].zero_()
                            row[n + j] = 0
                        offset += size
                total = allreduce_units(stack, self.op, comm=self.comm)
                present = total[n:] > 0  # NaN (a mean of no unit anywhere) is not present
                offset = 0
                for j, (p, size) in enumerate(zip(ps, sizes)):
                    # (.to: a CUDA parameter's sum back to its device; the same tensor for a CPU one)
                    p.grad = total[offset:offset + size].view(p.shape).to(p.device) if bool(present[j]) else None
                    offset += size


def sum_units(units, params, op: str, comm):
    """The reproducible sum (``op``: sum or mean) over every rank's list of gradient trees ``units`` (one per
    micro-batch of this rank, possibly none), as one tree of ``params``' structure (or the first unit's):
    collective, one ``allreduce_units`` per dtype."""
    if not isinstance(units, (list, tuple)):
        raise TypeError(f"with reproducible=True, update() takes this rank's units: a list of gradient trees, one "
                        f"per micro-batch (possibly empty), got {type(units).__name__}; pass [grads] for one")
    template = params if params is not None else (units[0] if units else None)
    if template is None:
        raise ValueError("update([], state) needs params (update([], state, params)): a rank without units "
                         "learns the gradient tree's structure from them")
    flat = flatten(template)
    leaves = flat.leaves
    rows = []
    for i, unit in enumerate(units):
        got = flatten(unit)
        if got.sig != flat.sig or len(got.leaves) != len(leaves):
            raise ValueError(f"unit {i} of update()'s list is not a gradient tree of the parameters' structure "
                             f"({len(got.leaves)} leaves, expected {len(leaves)})")
        rows.append([None if g is None else np.asarray(g) for g in got.leaves])
    groups: dict = {}  # dtype name -> the indices of its array leaves
    for j, leaf in enumerate(leaves):
        if leaf is not None and is_array(leaf):
            groups.setdefault(np.asarray(leaf).dtype, []).append(j)
    out: list = [None] * len(leaves)
    for dtype in sorted(groups, key=str):  # the same order on every rank
        idx = groups[dtype]
        shapes = [np.shape(leaves[j]) for j in idx]
        sizes = [math.prod(s) for s in shapes]
        stack = np.empty((len(rows), sum(sizes)), dtype=dtype)
        for r, row in enumerate(rows):
            offset = 0
            for j, size in zip(idx, sizes):
                g = row[j]
                if g is None or g.shape != np.shape(leaves[j]):
                    raise ValueError(f"unit {r} of update()'s list: leaf {flat.paths[j]} has shape "
                                     f"{None if g is None else g.shape}, expected {np.shape(leaves[j])}")
                stack[r, offset:offset + size] = g.reshape(-1)
                offset += size
        total = allreduce_units(stack, op, comm=comm)
        offset = 0
        for j, shape, size in zip(idx, shapes, sizes):
            out[j] = _like(leaves[j], total[offset:offset + size].reshape(shape))
            offset += size
    return unflatten(flat, out)


def _like(leaf, value: np.ndarray):
    """``value`` (NumPy) as an array of ``leaf``'s library."""
    if isinstance(leaf, np.ndarray):
        return value
    try:
        from array_api_compat import array_namespace

        return array_namespace(leaf).asarray(value)
    except Exception:  # noqa: BLE001 - a library array_api_compat does not know: NumPy's array
        return value

"""What torch hands the backend, read and checked: torch's reduction ops as ours (AVG of integers as
torch's NCCL backend computes it), and the argument checks that refuse what gloo refuses."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from .. import _call

_R: Any = dist.ReduceOp.RedOpType  # Any: torch's stubs do not list its members (SUM, ..., PREMUL_SUM)
_OPS = {_R.SUM: "sum", _R.PRODUCT: "prod", _R.MIN: "min", _R.MAX: "max", _R.AVG: "mean"}


def _op(reduce_op) -> tuple[str, object]:
    """``(our op name, PREMUL_SUM's factor or None)`` for a torch ``ReduceOp`` (or its ``RedOpType``)."""
    kind = reduce_op if isinstance(reduce_op, _R) else reduce_op.op  # ReduceOp.SUM is a RedOpType
    if kind == _R.PREMUL_SUM:
        return "sum", reduce_op.factor
    name = _OPS.get(kind)
    if name is None:
        raise ValueError(f"the collectives backend has no reduction {kind.name} (it reduces with SUM, PRODUCT, "
                         f"MIN, MAX, AVG and PREMUL_SUM); for bitwise and/or on bool tensors use MIN/MAX")
    return name, None


_OWN_NAMES = {_R.AVG: "avg", _R.PREMUL_SUM: "premul_sum"}  # torch's ops that run as one of ours, differently


def _describing_op(at: int):
    """A reduction method whose ``opts`` is its argument ``at``: the calls it makes are described with torch's
    op where torch's op is not one of ours (``AVG``: a mean, or a truncated sum of integers; ``PREMUL_SUM``:
    a sum of scaled tensors), so that AVG on one rank and SUM on another are a MismatchError (``_call``)."""

    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            opts = kwargs["opts"] if "opts" in kwargs else args[at] if len(args) > at else None
            reduce_op = _opts_op(opts)
            kind = reduce_op if isinstance(reduce_op, _R) else getattr(reduce_op, "op", None)
            named = _OWN_NAMES.get(kind)
            if named is None:
                return method(self, *args, **kwargs)
            with _call.naming(named):
                return method(self, *args, **kwargs)

        return run

    return wrap


def _one(tensors, what: str):
    if isinstance(tensors, torch.Tensor):
        return tensors
    if len(tensors) != 1:
        raise ValueError(f"{what}: the collectives backend takes one tensor per process (torch's single-device "
                         f"form), got a list of {len(tensors)}")
    return tensors[0]


def _same_shapes(what: str, reference: torch.Tensor, tensors, role: str) -> None:
    for i, t in enumerate(tensors):
        if t.shape != reference.shape or t.dtype != reference.dtype:
            raise ValueError(f"{what}: every {role} must have the input's shape {tuple(reference.shape)} and dtype "
                             f"{reference.dtype} (the collectives backend moves equal blocks), got "
                             f"{tuple(t.shape)} {t.dtype} at index {i}")


def _integer_mean(op: str, t) -> bool:
    """AVG of an integer tensor: torch's NCCL backend sums and divides, truncating toward zero (Lightning
    averages an int64 batch count so, on every backend but gloo); our own ``op="mean"`` refuses integers."""
    return op == "mean" and not (t.is_floating_point() or t.is_complex()) and t.dtype != torch.bool


def _truncated(t, n: int) -> None:
    """``t //= n`` toward zero, in place (C's and NCCL's integer division, not Python's floor)."""
    torch.div(t, n, rounding_mode="trunc", out=t)


def _same_dtype(what: str, output, input) -> None:
    """gloo's rule: the output tensor has the input's dtype (never a silent cast)."""
    if output.dtype != input.dtype:
        raise TypeError(f"{what}: the output tensor's dtype {output.dtype} must be the input's {input.dtype} "
                        f"(the collectives backend does not cast, as gloo does not)")


def _opts_op(opts):
    if opts is None:
        return dist.ReduceOp.SUM
    if isinstance(opts, (dist.ReduceOp, _R)):
        return opts
    return opts.reduceOp


def _split_rows(output, input, output_split_sizes, input_split_sizes, n: int) -> list[list[int]]:
    """all_to_all_single's arguments checked (gloo's checks, in its words): ``[rows sent to each rank,
    rows received from each rank]`` for a group of ``n`` ranks."""
    _same_dtype("all_to_all_single", output, input)
    rows = []
    for name, splits, t in (("input", input_split_sizes, input), ("output", output_split_sizes, output)):
        if t.dim() == 0:
            raise ValueError(f"all_to_all_single: the {name} must have a leading dimension, got a scalar")
        if splits:  # gloo's checks, in its words
            if len(splits) != n:
                raise ValueError(f"all_to_all_single: {name}_split_sizes={list(splits)} has {len(splits)} "
                                 f"entries for a group of {n} ranks (Number of tensor splits not equal to "
                                 f"group size)")
            if min(splits) < 0:
                raise ValueError(f"all_to_all_single: {name}_split_sizes={list(splits)} has a negative size")
            if sum(splits) != t.shape[0]:  # gloo: "Split sizes doesn't match total dim 0 size"
                raise ValueError(f"all_to_all_single: {name}_split_sizes={list(splits)} add up to "
                                 f"{sum(splits)}, but the {name}'s dim 0 is {t.shape[0]} (Split sizes doesn't "
                                 f"match total dim 0 size)")
            rows.append([int(r) for r in splits])
        else:
            if t.shape[0] % n:
                raise ValueError(f"all_to_all_single: the {name}'s leading dimension must be divisible by the "
                                 f"group's size {n} where no {name}_split_sizes are given, got shape "
                                 f"{tuple(t.shape)}")
            rows.append([t.shape[0] // n] * n)
    if output.shape[1:] != input.shape[1:]:
        raise ValueError(f"all_to_all_single: the output's shape {tuple(output.shape)} must be the input's "
                         f"{tuple(input.shape)} but for dim 0")
    return rows

"""The torch optimizer's gradients averaged without buckets (``overlap=False``, and no sharded state or
compression): every ``p.grad`` in one fused :func:`allreduce_tree` at ``step()`` (or
``average_gradients()``), parameters in ``param_groups`` order."""

from __future__ import annotations

from .. import _agree
from .._comm import allreduce_tree


def average(inner, op: str, comm, bucket_bytes, missing_grads: str) -> None:
    """Average (``op``) every ``.grad`` of ``inner``'s parameters over ``comm``, in place where it can be
    written (else ``p.grad`` is the new tensor); with ``missing_grads="zero"`` a gradient that some ranks
    lack counts as zeros there (:func:`zero_missing`)."""
    if missing_grads == "zero":
        zero_missing(inner, comm)
    params = [p for group in inner.param_groups for p in group["params"]]
    tree = {"param_groups": [[p.grad for p in group["params"]] for group in inner.param_groups]}
    out = allreduce_tree(tree, op, comm=comm, bucket_bytes=bucket_bytes)
    if out is not tree:  # a gradient that could not be written in place came back as a new tensor
        grads = [g for group in out["param_groups"] for g in group]
        for p, g in zip(params, grads):
            if g is not p.grad:
                p.grad = g


def zero_missing(inner, comm) -> None:
    """A parameter of ``inner`` with a gradient on some ranks only gets zeros where it has none (one object
    allgather of who lacks which)."""
    if comm.size == 1:
        return
    params = [p for group in inner.param_groups for p in group["params"]]
    mine = [i for i, p in enumerate(params) if p.grad is None]
    lists = _agree.gather(comm, mine)
    counts: dict[int, int] = {}
    for indices in lists:
        for i in indices:
            counts[i] = counts.get(i, 0) + 1
    import torch

    for i in mine:
        if counts[i] < comm.size:
            params[i].grad = torch.zeros_like(params[i])

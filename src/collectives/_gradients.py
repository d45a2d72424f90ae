"""What every torch gradient path of the DistributedOptimizer shares, with or without buckets.

- the gradient communicator (:func:`grad_comm`: one ``split`` per communicator, so that a collective the
  user calls between backward and ``step()`` never meets a gradient collective another rank has not sent);
- the names of the gradient modes (:data:`MISSING_GRADS`, :data:`COMPRESSIONS`) and the narrow dtypes;
- the one-byte meeting of a sharded optimizer's ``state_dict()``, and the error that names it
  (:func:`meeting_named`);
- torch.amp's step over averaged gradients (:func:`amp_step`);
- who lacks which gradient, when some rank lacks one (:func:`missing_report`).

Used by ``_optim`` (the optimizer) and ``_overlap`` (its gradient buckets); torch is the caller's, imported
by them before anything here runs.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

from . import _agree, _call
from ._comm import engine_of
from ._errors import CollectiveError, MismatchError

MISSING_GRADS = ("error", "zero")

# The layout the one-byte meeting of a sharded optimizer's state_dict()/add_param_group() is described with
# (_call.naming): the gradient buckets of ranks that went on meet it on the gradient communicator, and the
# fingerprint's MismatchError names this code (see meeting_named).
MEETING = _call.structure_code("DistributedOptimizer", "state_dict meeting")


@contextlib.contextmanager
def meeting_named():
    """Raise a CollectiveError of the gradient communicator that names :data:`MEETING` (the fingerprint's
    mismatch, or a later call's "unusable" that quotes it) again as the MismatchError that says what
    happened: some ranks met in ``state_dict()``/``add_param_group()`` while the others went on to their
    next step's gradient collectives (Horovod's rank-0 checkpoint with sharded state). Every rank raises
    it: the meeting's ranks there, the others in backward's buckets or ``step()``."""
    try:
        yield
    except CollectiveError as exc:
        if f"{MEETING:#x}" in str(exc):
            raise MismatchError(
                "DistributedOptimizer(shard_state=True): some ranks called state_dict() or add_param_group(), "
                "which are collective (every rank must call them), while the others went on to their next "
                "step's gradient collectives. Horovod's rank-0 checkpoint (`if rank == 0: "
                "torch.save(opt.state_dict())`) cannot work with sharded state: call `sd = opt.state_dict()` on "
                "every rank, then save `sd` on rank 0 only. The optimizer's communicator is failed for good "
                f"(end the job). ({exc})") from exc
        raise


def grad_comm(comm):
    """The communicator the gradient collectives of ``comm``'s optimizers run on: one ``split`` of it,
    made on first use (collective: every rank makes its first DistributedOptimizer on ``comm`` together)
    and shared by every optimizer on ``comm`` after that. One rank: ``comm`` itself."""
    if comm.size == 1:
        return comm
    return engine_of(comm).derived("gradients", lambda: comm.split(0, comm.rank))  # closed with comm


def torch_module():
    """torch, which the optimizer that needs this module has imported (``import collectives`` does not)."""
    return sys.modules["torch"]


def COMPRESSIBLE() -> tuple:
    """The gradient dtypes compression narrows (wider than the narrow types)."""
    torch = torch_module()
    return (torch.float32, torch.float64)


COMPRESSIONS = ("fp16", "bf16")


def compression_dtype(name):
    """The torch dtype of a ``compression`` name (``None``: none)."""
    if name is None:
        return None
    torch = torch_module()
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


def describe(p) -> str:
    """A parameter as an error message names it: dtype and shape."""
    return f"{str(p.dtype).replace('torch.', '')} {tuple(p.shape)}"


def amp_step(opt, amp, grads_of: Callable, step: Callable | None = None):
    """``opt.step()`` as torch.amp.GradScaler would run it on a plain optimizer whose gradients are what
    ``grads_of()`` gives (the averaged ones: the same on every rank, so every rank decides alike).

    An optimizer that unscales itself (fused Adam: ``_step_supports_amp_scaling``) gets ``grad_scale`` and
    ``found_inf`` as the scaler hands them; for any other, the gradients are unscaled with the scaler's own
    reciprocal and kernel (unless ``scaler.unscale_`` did it), and the step is skipped when ``found_inf``
    is set. ``step`` replaces ``opt.step`` (the sharded step, which also gathers the parameters)."""
    run = opt.step if step is None else step
    if amp is None:
        return run()
    torch = torch_module()
    scale, found_inf = amp
    if getattr(opt, "_step_supports_amp_scaling", False):
        opt.grad_scale, opt.found_inf = scale, found_inf
        try:
            return run()
        finally:
            del opt.grad_scale, opt.found_inf
    if scale is not None:
        inv = scale.double().reciprocal().float()  # GradScaler.unscale_'s reciprocal, in float64
        groups: dict = {}
        for g in grads_of():
            groups.setdefault((g.device, g.dtype), []).append(g)
        with torch.no_grad():
            for (device, _), grads in groups.items():
                flag = torch.zeros((), dtype=torch.float32, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv.to(device))
    if found_inf.item():
        return None
    return run()


def missing_report(comm, slots, mode: str) -> tuple[dict, set]:
    """Some rank lacks some gradient: who lacks which (one object allgather; every rank takes this branch
    together). ``slots``: the parameters (``index``, ``name``, ``param``, ``missing``: no gradient here).
    Returns ``(partial, skipped)``: the parameters without gradient on some ranks only (index -> those ranks),
    to be given zeros where ``mode`` is "zero", and the indices of those without gradient anywhere (left as
    they are). With ``mode`` "error" a partial one is a :class:`MismatchError` naming it, on every rank."""
    mine = [s.index for s in slots if s.missing]
    lists = _agree.gather(comm, mine)
    size = comm.size
    lacking: dict[int, list[int]] = {}
    for r, indices in enumerate(lists):
        for i in indices:
            lacking.setdefault(i, []).append(r)
    partial = {i: rs for i, rs in lacking.items() if len(rs) < size}
    if partial and mode == "error":
        by_index = {s.index: s for s in slots}
        lines = []
        for i in sorted(partial):
            s = by_index[i]
            lines.append(f"{s.name}: " + _agree.holding(
                ["None" if r in partial[i] else describe(s.param) for r in range(size)]))
        _agree.refuse(MismatchError(
            "DistributedOptimizer: gradients missing on some ranks only (a parameter this backward pass "
            "did not reach there): " + "; ".join(lines) + ". Nothing was updated. A model whose graph "
            "differs between ranks needs DistributedOptimizer(opt, missing_grads=\"zero\") (the ranks "
            "without a gradient contribute zeros)"))
    return partial, {i for i, rs in lacking.items() if len(rs) == size}

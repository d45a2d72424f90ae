"""Sharded optimizer state over the gradient buckets of ``_overlap.Buckets`` (``shard_state=True``).

Every parameter starts at a multiple of ``ALIGN`` elements of its bucket, every bucket is padded to a
multiple of ``ALIGN`` times the number of ranks, and rank r owns the r-th block of each. After the
reduce-scatter every rank steps, with an optimizer of the user's class and hyper-parameters, its pieces of
the parameters, each a view of one flat tensor per (group, dtype, device) that holds its blocks, and the
parameters come back by one allgather per bucket.

``full_state``/``load_full`` turn the shards into the unsharded optimizer's ``state`` and back
(collective), so that a checkpoint does not depend on the number of ranks.
"""

from __future__ import annotations

from . import _agree
from ._gradients import amp_step, torch_module as _torch

# The torch optimizers whose update of an element depends only on that element's own gradient and state
# (and on scalars: the step count, the hyper-parameters): stepping a flat shard of the parameters gives
# every element what stepping the parameters would.
# With sharded state every parameter starts at a multiple of ALIGN elements of its bucket and every rank's
# block is a multiple of ALIGN long, so each piece of a parameter that a rank steps begins at a multiple of
# ALIGN of the parameter and ends at one or at the parameter's end. Stepped as a tensor of its own, a piece
# then has its vector body and scalar tail where the whole parameter has them (CPU kernels compute the
# last numel % width elements with scalar code, which rounds differently in some kernels: fused Adam):
# 64 elements is a multiple of every vector width (16 float32, 32 bfloat16 with AVX-512) and cache line.
ALIGN = 64

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam",
               "ASGD")


def check_shardable(inner) -> None:
    """TypeError unless ``inner`` is one of the element-wise torch optimizers (before anything is made)."""
    name = type(inner).__name__
    if not (type(inner).__module__.startswith("torch.optim") and name in ELEMENTWISE):
        raise TypeError(
            f"shard_state=True needs an element-wise optimizer (each element's update depends only on its "
            f"own gradient and state): torch.optim's {', '.join(ELEMENTWISE)}; got "
            f"{type(inner).__module__}.{type(inner).__qualname__}. Use shard_state=False for it")


class Shards:
    """Sharded optimizer state over the flat buckets of a :class:`Buckets` (see the module docstring).

    Rank r owns elements ``r * c .. (r + 1) * c`` of every bucket (``c = padded / size``). Its shard
    tensors, one per (parameter group, dtype, device), hold its blocks of all the group's buckets one after
    the other (and their gradients); ``opt`` is an optimizer of the inner optimizer's class over the
    *pieces* of parameters in them (a view of the shard tensor per parameter piece, so that each is stepped
    as a tensor of its own: see ``ALIGN``), one param group per shard tensor, with the hyper-parameters of
    the inner group (copied before every step, so LR schedulers given ``inner`` work).
    """

    def __init__(self, engine):  # an _overlap.Buckets (not imported: it imports this module)
        torch = _torch()
        inner = engine.inner
        check_shardable(inner)
        self.engine = engine
        comm = engine.comm
        self.size, self.rank = comm.size, comm.rank
        self.tensors = []  # shard tensors, one per (group, dtype, device)
        self.groups: list = []  # the inner group index of each shard tensor
        keyed: dict = {}
        for b in engine.buckets:
            c = b.padded // self.size
            b.lo = self.rank * c
            k = keyed.get(b.key)
            if k is None:
                k = keyed[b.key] = len(self.groups)
                self.groups.append((b.group, b.key, []))
            _, _, members = self.groups[k]
            b.shard_off = sum(m.padded // self.size for m in members)
            b.shard_k = k
            members.append(b)
        self.skipped: set = set()  # this round's parameters without gradient on every rank
        self.from_grads = False  # average_gradients() put the reduction back into .grad
        self.pieces = []  # (shard tensor index, position in it, slot, start in the parameter, count)
        for k, (_, key, members) in enumerate(self.groups):
            n = sum(b.padded // self.size for b in members)
            t = torch.zeros(n, dtype=key[1], device=key[2])
            t.grad = torch.zeros_like(t)
            self.tensors.append(t)
            for b in members:
                c = b.padded // self.size
                lo, hi = b.lo, b.lo + c
                for s in b.slots:
                    a, z = max(s.offset, lo), min(s.offset + s.numel, hi)
                    if a < z:
                        self.pieces.append((k, b.shard_off + a - lo, s, a - s.offset, z - a))
        self.params = []  # per piece: the view of its shard tensor that the shard optimizer steps
        for k, pos, _, _, n in self.pieces:
            v = self.tensors[k][pos:pos + n]
            v.grad = self.tensors[k].grad[pos:pos + n]
            self.params.append(v)
        groups = []
        for k, (g, _, _) in enumerate(self.groups):
            hyper = {key: v for key, v in inner.param_groups[g].items() if key not in ("params", "param_names")}
            groups.append({"params": [v for v, piece in zip(self.params, self.pieces) if piece[0] == k], **hyper})
        if not self.params and groups:  # every block of this rank is padding: an empty piece, so that the
            empty = self.tensors[0][:0]  # optimizer can be made (torch refuses one without parameters)
            empty.grad = self.tensors[0].grad[:0]
            groups[0]["params"] = [empty]
        cls = type(inner)
        try:
            self.opt = cls(groups, **inner.defaults)
        except TypeError:
            self.opt = cls(groups)
        if inner.state:  # state held before wrapping (or made at construction, as Adagrad's): sharded
            self.load_full(inner.state_dict())

    def _sync_hyper(self) -> None:
        inner_groups = self.engine.inner.param_groups
        for k, (g, _, _) in enumerate(self.groups):
            mine = self.opt.param_groups[k]
            for key, v in inner_groups[g].items():
                if key not in ("params", "param_names"):
                    mine[key] = v

    def take_gradients(self, skipped: set) -> None:
        """After the reduce-scatter: this rank's blocks into the shard gradients."""
        torch = _torch()
        self.skipped = skipped
        with torch.no_grad():
            for b in self.engine.buckets:
                c = b.padded // self.size
                self.tensors[b.shard_k].grad[b.shard_off:b.shard_off + c].copy_(b.block.reshape(-1))
                b.block = None

    def agree_finite(self) -> None:
        """The inf/NaN decision alike on every rank (one 8-byte allreduce: an ``_agree.Ballot``): GradScaler looks for inf/NaN
        in ``.grad``, which holds this rank's own gradients, while the step uses the averaged share. When
        the averaged gradient is not finite on some rank's share, every rank's ``.grad`` gets an inf (in its first
        element: the sharded step reads its averaged share, never ``.grad``), as the averaged ``.grad`` of DDP
        would hold one on every rank: every rank's GradScaler then skips the step and backs off alike.
        (A rank whose own gradients hold an inf or a NaN puts it in the average of some rank's share.)"""
        if self.size == 1:
            return
        torch = _torch()
        bad = 0
        for t in self.tensors:
            g = t.grad
            # a sum is not finite when an element is not (or when the sum overflows: then look closer)
            if not bool(torch.isfinite(g.sum())) and not bool(torch.isfinite(g).all()):
                bad = 1
                break
        if not _agree.Ballot({"not finite": "any"}).combine(self.engine.comm, {"not finite": bad})["not finite"]:
            return
        with torch.no_grad():
            for s in self.engine.slots:  # (the sharded step reads its share, never .grad)
                g = s.param.grad
                if g is not None and g.numel() and s.index not in self.skipped:
                    g[(0,) * g.dim()] = float("inf")
                    return

    def gather_gradients(self) -> None:
        """average_gradients(): the reduced blocks back into every ``.grad`` (one allgather per bucket);
        the next step takes this rank's blocks from ``.grad`` again (after the user's clipping)."""
        torch = _torch()
        comm = self.engine.comm
        skipped = self.skipped
        with torch.no_grad():
            handles = [comm.allgather(self._grad_block(b), async_op=True) for b in self.engine.buckets]
            for b, h in zip(self.engine.buckets, handles):
                b.flat.copy_(h.wait().reshape(-1))
                for s in b.slots:
                    if s.index in skipped:
                        continue
                    g = s.param.grad
                    if g is None:
                        s.param.grad = s.view if self.engine.views else s.view.clone()
                    elif g is not s.view:
                        g.copy_(s.view)
        self.from_grads = True

    def _grad_block(self, b):
        c = b.padded // self.size
        return self.tensors[b.shard_k].grad[b.shard_off:b.shard_off + c]

    def step(self, closure=None, amp=None):
        torch = _torch()
        if amp is not None and amp[0] is None and not self.from_grads:
            raise RuntimeError(
                "DistributedOptimizer(shard_state=True): scaler.unscale_(opt) unscaled .grad, which holds this "
                "rank's own gradients, not the averaged share the sharded step uses. Call "
                "opt.average_gradients() before scaler.unscale_(opt) (it gathers the average into .grad, for "
                "clipping), or leave the unscaling to scaler.step(opt)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyper()
        skipped = self.skipped
        with torch.no_grad():
            if self.from_grads:  # average_gradients() gathered them; the user may have changed .grad since
                for b in self.engine.buckets:
                    for s in b.slots:
                        g = s.param.grad
                        if g is not None and g is not s.view:
                            s.view.copy_(g)
                    self._grad_block(b).copy_(b.flat[b.lo:b.lo + b.padded // self.size])
                self.from_grads = False
            for k, pos, s, start, n in self.pieces:  # the parameters' current values (the user may have set them)
                self.tensors[k][pos:pos + n].copy_(s.param.detach().reshape(-1)[start:start + n])
        # a parameter without gradient anywhere is left as it is, state included (as the unsharded optimizer
        # leaves a parameter whose .grad is None): its pieces have none in this step
        dropped = [(v, v.grad) for v, piece in zip(self.params, self.pieces) if piece[2].index in skipped]
        for v, _ in dropped:
            v.grad = None
        try:
            amp_step(self.opt, amp, lambda: [t.grad for t in self.tensors], step=self._step_and_gather)
        finally:
            for v, g in dropped:
                v.grad = g
        self.skipped = set()
        return loss

    def _step_and_gather(self) -> None:
        """The shard optimizer's step, then the parameters back from every rank's share (one allgather per
        bucket)."""
        torch = _torch()
        skipped = self.skipped
        self.opt.step()
        self.engine.inner._opt_called = True  # an LR scheduler given inner: its step() counts as stepped
        with torch.no_grad():
            for s in self.engine.slots:
                if s.index not in skipped:
                    s.stepped = True
            comm = self.engine.comm
            handles = []
            for b in self.engine.buckets:
                c = b.padded // self.size
                handles.append(comm.allgather(self.tensors[b.shard_k][b.shard_off:b.shard_off + c], async_op=True))
            for b, h in zip(self.engine.buckets, handles):
                full = h.wait().reshape(-1)
                for s in b.slots:
                    if s.index not in skipped:
                        s.param.detach().copy_(full[s.offset:s.offset + s.numel].view(s.param.shape))

    # ---- state dicts ----
    def full_state(self) -> dict:
        """The unsharded optimizer's ``state`` (parameter index -> state), on every rank (collective: one
        object allgather, then one allgather per bucket and element-wise state entry)."""
        torch = _torch()
        comm = self.engine.comm
        # what each parameter's state holds, in its order: an element-wise entry by its dtype, any other
        # (the step count) by its value, from this rank's first piece of it; every rank's, merged
        mine: dict = {}
        for v, (_, _, s, _, _) in zip(self.params, self.pieces):
            state = self.opt.state.get(v)
            if state and s.index not in mine:
                mine[s.index] = [(name, ("elementwise", str(x.dtype)) if _elementwise(name, x, v) else ("value", x))
                                 for name, x in state.items()]  # (values are cloned into the result below)
        entries: dict = {}
        for theirs in _agree.gather(comm, mine):  # every rank merges the same list: the same entries
            for index, items in theirs.items():
                entries.setdefault(index, items)
        out: dict = {}
        for b in self.engine.buckets:
            c = b.padded // self.size
            names: dict = {}
            for s in b.slots:
                for name, (kind, what) in entries.get(s.index, ()):
                    if kind == "elementwise":
                        names.setdefault(name, getattr(torch, what.split(".")[-1]))
            here = [(self.opt.state.get(v, {}), pos - b.shard_off, n)
                    for v, (_, pos, s, _, n) in zip(self.params, self.pieces) if s.bucket is b]
            gathered = {}
            for name, dtype in names.items():
                block = torch.zeros(c, dtype=dtype, device=b.key[2])
                for state, at, n in here:
                    if name in state:
                        block[at:at + n].copy_(state[name])
                gathered[name] = comm.allgather(block).reshape(-1)
            for s in b.slots:
                if not s.stepped or s.index not in entries:
                    continue
                out[s.index] = {
                    name: gathered[name][s.offset:s.offset + s.numel].view(s.param.shape).clone()
                    if kind == "elementwise" else (what.clone() if torch.is_tensor(what) else what)
                    for name, (kind, what) in entries[s.index]}
        return out

    def load_full(self, state_dict: dict) -> None:
        """Take this rank's pieces of an unsharded ``state_dict`` (the inner optimizer's format)."""
        torch = _torch()
        inner = self.engine.inner
        inner.load_state_dict(state_dict)  # ids, hyper-parameters, dtype and device casts: torch's own rules
        params = [p for group in inner.param_groups for p in group["params"]]
        full = {i: inner.state[p] for i, p in enumerate(params) if p in inner.state}
        for s in self.engine.slots:
            s.stepped = s.index in full
        self.opt.state.clear()
        with torch.no_grad():
            for v, (_, _, s, start, n) in zip(self.params, self.pieces):
                entry = full.get(s.index)
                if entry is None:
                    continue
                self.opt.state[v] = {
                    name: x.reshape(-1)[start:start + n].clone() if _elementwise(name, x, s.param) else
                    (x.clone() if torch.is_tensor(x) else x) for name, x in entry.items()}
        inner.state.clear()  # the full state is not kept: this rank's pieces are

    def state_bytes(self) -> int:
        """Bytes of tensors in this rank's shard optimizer state."""
        torch = _torch()
        return sum(v.numel() * v.element_size() for st in self.opt.state.values() for v in st.values()
                   if torch.is_tensor(v))


def _elementwise(name: str, v, param) -> bool:
    """Whether a per-parameter state entry is element-wise (one value per element of the parameter)."""
    torch = _torch()
    return name != "step" and torch.is_tensor(v) and v.shape == param.shape

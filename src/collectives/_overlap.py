"""The torch DistributedOptimizer's gradient buckets: reduction during backward, views, sharded state.

:class:`Buckets` is the engine of a :class:`~collectives._optim.TorchDistributedOptimizer` made with
``overlap=True`` or ``shard_state=True``:

- **layout**: the optimizer's parameters, in *reverse* ``param_groups`` order (the order backward
  produces their gradients), are laid out in flat buffers, one per (parameter group, dtype, device), each
  at most ``bucket_bytes``; a parameter of ``_buckets.solo_bytes(bucket_bytes)`` bytes or more (256 KiB,
  as for ``allreduce_tree``'s solo leaves) gets a bucket of its own (without sharded state). The ranks
  agree on the layout when it is made (one 17-byte allgather, ``_agree``): different models are a
  MismatchError on every rank, never an exchange of unrelated gradients;
- **hooks**: a post-accumulate-grad hook per parameter with ``requires_grad`` marks it ready (a frozen
  parameter is not waited for; it gets its hook when unfrozen, from the next round); when every such
  parameter of a bucket is ready, and every bucket before it has left, the bucket leaves: its gradients
  are copied into the flat buffer (unless ``.grad`` already *is* its view of the buffer) and an
  asynchronous ``allreduce`` (``reduce_scatter`` with sharded state) of the buffer starts. The blocking
  allreduce is taken instead where nothing could overlap with the asynchronous one: for the last bucket
  (backward is done), and, when every rank is on one node, for every host bucket (the ranks' own CPUs
  reduce it, in node-shared memory or in MPI's shared-memory transport, and only inside their MPI calls:
  measured, the asynchronous form only finishes later, and starting and testing it costs more than the
  blocking call). Buckets always leave in the same order on every rank.
  The first hook of a backward pass queues autograd's final callback, which completes the round
  (:meth:`Buckets.finish`: the buckets that did not leave go, everything is waited for) before
  ``backward()`` returns, as DDP does; ``step()`` completes a round no hook started (gradients set by
  hand);
- **solo parameters**: a bucket of one parameter (a large one, or one alone between two large ones) is
  reduced in the parameter's own ``.grad`` when that is a plain dense tensor: no buffer and no copy,
  whatever ``zero_grad`` did (a view would save the same copy, but keeping ``.grad`` alive across steps
  makes backward add into it instead of handing it over: one more pass per step);
- **views**: with ``grad_views=True`` each parameter's ``.grad`` (of a bucket of several) is then pointed
  at its view of the buffer (DDP's ``gradient_as_bucket_view``), so later backward passes accumulate straight into the
  buffer and neither the copy in nor the copy out is needed; a ``.grad`` that is not the view (``None``
  after ``zero_grad(set_to_none=True)``, or a tensor the user assigned) is detected at the next departure
  and copied in (one copy, then it is the view again);
- **missing gradients**: after the buckets, one 24-byte allreduce tells whether a parameter that requires
  grad lacks a gradient somewhere, or the frozen ones without gradient differ between ranks. When so
  (rare), one object allgather tells every rank which rank lacks which: a parameter without gradient
  everywhere is skipped (its ``.grad`` stays ``None``); one without gradient on some ranks only is a
  :class:`MismatchError` naming it on every rank (raised by ``step()``), or, with
  ``missing_grads="zero"``, those ranks contribute zeros;
- **sharded state**: ``_shards.Shards`` (its module docstring).

- **rounds**: a backward pass after a round completed (before ``step()``) starts a new round over ``.grad`` as
  torch accumulated it (as DDP reduces every backward pass); the first hook of a round checks that the
  parameters' dtype, device and shape are those of the layout, else the buckets are laid out anew in
  ``finish()`` (``model.double()`` after wrapping);
- **compression** (a narrow dtype): a float32/float64 bucket is padded to a multiple of the number of ranks
  and leaves as an alltoall of its narrow blocks; ``finish()`` adds each rank's block in float32, divides,
  rounds once to the narrow dtype and allgathers (sharded state keeps the block);
- **AMP**: :func:`amp_step` runs the step as torch.amp.GradScaler would over the gradients the step uses;
  with sharded state the end of backward agrees whether any rank's averaged share is not finite
  (:meth:`Shards.agree_finite`), so that every rank's scaler decides alike.

The gradient collectives run on a communicator of their own (one ``split`` of the optimizer's, made once
per communicator), so a collective the user calls between backward and ``step()`` never meets a bucket
that another rank has not sent yet.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from . import _agree, _call
from ._comm import engine_of
from ._buckets import assign, solo_bytes
from ._errors import MismatchError, NonFiniteError
from ._gradients import COMPRESSIBLE, amp_step, describe, meeting_named, missing_report, torch_module as _torch
from ._handles import Handle
from ._shards import ALIGN, Shards

_MAIN = threading.main_thread()


class _Slot:
    """One parameter in a bucket: elements ``offset .. offset + numel`` of the bucket's buffer."""

    __slots__ = ("bucket", "counted", "hooked", "index", "inplace", "missing", "name", "numel", "offset", "param",
                 "ready", "stepped", "view")
    # torch is imported when used, so the tensors are typed Any: None until the layout sets them
    view: Any  # a torch.Tensor: this parameter's view into its bucket's flat buffer

    def __init__(self, index, name, param, bucket, offset):
        self.index = index  # position in the optimizer's param_groups order (all groups)
        self.name = name
        self.param = param
        self.bucket = bucket
        self.offset = offset
        self.numel = param.numel()
        self.view = None
        self.ready = False  # its hook fired in this round
        self.missing = False  # no gradient here when its bucket left
        self.stepped = False  # sharded state: it has been stepped at least once (its state exists)
        self.hooked = False  # its post-accumulate-grad hook is registered
        self.counted = False  # this round waits for its hook
        self.inplace = False  # this round reduces its .grad in place (a solo bucket)


class _Bucket:
    __slots__ = ("block", "blocking", "flat", "group", "handle", "key", "last", "lo", "narrow", "numel", "padded",
                 "pending", "shard_k", "shard_off", "slots", "solo", "structure")
    # torch is imported when used, so these are typed Any; each is None until its phase of the round sets it
    flat: Any  # the bucket's flat torch.Tensor (set by the layout)
    handle: Any  # the Handle of the bucket's reduction in flight (set when the bucket leaves)
    block: Any  # sharded state: this rank's reduced block (set when the reduction is waited)

    def __init__(self, key, group):
        self.key = key
        self.group = group
        self.slots: list[_Slot] = []
        self.numel = 0
        self.padded = 0
        self.flat = None
        self.pending = 0
        self.handle = None
        self.block = None
        self.last = 0
        self.lo = 0
        self.shard_off = 0
        self.shard_k = 0
        self.solo = False
        self.narrow = None  # compression: the dtype its gradients travel in
        self.blocking = False  # reduced by the blocking allreduce when it leaves (see Buckets._reduce)
        self.structure = 0  # the agreed layout and this bucket's place in it (_call.structure_code)

    def buffer(self):
        """The bucket's flat buffer (and its slots' views of it), made on first use."""
        if self.flat is None:
            torch = _torch()
            self.flat = torch.zeros(max(self.padded, 1), dtype=self.key[1], device=self.key[2])[:self.padded]
            for s in self.slots:
                s.view = self.flat[s.offset:s.offset + s.numel].view(s.param.shape)
        return self.flat


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def _end_of_backward(ref) -> None:
    engine = ref()
    if engine is not None:
        engine.end_of_backward()


def _queue_callback(ref) -> None:
    """Run ``engine.end_of_backward()`` when the current backward pass has finished (called in a hook)."""
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(lambda: _end_of_backward(ref))


def _make_hook(ref, index: int):
    def hook(param):  # a post-accumulate-grad hook: param.grad now holds this backward's sum
        engine = ref()
        if engine is not None:
            engine.ready(index)
    return hook


def lay_out(inner, comm, *, op: str, bucket_bytes: int, shard: bool, narrow) -> tuple[list[_Bucket], list[_Slot]]:
    """The buckets (in the order they leave) and slots (in backward's order) of ``inner``'s parameters as they
    are now (their dtype, device and shape), agreed by every rank (collective)."""
    entries = []
    index = 0
    for g, group in enumerate(inner.param_groups):
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            name = f"['param_groups'][{g}][{i}]" + (f" ({names[i]})" if names and i < len(names) else "")
            entries.append((index, name, g, p))
            index += 1
    size = comm.size
    backward = entries[::-1]  # the order backward produces the gradients, about
    nbytes = [p.numel() * p.element_size() for _, _, _, p in backward]
    sharded = [-(-n // (ALIGN * p.element_size())) * ALIGN * p.element_size() for n, (*_, p) in
               zip(nbytes, backward)] if shard else nbytes  # sharded: each slot at a multiple of ALIGN
    buckets: list[_Bucket] = []
    slots: dict[int, _Slot] = {}
    for key, members, _ in assign([(g, p.dtype, p.device) for _, _, g, p in backward], nbytes, sharded,
                                  bucket_bytes, solo_bytes(bucket_bytes) if not (shard or narrow) else None,
                                  runs=True):
        b = _Bucket(key, backward[members[0]][2])  # (its param group); a solo one is reduced in its .grad
        for order in members:
            index, name, _, p = backward[order]
            s = _Slot(index, name, p, b, -(-b.numel // ALIGN) * ALIGN if shard else b.numel)
            b.slots.append(s)
            b.numel = s.offset + s.numel
            b.last = order
            slots[order] = s
        buckets.append(b)
    ordered = [slots[order] for order in range(len(backward))]  # (in backward's order)
    buckets.sort(key=lambda b: b.last)  # they leave in the order backward completes them
    callers_cpus = engine_of(comm).reduces_on_the_callers_cpus()  # every rank on one node
    for b in buckets:
        b.narrow = narrow if narrow is not None and b.key[1] in COMPRESSIBLE() else None
        unit = size * ALIGN if shard else size  # sharded: every rank's block a multiple of ALIGN
        b.padded = -(-b.numel // unit) * unit if shard or b.narrow is not None else b.numel
        b.solo = not shard and b.narrow is None and len(b.slots) == 1
        b.blocking = not shard and b.narrow is None and (b is buckets[-1] or (b.key[2].type == "cpu" and callers_cpus))
        if not b.solo:  # a solo parameter's buffer is made only if ever needed (see _leave)
            b.buffer()
    # The ranks agree on the layout once, here (collective: every rank makes its optimizer together), as
    # allreduce_tree agrees on every tree: ranks whose models differ raise MismatchError on every rank
    # instead of reducing each other's unrelated gradients.
    where = {id(b): i for i, b in enumerate(buckets)}
    layout = tuple((s.name, f"{describe(s.param)} {s.param.device.type} in bucket {where[id(s.bucket)]}")
                   for s in ordered)
    header = (("op", op), ("bucket_bytes", int(bucket_bytes)), ("shard_state", bool(shard)),
              ("compression", str(narrow)))
    _agree.agree(engine_of(comm).host, "DistributedOptimizer", header, layout, checked=False)
    digest = _agree.fingerprint("DistributedOptimizer", header, layout).hex()
    for i, b in enumerate(buckets):  # what the fingerprint beside each bucket's transfer names (_call)
        b.structure = _call.structure_code(digest, i)
    return buckets, ordered


class Buckets:
    """The gradient buckets of one torch optimizer (see the module docstring)."""

    def __init__(self, inner, comm, *, op: str, bucket_bytes: int, hooks: bool, views: bool, missing: str,
                 shard: bool, communicating: bool, compression=None):
        self.inner = inner
        self.compression = compression  # the torch dtype gradients travel in (see _reduce), or None
        self.comm = comm
        self.op = op
        self.views = views
        self.missing_mode = missing
        self.communicating = communicating  # False in the accumulating passes (k-1 of every k)
        self.poisoned: BaseException | None = None
        self.deferred: BaseException | None = None  # a MismatchError of the end of backward, for step()
        self.bucket_bytes = bucket_bytes
        self.shard = shard
        self._layout()
        # whether the ranks agree on the missing gradients (_send_flag): one 24-byte exchange per round
        self.flag = _agree.Ballot({"missing": "any", "frozen": "same"})
        self.flag_handle = None
        self.next = 0
        self.finished = False
        self.shards = Shards(self) if shard else None
        self.with_hooks = hooks
        self.hooks: list = []
        self._ref = weakref.ref(self)
        # Hooks leave with the engine (the wrapper dropped): they hold it only weakly.
        self._finalizer = weakref.finalize(self, _remove_hooks, self.hooks)
        self._reset()

    def _layout(self) -> None:
        """The buckets and slots of the parameters as they are now (:func:`lay_out`: collective)."""
        self.buckets, self.slots = lay_out(self.inner, self.comm, op=self.op, bucket_bytes=self.bucket_bytes,
                                           shard=self.shard, narrow=self.compression)
        self.by_index = {s.index: s for s in self.slots}
        self.shapes = [(s.param, s.param.dtype, s.param.device, s.param.shape) for s in self.slots]

    def _stale(self) -> bool:
        """Whether a parameter's dtype, device or shape changed since the layout (``model.double()``,
        ``.to(...)`` after wrapping)."""
        for p, dtype, device, shape in self.shapes:
            if p.dtype is not dtype or p.shape != shape or p.device != device:
                return True
        return False

    def _relayout(self) -> None:
        """The parameters changed dtype, device or shape: buckets laid out anew (collective, in ``finish()``,
        where every rank comes alike), the sharded state carried over in the parameters' new dtype."""
        full = self.shards.full_state() if self.shards is not None else None
        self._drain()
        hooked = {s.index for s in self.slots if s.hooked}
        self._layout()
        for s in self.slots:
            s.hooked = s.index in hooked
        if full is not None:
            self.shards = Shards(self)
            sd = self.inner.state_dict()
            sd["state"] = full
            self.shards.load_full(sd)
        self._reset()

    def _hook(self, s: _Slot) -> None:
        """A hook on ``s``'s parameter (torch refuses one on a tensor without requires_grad: a frozen
        parameter gets its hook when it is unfrozen, at the next round)."""
        if self.with_hooks and not s.hooked and s.param.requires_grad:
            self.hooks.append(s.param.register_post_accumulate_grad_hook(_make_hook(self._ref, s.index)))
            s.hooked = True

    def close(self) -> None:
        """Remove the hooks now."""
        self._finalizer()

    # ---- rounds: one reduction of the gradients ----
    def _reset(self) -> None:
        """A new round: no bucket has left. Pending collectives of the old one are completed first (every
        rank started them: each must be completed, even if its result is dropped)."""
        self._drain()
        for s in self.slots:
            s.ready = s.missing = s.inplace = False
            self._hook(s)
            s.counted = s.hooked and s.param.requires_grad  # its hook will fire in this round's backward
        for b in self.buckets:
            b.pending = sum(s.counted for s in b.slots)
            b.handle = b.block = None
        self.next = 0
        self.flag_handle = None
        self.finished = False
        self.queued = False
        self.checked = self.stale = False
        if self.shards is not None:
            self.shards.from_grads = False
        if self.op != "mean":
            self.left: list = []

    def _drain(self) -> None:
        for b in self.buckets:
            if b.handle is not None:
                try:
                    b.handle.wait()
                except Exception:  # noqa: BLE001 - the round is dropped; its error with it
                    pass
                b.handle = None
        if self.flag_handle is not None:
            try:
                self.flag_handle.wait()
            except Exception:  # noqa: BLE001 - as above
                pass
            self.flag_handle = None

    def new_round(self, clear_poison: bool = False) -> None:
        if clear_poison:
            self.poisoned = self.deferred = None
        self._reset()

    # ---- during backward ----
    def ready(self, index: int) -> None:
        """The hook of parameter ``index``: its gradient is complete for this backward pass."""
        if not self.communicating:  # an accumulating pass: torch adds the gradients up in .grad
            return
        if self.poisoned is not None:
            raise self.poisoned
        s = self.by_index[index]
        if self.finished:
            # Another backward pass after the round completed, before step() (a GAN's generator loss through
            # the discriminator after module.zero_grad(), a second loss): a new round, as DDP reduces every
            # backward pass. .grad now holds what torch accumulated: the average plus this pass's own
            # gradients (or only the latter after a zero_grad), whose mean is the average plus this pass's
            # average; with sharded state .grad holds the rank's own sums, reduced anew.
            if not (self.op == "mean" or self.shards is not None or self._grads_reset()):
                self.poisoned = RuntimeError(
                    f"DistributedOptimizer(op={self.op!r}): a second backward pass reached parameter {s.name} "
                    f"before step(), adding to a gradient already reduced over the ranks: reducing it again "
                    f"would reduce the first pass's result {self.op!r}-wise once more. Zero the gradients "
                    f"between the passes (module.zero_grad() or opt.zero_grad()), call step() after every "
                    f"backward pass, or accumulate with DistributedOptimizer(opt, backward_passes_per_step=k)")
                raise self.poisoned
            self._reset()
            s = self.by_index[index]
        elif s.ready:
            self.poisoned = RuntimeError(
                f"DistributedOptimizer: parameter {s.name} got a second gradient in one backward pass after its "
                f"bucket had left (its post-accumulate-grad hook ran twice: a reentrant backward, as "
                f"torch.utils.checkpoint(use_reentrant=True) of a parameter also used outside the checkpointed "
                f"part), so that gradient cannot join the average. Use use_reentrant=False, or overlap=False; "
                f"zero_grad() drops this step's gradients (needed now before training on)")
            raise self.poisoned
        if not self.checked:  # the first hook of the round: the parameters as laid out?
            self.checked = True
            self.stale = self._stale()
        if self.stale:  # laid out anew in finish(), on the caller's thread; nothing leaves before
            if not self.queued:
                self.queued = True
                _queue_callback(self._ref)
            s.ready = True
            return
        if not self.queued:  # finish() at the end of this backward pass (as DDP does): .grad is then
            self.queued = True  # the average when backward() returns, safe to read or clip
            _queue_callback(self._ref)
        s.ready = True
        b = s.bucket
        b.pending -= 1
        if b.pending == 0 and self.next < len(self.buckets) and self.buckets[self.next] is b:
            self._leave_ready()
        else:
            self._progress()

    def end_of_backward(self) -> None:
        """Autograd's final callback of a backward pass in which a hook fired: complete the round."""
        self.queued = False
        if self.poisoned is None and not self.finished:
            try:
                self.finish()
            except (MismatchError, NonFiniteError) as exc:  # raised by step() (or average_gradients()), as
                self.deferred = exc  # without overlap

    def _leave_ready(self) -> None:
        buckets = self.buckets
        while self.next < len(buckets) and buckets[self.next].pending == 0:
            b = buckets[self.next]
            if any(s.param.requires_grad and not s.counted for s in b.slots):
                break  # unfrozen since the round began (no hook counted it): it leaves in finish()
            self._leave(b)
            self.next += 1
        if self.next == len(buckets) and threading.current_thread() is _MAIN:
            # (CUDA gradients: hooks run on autograd's device thread; the host count then waits for
            # finish(), on the caller's thread, for an MPI started at the 'funneled' thread level)
            self._send_flag()
        self._progress()

    def _progress(self) -> None:
        """Let MPI move the buckets in flight (it progresses only inside MPI calls): test the oldest."""
        for b in self.buckets[:self.next]:
            if b.handle is not None and not b.handle.done():
                return

    def _leave(self, b: _Bucket) -> None:
        torch = _torch()
        if b.solo:
            # One parameter: reduced in its own .grad where that is a plain dense tensor (as
            # allreduce_tree's solo leaves are): no buffer, no copy in, no copy out
            s = b.slots[0]
            g = s.param.grad
            if g is not None and g is not s.view and g.layout is torch.strided and g.is_contiguous():
                s.inplace = True
                self._reduce(b, g)
                return
        flat = b.buffer()
        with torch.no_grad():
            for s in b.slots:
                g = s.param.grad
                if g is s.view:
                    continue
                if g is None:
                    s.missing = True
                    s.view.zero_()
                    continue
                if g.is_sparse:
                    raise TypeError(f"DistributedOptimizer: parameter {s.name} has a sparse gradient; the "
                                    f"gradient buckets take dense ones (use a dense embedding, or overlap=False)")
                s.view.copy_(g)  # the first pass after zero_grad(set_to_none=True), or a replaced .grad
                if self.views:
                    s.param.grad = s.view
        self._reduce(b, flat)

    def _reduce(self, b: _Bucket, buf) -> None:
        """Start the reduction of bucket ``b`` held in ``buf`` (its flat buffer, or a solo .grad), described
        as this bucket of this layout (``_call``: what checked mode and the fingerprints compare)."""
        with _call.naming(structure=b.structure), meeting_named():
            if b.blocking:
                # The blocking call, which may take the node-shared-memory allreduce, where nothing could
                # overlap with a non-blocking one: the last bucket (backward is done, or step() waits at
                # once), and a host bucket the ranks' own CPUs would reduce anyway (every rank on one node:
                # no network or other core runs it while they compute, and the non-blocking form would only
                # finish later, after a costlier start). The same bits (tests/mpi/test_training.py). (Its
                # hot path once warm.)
                try:
                    b.handle = Handle.completed("allreduce", self.comm.allreduce(buf, self.op))
                except NonFiniteError as exc:  # COLLECTIVES_CHECK_NAN: held for finish(), as a handle's
                    b.handle = Handle.completed("allreduce", error=exc)
            else:
                self._start(b, buf)

    def _start(self, b: _Bucket, buf) -> None:
        """Start the non-blocking reduction of bucket ``b`` held in ``buf``."""
        if b.narrow is not None:
            # Compression: every rank sends block j of its gradients, in the narrow dtype, to rank j
            # (alltoall); rank j adds the blocks in float32 and divides (finish(): _compressed), rounds the
            # average to the narrow dtype once, and the averages come back by allgather (or, with sharded
            # state, rank j keeps its block): half the bytes of a float32 allreduce each way.
            b.handle = self.comm.alltoall(buf.to(b.narrow), async_op=True)
        elif self.shards is not None:
            b.handle = self.comm.reduce_scatter(buf, self.op, async_op=True)
        else:
            b.handle = self.comm.allreduce(buf, self.op, async_op=True)

    def _compressed(self, b: _Bucket, blocks):
        """This rank's block of a compressed bucket: every rank's narrow block added in float32 (in rank
        order), divided by the number of ranks for a mean, rounded to the narrow dtype once."""
        torch = _torch()
        blocks = blocks.reshape(self.comm.size, -1)
        acc = blocks[0].to(torch.float32)
        for r in range(1, self.comm.size):
            acc.add_(blocks[r])  # float32 += the narrow block, widened
        if self.op == "mean":
            acc.div_(self.comm.size)
        return acc.to(b.narrow)

    def _send_flag(self) -> None:
        """Start one small non-blocking exchange (a :class:`~collectives._agree.Ballot`: one int64 allreduce
        max) that tells whether the ranks agree on the missing gradients: ``missing``, whether some rank lacks
        the gradient of a parameter that requires grad; ``frozen``, whether every rank's frozen parameters
        without gradient are the same (by a digest of them): frozen layers cost nothing more."""
        frozen = tuple(s.index for s in self.slots if s.missing and not s.param.requires_grad)
        missing = any(s.missing and s.param.requires_grad for s in self.slots)
        with meeting_named():  # (as a bucket's call: a meeting found beside an earlier one failed the comm)
            self.flag_handle = self.flag.start(self.comm, {"missing": missing,
                                                           "frozen": hash(frozen) & ((1 << 62) - 1)})

    # ---- in step() ----
    def finish(self) -> None:
        """Complete the round: send what has not left, wait for everything, settle missing gradients.
        After it every present ``.grad`` holds the reduction (with sharded state: this rank's blocks are
        in the shard gradients)."""
        if self.poisoned is not None:
            raise self.poisoned
        if self.deferred is not None:
            exc, self.deferred = self.deferred, None
            raise exc
        if self.finished:
            return
        torch = _torch()
        if not self.checked:
            self.checked = True
            self.stale = self._stale()
        if self.stale:
            self._relayout()
        for b in self.buckets[self.next:]:
            self._leave(b)
        self.next = len(self.buckets)
        if self.flag_handle is None:
            self._send_flag()
        gathers = []
        refused = None
        for b in self.buckets:
            try:
                out = b.handle.wait()
            except NonFiniteError as exc:  # COLLECTIVES_CHECK_NAN: agreed, so every rank's same buckets fail
                b.handle = None
                refused = refused or self._nonfinite(b, exc)
                continue
            b.handle = None
            if b.narrow is not None:
                out = self._compressed(b, out)
                if self.shards is None:
                    gathers.append((b, self.comm.allgather(out, async_op=True)))
                    continue
                out = out.to(b.key[1])
            if self.shards is not None:
                b.block = out
        for b, h in gathers:  # the averages, in the narrow dtype, back into the bucket's dtype
            b.flat.copy_(h.wait().reshape(-1))
        flag, self.flag_handle = self.flag_handle, None
        assert flag is not None  # started with the buckets (above)
        flag.wait()
        if refused is not None:  # every collective of the round is complete: drop the round, .grad unchanged
            self._reset()
            raise refused
        skipped: set = set()
        agreed = self.flag.result()
        if agreed["missing"] or not agreed["frozen"]:
            skipped = self._settle_missing()
        else:  # the frozen parameters without gradient, the same on every rank: skipped
            skipped = {s.index for s in self.slots if s.missing}
        with torch.no_grad():
            if self.shards is None:
                for s in self.slots:
                    if s.missing or s.inplace:
                        continue
                    g = s.param.grad
                    if g is not s.view:
                        g.copy_(s.view)
        if self.shards is not None:
            self.shards.take_gradients(skipped)
            self.shards.agree_finite()
        elif self.op != "mean":  # what this round left in .grad: a later backward pass must not add to it
            self.left = [weakref.ref(s.param.grad) for s in self.slots if s.param.grad is not None]
        self.finished = True

    def _nonfinite(self, b: _Bucket, exc: NonFiniteError) -> NonFiniteError:
        """The NonFiniteError of bucket ``b``, naming the parameters whose gradients hold the values found
        (the layout is the same on every rank: so is the message)."""
        found = {}
        for r, (where, index, value) in exc.found.items():
            s = next((s for s in b.slots if s.offset <= index < s.offset + s.numel), None)
            found[r] = (where, index, value) if s is None else (f"the gradient of {s.name}", index - s.offset, value)
        named = NonFiniteError(f"DistributedOptimizer ({exc.collective} of a gradient bucket)", found)
        named.__cause__ = exc
        return named

    def _grads_reset(self) -> bool:
        """Whether every gradient this round left was replaced since (``zero_grad(set_to_none=True)``)."""
        now = {id(s.param.grad) for s in self.slots if s.param.grad is not None}
        return not any(r() is not None and id(r()) in now for r in self.left)

    def _settle_missing(self) -> set:
        """Some rank lacks some gradient (:func:`_gradients.missing_report`, every rank together): give zeros
        where ``missing_grads="zero"``; returns the indices of the parameters skipped (none anywhere)."""
        try:
            partial, skipped = missing_report(self.comm, self.slots, self.missing_mode)
        except MismatchError:
            self._reset()
            raise
        torch = _torch()
        with torch.no_grad():
            for i in partial:  # missing_grads="zero": this rank contributed zeros; it gets the reduction
                s = self.by_index[i]
                if s.missing and self.shards is None:
                    s.param.grad = s.view if self.views else s.view.clone()
                s.missing = False
        return skipped

    def step(self, closure=None, amp=None):
        """The inner step over the reduced gradients (:meth:`finish` done), or the sharded step; ``amp``:
        GradScaler's ``(grad_scale, found_inf)`` (see :func:`amp_step`)."""
        if self.shards is not None:
            return self.shards.step(closure, amp)
        if closure is not None:
            return self.inner.step(closure)
        return amp_step(self.inner, amp, lambda: [s.param.grad for s in self.slots if s.param.grad is not None])

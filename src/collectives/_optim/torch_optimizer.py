"""``DistributedOptimizer`` of a torch optimizer: :class:`TorchDistributedOptimizer`, which wraps (never
subclasses) the user's optimizer and averages its gradients: in buckets during backward (``_overlap``), in
one fused ``allreduce_tree`` at ``step()`` (``fused``), or as exact units (``_units``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import _config
from .._comm import _resolve
from .._gradients import amp_step, compression_dtype, grad_comm
from .._tree import WRAPPER_ATTRIBUTE
from . import fused
from .meeting import Meeting, told_apart

if TYPE_CHECKING:  # (imported when reproducible=True is used: it needs torch)
    from .._units import TorchUnits


class TorchDistributedOptimizer:
    """A torch optimizer whose ``step`` uses gradients averaged over all ranks.

    Made by :func:`DistributedOptimizer`; wraps (does not subclass) the inner optimizer, available as
    ``inner``. Attributes and methods not listed here are the inner optimizer's. LR schedulers check
    ``isinstance(optimizer, torch.optim.Optimizer)``: give them ``inner`` (they change the same
    ``param_groups``).

    With ``overlap=True`` (the default) the gradients are averaged in flat buckets that leave during
    backward (see :func:`DistributedOptimizer`); its hooks are removed when the wrapper is dropped (or
    by :meth:`close`).

    Example:
        >>> import torch, collectives as coll
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> model = coll.synchronize(model)              # same start everywhere
        >>> loss = model(torch.ones(4, 2)).pow(2).mean()
        >>> loss.backward()                              # the gradient buckets leave during backward
        >>> opt.step()                                   # waits for them, then SGD
        >>> opt.zero_grad()
        >>> opt.param_groups[0].get("lr")             # the inner optimizer's groups
        0.1
    """

    _collectives_distributed = True
    # torch.amp.GradScaler: an optimizer with this attribute gets the scale and the inf/NaN flag as its
    # attributes grad_scale and found_inf, and its step() is always called: the wrapper unscales what the
    # step uses (after the averaging) and skips the update itself, on every rank alike (see _amp_step)
    _step_supports_amp_scaling = True

    def __init__(self, optimizer, *, op: str = "mean", backward_passes_per_step: int = 1,
                 bucket_bytes: int | None = None, comm=None, overlap: bool = True, grad_views: bool = True,
                 missing_grads: str = "error", shard_state: bool = False, compression: str | None = None,
                 reproducible: bool = False):
        self.inner = optimizer
        self.reproducible = reproducible
        self._units: TorchUnits | None = None  # reproducible=True: the backward passes' gradients, one unit each (_units)
        self.compression = compression
        self.comm = _resolve(comm)
        self.op = op
        self.backward_passes_per_step = backward_passes_per_step
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        self.grad_views = grad_views
        self.missing_grads = missing_grads
        self.shard_state = shard_state
        self._passes = 0  # step() calls since the last real step
        self._averaged = False  # average_gradients() ran since the last step
        self._engine = None
        self._engine = self._make_engine()
        # shard_state=True makes state_dict() collective: its ranks first meet (Meeting)
        self._meeting = Meeting()

    def _make_engine(self):
        if self.reproducible:
            from .._units import TorchUnits

            self._units = TorchUnits(self.inner, self.comm, self.op)
            return None
        if not (self.overlap or self.shard_state or self.compression):
            return None
        from .. import _overlap

        nbytes = _overlap_bucket_bytes(self.bucket_bytes)
        return _overlap.Buckets(self.inner, grad_comm(self.comm), op=self.op, bucket_bytes=nbytes,
                                hooks=self.overlap, views=self.grad_views, missing=self.missing_grads,
                                shard=self.shard_state, communicating=self.backward_passes_per_step == 1,
                                compression=compression_dtype(self.compression))

    def close(self) -> None:
        """Remove the gradient hooks now (dropping the wrapper does it too). Not collective.

        Example:
            >>> import torch, collectives as coll
            >>> p = torch.nn.Parameter(torch.zeros(2))
            >>> opt = coll.DistributedOptimizer(torch.optim.SGD([p], lr=1.0))
            >>> len(p._post_accumulate_grad_hooks)
            1
            >>> opt.close()
            >>> len(p._post_accumulate_grad_hooks)
            0
        """
        if self._engine is not None:
            self._engine.close()
        if self._units is not None:
            self._units.close()

    def __getattr__(self, name):
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    # A communicator is a resource of this process (an MPI communicator), not data: a copy shares it, and
    # a pickle leaves it out (it could not travel); unpickled, the optimizer uses the default communicator
    # (collectives.world()) of the process that loads it, and the inner optimizer is pickled as torch does.
    # The gradient buckets (hooks, buffers, collectives in flight) are made anew for the copy's parameters.
    def __getstate__(self):
        if self.shard_state:
            raise TypeError("a DistributedOptimizer with shard_state=True holds only this rank's share of the "
                            "optimizer state: save state_dict() (the full state) instead of pickling it")
        state = dict(self.__dict__)
        state["comm"] = None
        state["_engine"] = state["_units"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.comm is None:
            from .._comm import world

            self.comm = world()
        self._engine = self._make_engine()

    def __deepcopy__(self, memo):
        import copy

        if self.shard_state:
            raise TypeError("a DistributedOptimizer with shard_state=True cannot be copied: make a new one over "
                            "the copied optimizer and load_state_dict() into it")
        memo[id(self.comm)] = self.comm  # shared, not copied
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        state = {**{k: v for k, v in self.__dict__.items() if k != "_engine"}, "_units": None}  # (both made anew)
        clone.__dict__.update(copy.deepcopy(state, memo))
        clone._engine = clone._make_engine()
        return clone

    def __repr__(self) -> str:
        extra = "" if self.overlap else ", overlap=False"
        extra += ", shard_state=True" if self.shard_state else ""
        extra += ", reproducible=True" if self.reproducible else ""
        return (f"DistributedOptimizer({self.inner!r}, op={self.op!r}, "
                f"backward_passes_per_step={self.backward_passes_per_step}{extra})")

    @property
    def accumulating(self) -> bool:
        """True between the step() calls that only accumulate (k-1 of every k)."""
        return self._passes != 0

    def average_gradients(self) -> None:
        """Average every parameter's ``.grad`` over the ranks now (all ranks must call it).

        For work between averaging and stepping, such as gradient clipping: call this, clip, then
        ``step()``, which will not average again. With ``shard_state=True`` this also gathers the
        averaged gradients back into every ``.grad`` (one allgather per bucket more than ``step()``
        alone), and ``step()`` then takes its share from ``.grad`` as it is after your changes.

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
        if self._units is not None:
            self._units.sum()
            self._averaged = True
            return
        if self._engine is not None:
            with told_apart(self.shard_state):
                self._engine.finish()
            if self.shard_state:
                self._engine.shards.gather_gradients()
            self._averaged = True
            return
        fused.average(self.inner, self.op, self.comm, self.bucket_bytes, self.missing_grads)
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

        Raises:
            MismatchError: a parameter has a gradient on some ranks only (``missing_grads="error"``), on
                every rank, before any update.
            RuntimeError: a second backward pass ran since the last ``step()`` (overlap; see
                :func:`DistributedOptimizer`).
        """
        k = self.backward_passes_per_step
        amp = _amp_call(self)
        if closure is not None and k > 1:
            raise ValueError("step(closure) is not supported with backward_passes_per_step > 1: the closure "
                             "would run one backward pass more than the k accumulated ones")
        if self._units is not None:
            return self._unit_step(closure, amp)
        engine = self._engine
        self._passes += 1
        if self._passes < k:
            if engine is not None:
                engine.communicating = self._passes == k - 1
            return None
        self._passes = 0
        if amp is not None and not self._averaged and (engine is None or not engine.with_hooks):
            self._averaged = False
            _amp_done(self)
            raise RuntimeError(
                "DistributedOptimizer(overlap=False) under torch.amp.GradScaler: GradScaler looked at .grad "
                "before step() averaged it, so its inf/NaN check saw this rank's own gradients (ranks would "
                "skip different steps and scale differently). Call opt.average_gradients() before "
                "scaler.unscale_(opt) / scaler.step(opt) (Horovod's optimizer.synchronize()), or use "
                "overlap=True (the default: .grad is averaged when backward() returns)")
        if engine is not None:
            try:
                if closure is None:
                    if not self._averaged:
                        with told_apart(self.shard_state):  # a meeting of some ranks (Meeting) is named as such
                            engine.finish()
                    return engine.step(amp=amp)

                def reduced_closure():
                    engine.new_round()
                    loss = closure()
                    with told_apart(self.shard_state):
                        engine.finish()
                    return loss

                return engine.step(reduced_closure)
            finally:
                self._averaged = False
                engine.communicating = k == 1
                engine.new_round()
        if closure is None:
            if not self._averaged:
                self.average_gradients()
            self._averaged = False
            return amp_step(self.inner, amp, self._grads)

        def averaged_closure():
            loss = closure()
            self.average_gradients()
            return loss

        self._averaged = False
        return self.inner.step(averaged_closure)

    def _unit_step(self, closure, amp):
        """step() with reproducible=True: the units' exact mean (or sum) into ``.grad``, then the inner step."""
        if closure is not None or amp is not None:
            self._averaged = False
            _amp_done(self)
            what = "step(closure)" if closure is not None else "torch.amp.GradScaler"
            raise RuntimeError(f"DistributedOptimizer(reproducible=True) does not support {what}: every backward() "
                               "pass is one unit, summed at step(); run the backward passes, then step() (for "
                               "gradient scaling, scale the loss by a fixed power of two and divide it out)")
        if not self._averaged:
            self._units.sum()  # type: ignore[union-attr]  # (set: the caller checked)
        self._averaged = False
        return self.inner.step()

    def _grads(self) -> list:
        return [p.grad for group in self.inner.param_groups for p in group["params"] if p.grad is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner ``zero_grad``, skipped while accumulating (so the k backward passes add up).

        With the gradient buckets it also drops a round of reductions not stepped (after a failed
        step or a second backward pass: every rank completes what it started, the results are dropped).
        With ``grad_views=True``, ``set_to_none=False`` keeps every ``.grad`` a view of its bucket (no
        copy at the next backward pass); ``set_to_none=True`` (torch's default) costs one copy per
        gradient in the next backward pass.
        """
        if self.accumulating:
            return
        if self._engine is not None:
            self._engine.new_round(clear_poison=True)
            self._averaged = False
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """The inner ``add_param_group``; the gradient buckets are laid out anew to include the group
        (every rank must call it; with ``shard_state=True`` it is collective: the state is carried over
        through the full state).

        Example:
            >>> import torch, collectives as coll
            >>> a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
            >>> opt = coll.DistributedOptimizer(torch.optim.SGD([a], lr=1.0))
            >>> opt.add_param_group({"params": [b], "lr": 0.5})
            >>> b.grad = torch.ones(2)
            >>> opt.step()
            >>> b.detach().tolist()
            [-0.5, -0.5]
        """
        engine = self._engine
        if engine is None:
            self.inner.add_param_group(param_group)
            if self._units is not None:
                self._units.hook_params()
            return
        if self.shard_state:
            self._meeting.meet("add_param_group()", self._engine, self.comm)
        full = engine.shards.full_state() if self.shard_state else None
        engine.new_round(clear_poison=True)
        engine.close()
        self.inner.add_param_group(param_group)
        self._engine = self._make_engine()
        if full is not None:
            sd = self.inner.state_dict()
            sd["state"] = full
            self._engine.shards.load_full(sd)

    def state_dict(self) -> dict:
        """The inner optimizer's ``state_dict``.

        With ``shard_state=True``: **collective, every rank must call it**; the full state, as the
        unsharded optimizer would hold it (per parameter, in the inner optimizer's format), gathered from
        every rank's share, on every rank. Horovod's rank-0 checkpoint, ``if rank == 0:
        torch.save(opt.state_dict())``, cannot work then: call ``sd = opt.state_dict()`` on every rank and
        save ``sd`` on rank 0. A call that the other ranks do not make waits for them before any transfer.
        Where they went on to their next step, their gradient collectives meet it: every rank raises
        :class:`MismatchError` naming this fix (this rank here, the others in ``backward()`` or ``step()``),
        and the optimizer's communicator is failed. Where they are elsewhere: after
        ``COLLECTIVES_STALL_WARN_S`` (default 60 s) this rank warns, naming the fix, and waits on; with
        ``COLLECTIVES_TIMEOUT`` set, it raises :class:`CollectiveTimeoutError` after that many seconds
        (uncaught, the job is aborted), and a later call on every rank still works.

        Example:
            >>> import torch, collectives as coll
            >>> p = torch.nn.Parameter(torch.zeros(5))
            >>> opt = coll.DistributedOptimizer(torch.optim.Adam([p], lr=0.1), shard_state=True)
            >>> p.grad = torch.ones(5)
            >>> opt.step()
            >>> sd = opt.state_dict()                      # on every rank: the whole state
            >>> if coll.world().rank == 0:                 # then save on rank 0 only
            ...     pass                                   # torch.save(sd, "checkpoint.pt")
            >>> adam = sd["state"].get(0)                  # parameter 0's Adam state
            >>> adam.get("exp_avg").shape
            torch.Size([5])
            >>> fresh = coll.DistributedOptimizer(torch.optim.Adam([p], lr=0.1), shard_state=True)
            >>> fresh.load_state_dict(sd)                  # each rank keeps its share
            >>> torch.equal(fresh.state_dict()["state"].get(0).get("exp_avg"), adam.get("exp_avg"))
            True
        """
        if not self.shard_state:
            return self.inner.state_dict()
        assert self._engine is not None  # shard_state=True: there is always an engine, holding the shards
        self._meeting.meet("state_dict()", self._engine, self.comm)
        sd = self.inner.state_dict()
        sd["state"] = self._engine.shards.full_state()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """The inner optimizer's ``load_state_dict``; with ``shard_state=True`` each rank keeps its share
        of the given (full, unsharded) state. Not collective."""
        if not self.shard_state:
            self.inner.load_state_dict(state_dict)
            return
        assert self._engine is not None  # shard_state=True: there is always an engine, holding the shards
        self._engine.shards.load_full(state_dict)

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors this rank holds (the inner optimizer's and, with
        ``shard_state=True``, its shard optimizer's).

        Example:
            >>> import torch, collectives as coll
            >>> p = torch.nn.Parameter(torch.zeros(4))
            >>> opt = coll.DistributedOptimizer(torch.optim.SGD([p], lr=0.1, momentum=0.9))
            >>> p.grad = torch.ones(4)
            >>> opt.step()
            >>> opt.state_bytes()            # the momentum buffer: 4 float32
            16
        """
        import torch

        def nbytes(opt):
            return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                       if torch.is_tensor(v))

        total = nbytes(self.inner)
        if self.shard_state:
            assert self._engine is not None  # shard_state=True: there is always an engine, holding the shards
            total += nbytes(self._engine.shards.opt)
        return total


def _amp_call(opt):
    """``(grad_scale, found_inf)`` when torch.amp.GradScaler.step() is calling ``opt.step()`` (it sets both as
    attributes of an optimizer with ``_step_supports_amp_scaling``), else ``None``. ``grad_scale`` is ``None``
    when ``scaler.unscale_(opt)`` already unscaled ``.grad``; ``found_inf`` is the scaler's inf/NaN flag
    over ``.grad``."""
    d = opt.__dict__
    if "found_inf" not in d:
        return None
    return d.get("grad_scale"), d["found_inf"]


def _amp_done(opt) -> None:
    """Remove GradScaler's attributes (a step that raises: the scaler removes them only after a step)."""
    opt.__dict__.pop("grad_scale", None)
    opt.__dict__.pop("found_inf", None)


def _overlap_bucket_bytes(bucket_bytes) -> int:
    """The gradient buckets' bound: ``bucket_bytes`` if given, else ``GRAD_BUCKET_BYTES`` (or
    ``COLLECTIVES_BUCKET_BYTES`` where that is set lower)."""
    from .._tree import _bucket_bytes

    if bucket_bytes is not None:
        return _bucket_bytes(bucket_bytes)
    if _config.bucket_bytes_set():
        return min(_bucket_bytes(None), GRAD_BUCKET_BYTES)
    return GRAD_BUCKET_BYTES


GRAD_BUCKET_BYTES = 4 << 20  # gradient buckets that leave during backward (benchmarks/bench_training.py)


setattr(TorchDistributedOptimizer, WRAPPER_ATTRIBUTE, True)  # synchronize() syncs the inner optimizer

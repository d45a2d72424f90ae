"""DistributedOptimizer: average gradients across ranks, then let the user's optimizer step.

By composition, never by subclassing the user's class: a torch optimizer is wrapped in an object that
delegates everything it does not override; an optax-like optimizer (two pure functions ``init`` and
``update``) is wrapped in a new pair of functions whose state nests the inner state (as optax's own
wrappers do).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, NamedTuple
from collections.abc import Callable

from . import _config, _dtypes
from ._arrays import is_tracer
from ._backends import closed as _closed
from ._comm import _resolve, allreduce_tree
from ._errors import BackendUnavailableError
from ._gradients import COMPRESSIONS, MEETING, MISSING_GRADS, amp_step, compression_dtype, grad_comm, meeting_named
from ._tree import WRAPPER_ATTRIBUTE, is_array, map_leaves

if TYPE_CHECKING:  # (imported when reproducible=True is used: it needs torch)
    from ._units import TorchUnits


def DistributedOptimizer(optimizer, *, op: str = "mean", backward_passes_per_step: int = 1,
                         bucket_bytes: int | None = None, comm=None, overlap: bool = True,
                         grad_views: bool = True, missing_grads: str = "error", shard_state: bool = False,
                         compression: str | None = None, reproducible: bool = False):
    """Wrap an optimizer so that every update uses gradients averaged over all ranks.

    Two kinds of optimizer are accepted:

    - **torch-like** (has ``param_groups`` and ``step``, e.g. ``torch.optim.Adam``): returns a
      :class:`TorchDistributedOptimizer`. Its ``step(closure=None)`` waits for every ``p.grad`` to be
      averaged over the ranks and then calls the inner ``step``. Everything else (``param_groups``,
      ``state``, ``add_param_group``, ...) is the inner optimizer's. With ``overlap=True`` (the default)
      the averaging runs during backward: a post-accumulate-grad hook on every parameter (with
      ``requires_grad``) marks its gradient ready, and as soon as every gradient of a bucket is ready its
      asynchronous allreduce starts. Buckets hold the parameters in reverse ``param_groups`` order (the
      order backward produces them), one flat buffer per (group, dtype, device) of at most
      ``bucket_bytes`` (a parameter of 256 KiB or more gets its own); they leave in that order on every
      rank (with the blocking allreduce where nothing could overlap it: the last bucket, and on one node
      the large host ones, which the ranks' CPUs reduce in shared memory). At the
      end of the backward pass the rest leave and all are waited for (as DDP does): when ``backward()``
      returns, every ``p.grad`` holds the average (with ``overlap=False``: only in ``step()``). The
      gradient collectives run on a communicator of their own (one ``split`` of ``comm``, made by the
      first DistributedOptimizer on ``comm``: all ranks make it together). Hooks are removed when the
      wrapper is dropped (or by ``close()``). ``overlap=False`` averages everything in ``step()``
      instead, with one fused :func:`allreduce_tree` (parameters in ``param_groups`` order): every way
      gives the same bits.
    - **Gradients as views** (``grad_views=True``, with overlap): a bucket of one parameter is reduced in
      its own ``p.grad`` (no buffer, no copy); in a bucket of several, after it left once, every
      ``p.grad`` *is* a view of the bucket (DDP's ``gradient_as_bucket_view``), so backward accumulates
      straight into the buffer and nothing is copied in or out. Do not replace ``p.grad`` with a new
      tensor if you want to keep that: a ``.grad`` that is not the view (``None`` after
      ``zero_grad(set_to_none=True)``, or your own tensor) is detected when the bucket leaves and copied
      in (one copy; your tensor is not changed, and ``p.grad`` is the view again). Use
      ``zero_grad(set_to_none=False)`` for no copy at all. ``grad_views=False`` copies every gradient in
      and the result back out, and leaves ``p.grad`` the tensor torch made.
    - **Several backward passes before** ``step()`` are each reduced, as DDP reduces every backward pass
      (a GAN's generator loss through the discriminator): a backward pass after the round completed starts
      a new one over ``.grad`` as torch accumulated it, giving the sum of the passes' averages. With an op
      other than ``"mean"`` a second pass must follow ``zero_grad(set_to_none=True)`` (module or
      optimizer), else it is a RuntimeError on every rank; ``zero_grad()`` drops the round.
    - **Casts after wrapping** (``model.double()``, ``.to(dtype or device)``): the buckets are laid out
      anew at the next round (collective: every rank casts alike).
    - **AMP**: ``torch.amp.GradScaler`` works in every mode: ``scaler.step(opt)`` hands the wrapper the scale
      and the inf/NaN flag (``_step_supports_amp_scaling``), and it unscales what the step uses (the averaged
      gradients, or the sharded share) and skips alike on every rank. With ``overlap=False`` call
      ``average_gradients()`` before ``scaler.unscale_``/``scaler.step`` (else a RuntimeError on every rank).
    - **Compression** (``compression="fp16"`` or ``"bf16"``, as Horovod's ``Compression.fp16``): float32 and
      float64 gradients travel in the narrow type (alltoall of the blocks, each rank adds its block in
      float32 and divides, one rounding to the narrow type, allgather), then are cast back.
    - **Missing gradients**: a parameter whose ``.grad`` is ``None`` at ``step()`` on every rank is
      skipped (its ``.grad`` stays ``None``, as torch optimizers skip it). One that has a gradient on some
      ranks only is a :class:`MismatchError` on every rank naming it and the ranks (no update happens);
      with ``missing_grads="zero"`` the ranks without one contribute zeros and every rank gets the average
      (Horovod's behaviour, DDP's with ``find_unused_parameters=True``): models whose graph depends on the
      rank need it.
    - **Sharded optimizer state** (``shard_state=True``, for the element-wise torch optimizers: SGD,
      Adam, AdamW, Adamax, Adagrad, Adadelta, RMSprop, Rprop, NAdam, RAdam, ASGD): every bucket is padded
      to a multiple of the number of ranks and each rank owns one block of it; the buckets are
      reduce-scattered (each rank receives the average of its blocks only), each rank steps an optimizer
      of the inner optimizer's class and hyper-parameters over one flat tensor per (group, dtype, device)
      holding its blocks, and the parameters come back by allgather. The optimizer state per rank is
      1/size of the unsharded one; the parameters are bit for bit those of the unsharded optimizer. The
      inner optimizer keeps no state (its ``param_groups`` still rule: LR schedulers given ``inner``
      work); ``state_dict()`` is collective (every rank must call it: ``sd = opt.state_dict()`` on every
      rank, then save ``sd`` on rank 0; Horovod's ``if rank == 0: opt.state_dict()`` is a
      :class:`MismatchError` on every rank, naming this fix, once the others are in their next step's
      gradient collectives) and gives the full,
      unsharded state on every rank; ``load_state_dict`` takes a full state (of a sharded or an unsharded optimizer). ``p.grad``
      keeps this rank's own gradients (only the blocks were averaged, and changing ``.grad`` before
      ``step()`` has no effect; when some rank's averaged share is not finite, every rank's ``.grad`` gets
      an inf, so that GradScaler skips alike) unless ``average_gradients()`` gathered the average into it (for clipping). A parameter without gradient on every rank keeps its value
      and state, but shares the group's step count (Adam's bias correction counts the group's steps).
    - **optax-like** (has ``init`` and ``update``, pure functions, e.g. an ``optax.GradientTransformation``):
      returns a :class:`DistributedTransformation` ``(init, update)``; ``update(grads, state, params=None)``
      averages ``grads`` over the ranks and then calls the inner ``update``. Call it outside ``jax.jit``
      (the communication runs on the host).

    **The same bits at any number of ranks** (``reproducible=True``, with op ``"mean"`` or ``"sum"``): the
    unit of an exact sum (:func:`allreduce_units`) is one micro-batch's gradient, whichever rank computed
    it, so with the global batch, its micro-batches, the seed, the data order and the initial values kept
    fixed the parameters after any number of steps are bitwise the same at any number of ranks and any
    split of the micro-batches among them (docs/guide-data-parallel.md, "The same bits at any number of
    ranks").

    - torch: every ``backward()`` pass is one unit. A hook takes each parameter's gradient at the end of
      the pass (``.grad`` is then ``None``: the next pass does not add to it); ``step()``, called once per
      global batch after this rank's passes (any number, 0 included), sums every rank's units per dtype
      and divides by their number (``"mean"``), then runs the inner step. A parameter without gradient in
      some pass counts zeros for it; one without gradient anywhere keeps ``.grad`` ``None``.
      ``zero_grad()`` drops nothing; ``average_gradients()`` sums early. No overlap with backward
      (``overlap``, ``grad_views``, ``bucket_bytes`` have no effect); ``step(closure)`` and GradScaler are a
      RuntimeError.
    - optax-like: ``update(units, state, params)`` takes this rank's units as a list of gradient trees, one
      per micro-batch (``[]`` on a rank without any: ``params`` then gives the structure).

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
        bucket_bytes: bound of a gradient bucket (default 4 MiB, or ``COLLECTIVES_BUCKET_BYTES`` where that
            is set lower; with ``overlap=False``: the fused buffer bound of :func:`allreduce_tree`).
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).
        overlap: torch: average during backward (default), or all in ``step()`` (``False``).
        grad_views: torch, with overlap: ``p.grad`` as a view of its bucket (default).
        missing_grads: torch: ``"error"`` (default) or ``"zero"``: what a gradient missing on some ranks
            only is (see above).
        shard_state: torch: shard the optimizer state over the ranks (see above).
        compression: torch: ``None`` (default), ``"fp16"`` or ``"bf16"``: the type gradients travel in.
        reproducible: sum micro-batch gradients exactly, the same bits at any number of ranks (see above).

    Returns:
        A :class:`TorchDistributedOptimizer` or a :class:`DistributedTransformation`.

    Raises:
        TypeError: ``optimizer`` is neither torch-like nor optax-like; ``shard_state=True`` for an optimizer
            that is not element-wise; a switch that is not a bool.
        ValueError: ``backward_passes_per_step`` is not a positive integer, the optimizer is already
            distributed, ``missing_grads`` or ``compression`` is unknown, ``compression`` with an op other
            than mean or sum, or ``shard_state``/``missing_grads``/``compression`` for an optax-like
            optimizer; with ``reproducible=True``: ``compression``, ``shard_state``,
            ``backward_passes_per_step`` other than 1, an op other than mean or sum, a parameter outside
            host memory (a TypeError for one not of float16, bfloat16, float32 or float64).

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

        torch, with the optimizer state sharded over the ranks:

        >>> import torch
        >>> model = coll.synchronize(torch.nn.Linear(4, 2))
        >>> opt = coll.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1), shard_state=True)
        >>> model(torch.ones(3, 4)).sum().backward()      # the buckets are reduce-scattered meanwhile
        >>> opt.step()                                    # each rank steps its share; allgather
        >>> sorted(opt.state_dict()["state"])             # the full state (collective)
        [0, 1]

        The same bits at any number of ranks: one backward pass per micro-batch, one unit each:

        >>> model = coll.synchronize(torch.nn.Linear(4, 1))
        >>> opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reproducible=True)
        >>> data = torch.arange(24.0).reshape(6, 1, 4)         # six micro-batches, the same on every rank
        >>> for i in range(coll.world().rank, 6, coll.world().size):    # this rank's (any split)
        ...     model(data[i]).sum().backward()
        >>> opt.step()                                    # the exact mean over the six units, then SGD
        >>> model.weight.grad.tolist()                    # (0+4+...+20)/6 + j for column j
        [[10.0, 11.0, 12.0, 13.0]]
    """
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
        raise TypeError(f"backward_passes_per_step must be a positive integer, got "
                        f"{type(backward_passes_per_step).__name__}")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    op = _dtypes.check_op(op)
    for name, value in (("overlap", overlap), ("grad_views", grad_views), ("shard_state", shard_state)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    if compression is not None and compression not in COMPRESSIONS:
        raise ValueError(f"compression must be None or one of {', '.join(map(repr, COMPRESSIONS))}, got {compression!r}")
    if compression is not None and op not in ("mean", "sum"):
        raise ValueError(f"compression averages or sums (in float32); op={op!r} is not supported with it")
    if missing_grads not in MISSING_GRADS:
        raise ValueError(f"missing_grads must be one of {', '.join(map(repr, MISSING_GRADS))}, got {missing_grads!r}")
    if not isinstance(reproducible, bool):
        raise TypeError(f"reproducible must be True or False, got {type(reproducible).__name__} {reproducible!r}")
    if reproducible:
        from ._units import REFUSED

        if op not in ("mean", "sum"):
            raise ValueError(f"reproducible=True sums or averages the gradients exactly; op={op!r} is not a sum: "
                             f"use op='mean' or op='sum'")
        for name, given in (("compression", compression is not None), ("shard_state", shard_state),
                            ("backward_passes_per_step", backward_passes_per_step != 1)):
            if given:
                raise ValueError(f"DistributedOptimizer: {name} with reproducible=True: {REFUSED[name]}")
    if isinstance(optimizer, TorchDistributedOptimizer) or getattr(getattr(optimizer, "update", None),
                                                                   "_collectives_distributed", False):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the inner optimizer once")
    c = _resolve(comm)
    if c.closed:  # refused now, not at the first step
        raise BackendUnavailableError(f"DistributedOptimizer: {_closed.MESSAGE}")
    if hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None)):
        if shard_state:
            from ._shards import check_shardable

            check_shardable(optimizer)
        return TorchDistributedOptimizer(optimizer, op=op, backward_passes_per_step=backward_passes_per_step,
                                         bucket_bytes=bucket_bytes, comm=c, overlap=overlap,
                                         grad_views=grad_views, missing_grads=missing_grads,
                                         shard_state=shard_state, compression=compression,
                                         reproducible=reproducible)
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        if shard_state or missing_grads != "error" or compression is not None:
            raise ValueError(
                "an optax-like optimizer supports op, backward_passes_per_step, bucket_bytes and comm; "
                "shard_state and missing_grads are for torch optimizers (an optax update gets the whole "
                "gradient tree, and its gradients are never missing), and so is compression. overlap and grad_views have no effect "
                "(the gradients exist only once the whole backward pass has run)")
        return _transformation(optimizer, op, backward_passes_per_step, bucket_bytes, c, reproducible)
    raise TypeError(
        f"DistributedOptimizer expects a torch-like optimizer (with param_groups and step) or an optax-like "
        f"one (with init and update functions); got {type(optimizer).__name__}"
    )


# ---------------------------------------------------------------------------------------------------------
# torch


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
        # shard_state=True makes state_dict() collective: its ranks first meet (see _meet)
        self._waiting = None  # the meeting a call gave up on (a retry on every rank completes it)

    def _make_engine(self):
        if self.reproducible:
            from ._units import TorchUnits

            self._units = TorchUnits(self.inner, self.comm, self.op)
            return None
        if not (self.overlap or self.shard_state or self.compression):
            return None
        from . import _overlap

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
            from ._comm import world

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
            with self._told_apart():
                self._engine.finish()
            if self.shard_state:
                self._engine.shards.gather_gradients()
            self._averaged = True
            return
        self._zero_missing()
        params = [p for group in self.inner.param_groups for p in group["params"]]
        tree = {"param_groups": [[p.grad for p in group["params"]] for group in self.inner.param_groups]}
        out = allreduce_tree(tree, self.op, comm=self.comm, bucket_bytes=self.bucket_bytes)
        if out is not tree:  # a gradient that could not be written in place came back as a new tensor
            grads = [g for group in out["param_groups"] for g in group]
            for p, g in zip(params, grads):
                if g is not p.grad:
                    p.grad = g
        self._averaged = True

    def _zero_missing(self) -> None:
        """overlap=False with missing_grads="zero": a parameter with a gradient on some ranks only gets
        zeros where it has none (one object allgather of who lacks which)."""
        if self.missing_grads != "zero" or self.comm.size == 1:
            return
        params = [p for group in self.inner.param_groups for p in group["params"]]
        mine = [i for i, p in enumerate(params) if p.grad is None]
        lists = self.comm.allgather_object(mine)
        counts: dict[int, int] = {}
        for indices in lists:
            for i in indices:
                counts[i] = counts.get(i, 0) + 1
        import torch

        for i in mine:
            if counts[i] < self.comm.size:
                params[i].grad = torch.zeros_like(params[i])

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
                        with self._told_apart():  # a meeting of some ranks (_meet) is named as such
                            engine.finish()
                    return engine.step(amp=amp)

                def reduced_closure():
                    engine.new_round()
                    loss = closure()
                    with self._told_apart():
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
            self._meet("add_param_group()")
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
        self._meet("state_dict()")
        sd = self.inner.state_dict()
        sd["state"] = self._engine.shards.full_state()
        return sd

    def _meet(self, what: str) -> None:
        """Wait until every rank has called ``what`` (a collective of ``shard_state=True``), before any of
        its transfers: a non-blocking one-byte broadcast on the gradient communicator, described as the
        meeting (``_gradients.MEETING``), polled. The rank-0-only checkpoint of Horovod is what this catches: the other
        ranks are then in their next step's gradient collectives on that communicator, whose fingerprint
        (beside every non-blocking call) differs from the meeting's, so every rank raises MismatchError
        naming the fix (:meth:`_told_apart`). Ranks that are elsewhere (not in a gradient collective): after
        ``COLLECTIVES_STALL_WARN_S`` (default 60 s) this rank warns once and waits on; after
        ``COLLECTIVES_TIMEOUT`` (when set), :class:`CollectiveTimeoutError`; either names the fix."""
        if self._engine is None or self.comm.size == 1:
            return
        import numpy as np

        from . import _call, _config
        from ._errors import CollectiveTimeoutError
        from ._poll import poll

        handle = self._waiting
        if handle is None:
            with _call.naming(structure=MEETING), self._told_apart():
                # a broadcast: the one collective the gradient communicator carries nothing else on, so that
                # a meeting among ranks in their gradient collectives never shares an MPI call with them
                # (only the fingerprints meet: MPICH asserts on an allreduce of 1 byte against one of 24)
                handle = self._engine.comm.broadcast(np.zeros(1, np.int8), root=0, async_op=True)
        warn_s, limit = _config.stall_warn_s(), _config.timeout()
        waited = 0.0
        for bound in sorted({b for b in (warn_s, limit) if b is not None}):
            with self._told_apart():
                if poll(handle.done, bound - waited):
                    break
            waited = bound
            text = (f"DistributedOptimizer.{what} with shard_state=True is collective: every rank must call it, "
                    f"and rank {self.comm.rank} of {self.comm.size} has waited {waited:g} s for the others. "
                    "Gathering the sharded state needs every rank's share, so Horovod's rank-0 checkpoint "
                    "(`if rank == 0: torch.save(opt.state_dict())`) cannot work: call `sd = opt.state_dict()` on "
                    "every rank, then save `sd` on rank 0 only")
            if bound == limit:
                self._waiting = handle  # kept: a call on every rank after this error completes it
                raise CollectiveTimeoutError(f"{text} (COLLECTIVES_TIMEOUT={limit:g})")
            import warnings

            warnings.warn(f"{text} (a warning, waiting on; COLLECTIVES_STALL_WARN_S sets when it is given, "
                          "COLLECTIVES_TIMEOUT turns it into an error)", RuntimeWarning, stacklevel=3)
        self._waiting = None
        with self._told_apart():
            handle.wait()

    def _told_apart(self):
        """:func:`_gradients.meeting_named` where the state is sharded (else nothing to tell apart)."""
        return meeting_named() if self.shard_state else contextlib.nullcontext()

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
    from ._tree import _bucket_bytes

    if bucket_bytes is not None:
        return _bucket_bytes(bucket_bytes)
    if _config.bucket_bytes_set():
        return min(_bucket_bytes(None), GRAD_BUCKET_BYTES)
    return GRAD_BUCKET_BYTES


GRAD_BUCKET_BYTES = 4 << 20  # gradient buckets that leave during backward (benchmarks/bench_training.py)


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
            from ._units import sum_units

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

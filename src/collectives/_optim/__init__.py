"""DistributedOptimizer: average gradients across ranks, then let the user's optimizer step.

By composition, never by subclassing the user's class: a torch optimizer is wrapped in an object that
delegates everything it does not override; an optax-like optimizer (two pure functions ``init`` and
``update``) is wrapped in a new pair of functions whose state nests the inner state (as optax's own
wrappers do).
"""

from __future__ import annotations

from .. import _dtypes
from .._backends import closed as _closed
from .._comm import _resolve
from .._errors import BackendUnavailableError
from .._gradients import COMPRESSIONS, MISSING_GRADS
from .torch_optimizer import GRAD_BUCKET_BYTES as GRAD_BUCKET_BYTES
from .torch_optimizer import TorchDistributedOptimizer as TorchDistributedOptimizer
from .transformation import DistributedState as DistributedState
from .transformation import DistributedTransformation as DistributedTransformation
from .transformation import _transformation


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
      ``zero_grad()`` drops nothing; ``average_gradients()`` sums early. The sum runs in host memory
      (a CUDA parameter's gradients are copied there and their sum back). No overlap with backward
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
            ``backward_passes_per_step`` other than 1, an op other than mean or sum (a TypeError for a
            parameter not of float16, bfloat16, float32 or float64).

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
        from .._units import REFUSED

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
            from .._shards import check_shardable

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

"""The library's entry points: :func:`init`, :func:`world`, :func:`finalize`, and the collectives as
functions. Each function calls the method of the same name on its communicator (``comm=None``: the
default, :func:`world`; an mpi4py communicator: the library's own for it, :func:`_resolve`). The public
documentation of every collective (who calls it, what must match, what each rank gets back) is here.

The world communicator is the one process-wide store here, read as a global by ``broadcast`` and
``allreduce`` (the functions' hot path: no look-up beyond it).
"""

from __future__ import annotations

import atexit
import threading

from .. import _config, _registry, _trace
from .._backends import factory
from .._errors import CollectiveError
from .communicator import Communicator

BACKENDS = ("auto", "mpi", "self")


_lock = threading.RLock()
_world: Communicator | None = None
_atexit_registered = False


def init(backend: str = "auto", *, comm=None, check: bool | None = None) -> Communicator:
    """Start the library and return a :class:`Communicator`. Idempotent.

    Args:
        backend: ``"auto"`` (MPI when mpi4py works, else ``"self"``; ``COLLECTIVES_BACKEND`` overrides),
            ``"mpi"`` (fail with :class:`BackendUnavailableError` if MPI is unusable) or ``"self"`` (one
            process, no communication).
        comm: an existing mpi4py intra-communicator to work within (for frameworks with their own job).
            The library duplicates it and never talks on the original.
        check: turn the cross-rank agreement check on or off (default: ``COLLECTIVES_CHECK``).

    In an MPI job of more than one process, the first ``init`` also makes an uncaught exception on any
    rank end the whole job (``MPI_Abort``) instead of leaving the other ranks waiting in a collective
    (``COLLECTIVES_ABORT_ON_ERROR=0`` turns it off). With ``COLLECTIVES_TIMEOUT`` set when a communicator
    is made, its host collectives raise :class:`CollectiveTimeoutError` after that many seconds. With
    ``COLLECTIVES_NCCL_EAGER=1`` (on every rank, torch or CuPy imported), it also sets up this rank's CUDA
    device transport (``MismatchError`` if only some ranks set it; a refused init leaves nothing behind).

    Returns:
        The default communicator (``comm=None``), or the communicator for ``comm``. The first call also
        sets the default returned by :func:`world`. Calling again with the same arguments returns the
        same object.

    Raises:
        BackendUnavailableError: MPI was required (explicitly, or by a multi-process launcher) but cannot
            be used; or ``COLLECTIVES_NCCL_EAGER=1`` and the CUDA transport cannot be set up.
        MismatchError: ``COLLECTIVES_NCCL_EAGER`` differs across ranks.
        ValueError: an unknown backend, or a backend other than the one already initialised.

    Example:
        >>> import collectives as coll
        >>> comm = coll.init()
        >>> comm is coll.init() is coll.world()
        True
        >>> comm.backend in ("mpi", "self")
        True
    """
    global _world, _atexit_registered
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError(f"unknown backend={backend!r}; expected one of {', '.join(map(repr, BACKENDS))}")
    backend = backend.lower()
    if backend == "auto":
        backend = _config.backend()
        if backend not in BACKENDS:  # malformed: refused by every rank when the transport is made (agreed)
            backend = "auto"
    with _lock:
        if comm is None and _world is not None:
            existing = _world
        elif comm is not None:
            existing = _registry.lookup(comm)  # by the MPI communicator, not the wrapper (_registry)
        else:
            existing = None
        if existing is not None:
            if backend != "auto" and backend != existing.backend:
                raise ValueError(f"already initialised with backend {existing.backend!r}; "
                                 f"call collectives.finalize() before init(backend={backend!r})")
            if check is not None:
                existing.check = bool(check)
            return existing
        transport = factory.host_transport(backend, comm)
        from .. import _failure

        _failure.install(transport)  # an uncaught exception on one rank aborts the job (see _failure)
        result = Communicator(transport, check=_config.check() if check is None else check)
        try:
            from .._backends import cuda

            cuda.initialize_eagerly(result._engine)  # COLLECTIVES_NCCL_EAGER: agreed by every rank, else a no-op
        except BaseException:
            result.close()  # every rank fails alike here (the ranks agreed first), so every rank closes
            raise
        if comm is not None:
            _registry.remember(comm, result)
            _named[0] += 1
            result._name = f"comm{_named[0]}"  # in the order init(comm=...) was called
        if _world is None:
            _world = result
            result._name = "world"
            _start_trace(result)
        if not _atexit_registered:
            atexit.register(finalize)  # runs before mpi4py's MPI_Finalize (registered earlier)
            _atexit_registered = True
        return result


_named = [0]  # communicators made by init(comm=...), for their names in trace dumps


def _start_trace(world_comm: Communicator) -> None:
    """Start the flight recorder's process side (``_trace.start``) with a job id every rank shares (rank
    0's, broadcast: collective, at the first ``init``)."""
    if _config.trace_buffer() == 0:
        return
    import os
    import time

    mine = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    job = world_comm.broadcast_object(mine, 0) if world_comm.size > 1 else mine
    _trace.start(job, world_comm.rank, world_comm.size)


def world() -> Communicator:
    """The default communicator; calls ``init()`` on first use.

    Example:
        >>> import collectives as coll
        >>> 0 <= coll.world().rank < coll.world().size
        True
    """
    w = _world
    return w if w is not None else init()


def finalize() -> None:
    """Release every communicator the library made; :func:`init` may be called again afterwards.

    MPI itself is left initialised (mpi4py finalises it at exit), so other MPI users in the process are
    not disturbed. Collective (freeing MPI windows and communicators is): every rank calls it, as every
    rank reaches interpreter exit. Idempotent; also runs at interpreter exit.

    Example:
        >>> import collectives as coll
        >>> coll.finalize(); coll.finalize()
        >>> coll.world().closed
        False
    """
    global _world
    with _lock:
        comms = _registry.forget_all()
        if _world is not None:
            comms.append(_world)
        _world = None
    failures = []
    for c in comms:
        try:
            c.close()
        except CollectiveError as exc:  # asynchronous collectives left pending: close the others first
            failures.append(exc)
    if failures:
        raise failures[0]


def _resolve(comm) -> Communicator:
    if comm is None:
        w = _world
        return w if w is not None else init()
    if isinstance(comm, Communicator):
        return comm
    return init(comm=comm)


# ---------------------------------------------------------------------------------------------------------
# the collectives as functions

def broadcast(x, root: int = 0, *, comm=None, async_op: bool = False):
    """Make every rank's ``x`` equal to root's.

    Every rank of ``comm`` must call it with the same ``root`` and an array of the same shape and dtype.
    Works on every dtype, bit for bit.

    Args:
        x: an array (NumPy, torch, array-api-strict, JAX, ... in host memory).
        root: the rank whose values are sent.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).

    Returns:
        ``x`` itself, holding root's values, when ``x`` is a writable NumPy array or a torch tensor (also a
        non-contiguous view: only its elements change; also a tensor that requires grad). Otherwise (a
        read-only array, array-api-strict, JAX) a new array of the same library and device.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> x = np.arange(4) * (comm.rank + 1)
        >>> coll.broadcast(x, root=0).tolist()
        [0, 1, 2, 3]
    """
    c = (_world or init()) if comm is None else _resolve(comm)
    if async_op:
        return c.broadcast(x, root, async_op=True)
    return c.broadcast(x, root)


def allreduce(x, op: str = "sum", *, comm=None, async_op: bool = False, reproducible: bool | None = None):
    """Combine ``x`` element-wise over all ranks; every rank gets the result.

    Every rank must call it with the same ``op``, the same ``reproducible`` and an array of the same shape
    and dtype.

    Args:
        x: an array in host memory.
        op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``"mean"``. Legal pairs: sum/prod on integers,
            floating and complex; min/max on integers, floating and bool (max = any, min = all); mean on
            floating and complex only. Other pairs raise ``TypeError`` before any communication.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).
        async_op: return a :class:`Handle` at once instead of the result; ``handle.wait()`` returns the
            result (the same bits). Also on :func:`broadcast`, :func:`reduce`, :func:`allgather`,
            :func:`reduce_scatter`, :func:`alltoall` and :func:`allreduce_tree`; see docs/semantics.md.
        reproducible: ``True``: a sum or mean of float16, bfloat16, float32, float64 or complex whose bits
            are the same at any number of ranks, in any rank order, on any transport (summed in exact
            fixed point: within a documented bound of the exact sum, NaN/inf/-0.0 as IEEE gives them; see
            docs/semantics.md); about 2.25 times the bytes of the ordinary call. Another op or dtype is a
            ValueError/TypeError. ``None`` (default): the communicator's :attr:`Communicator.reproducible`
            (``COLLECTIVES_REPRODUCIBLE``). For several units per rank, see :func:`allreduce_units`.

    Returns:
        The result, in ``x`` itself when it is writable (see :func:`broadcast`), else a new array.
        float16/bfloat16 are accumulated in float32 where MPI cannot reduce them, then rounded back.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> x = np.array([1.0, 2.0]) * (comm.rank + 1)
        >>> coll.allreduce(x, op="mean").tolist() == [(comm.size + 1) / 2, comm.size + 1.0]
        True
        >>> y = np.array([1e8, 1.0, -1e8], dtype=np.float32)[comm.rank % 3:comm.rank % 3 + 1]   # one term per rank
        >>> _ = coll.allreduce(y, op="sum", reproducible=True)    # the same bits at 1, 2, 3 ... ranks
    """
    c = (_world or init()) if comm is None else _resolve(comm)
    if async_op:
        return c.allreduce(x, op, async_op=True, reproducible=reproducible)
    if reproducible is None:
        return c.allreduce(x, op)
    return c.allreduce(x, op, reproducible=reproducible)


def allreduce_units(units, op: str = "sum", *, comm=None, async_op: bool = False):
    """The reproducible sum (or mean) of every rank's units: the same bits for any split of the same units
    among any number of ranks.

    A rank may hold several units of the global data (rows, micro-batches, per-sample gradients): ``units``
    stacks this rank's along its leading dimension (any count, 0 included; it may differ between ranks).
    The result is the sum (``"mean"``: divided by the number of units on all ranks together) of all ranks'
    units, each unit a term of one exact fixed-point sum (see docs/semantics.md): bitwise the same whatever
    the number of ranks, whichever rank holds which unit and in which order. Every rank must call it with
    the same ``op``, dtype and unit shape (``units.shape[1:]``).

    Args:
        units: an array of shape ``(k, *shape)`` in host memory, of float16, bfloat16, float32, float64 or
            complex64/128; left unchanged.
        op: ``"sum"`` or ``"mean"``.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).
        async_op: return a :class:`Handle`; ``wait()`` returns the result.

    Returns:
        A new array of shape ``units.shape[1:]``, of the units' library and dtype, on every rank. No unit on
        any rank: zeros (sum) or NaN (mean).

    Raises:
        TypeError, ValueError: another op or dtype, a 0-d array, more than 65536 units in all.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> rows = np.arange(12.0).reshape(6, 2) / 7           # six units of global data, on every rank
        >>> mine = rows[comm.rank::comm.size]                 # this rank's share (any split will do)
        >>> total = coll.allreduce_units(mine, op="sum")
        >>> alone = comm.split(color=comm.rank)               # every rank a communicator of its own
        >>> solo = coll.allreduce_units(rows, comm=alone)     # all six units on one process
        >>> total.tobytes() == solo.tobytes()
        True
        >>> alone.close()
    """
    return _resolve(comm).allreduce_units(units, op, async_op=async_op)


def reduce(x, op: str = "sum", root: int = 0, *, comm=None, async_op: bool = False,
           reproducible: bool | None = None):
    """Combine ``x`` element-wise over all ranks; only ``root`` gets the result.

    Every rank must call it with the same ``op``, ``root``, ``reproducible``, shape and dtype. Same
    op/dtype rules as :func:`allreduce` (and ``reproducible=True``: the bits of :func:`allreduce`'s
    reproducible sum, on ``root``).

    Returns:
        On ``root``: the result (in ``x`` when writable, else a new array). On every other rank: ``x``
        itself, unchanged.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> x = np.ones(2, dtype=np.int64)
        >>> y = coll.reduce(x, op="sum", root=0)
        >>> y.tolist() == ([comm.size] * 2 if comm.rank == 0 else [1, 1])
        True
    """
    return _resolve(comm).reduce(x, op, root, async_op=async_op, reproducible=reproducible)


def allgather(x, *, out=None, comm=None, async_op: bool = False):
    """Every rank's ``x``, stacked: ``result[r]`` is rank r's ``x``.

    Every rank must call it with an array of the same shape and dtype.

    Args:
        out: where to write the result instead of a new array: an array of x's library that can be
            written in place (a writable NumPy array, a torch tensor, a CUDA array), of x's dtype and
            device, of shape ``(size, *x.shape)``; checked before any communication (TypeError or
            ValueError). ``x`` may lie inside it (as ``out[rank]``). Each rank chooses for itself: with or
            without ``out``, the ranks' transfers are the same.

    Returns:
        A new array of shape ``(size, *x.shape)``, of x's library, dtype and device; or ``out``, written.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> g = coll.allgather(np.array([comm.rank]))
        >>> g.shape == (comm.size, 1) and g[:, 0].tolist() == list(range(comm.size))
        True
        >>> buf = np.empty((comm.size, 1), dtype=int)
        >>> coll.allgather(np.array([comm.rank]), out=buf) is buf and buf[:, 0].tolist() == list(range(comm.size))
        True
    """
    return _resolve(comm).allgather(x, out=out, async_op=async_op)


def gather(x, root: int = 0, *, comm=None, async_op: bool = False):
    """Every rank's ``x`` stacked along a new leading axis on ``root`` (``MPI_Gather``); None elsewhere.

    Every rank passes an array of the same shape and dtype; ``root`` gets a new array of shape
    ``(size, *x.shape)`` of x's library and device, row r holding rank r's ``x`` bit for bit (every dtype).
    The other ranks get None. ``x`` is never written.

    Args:
        x: an array (any array-API library; any dtype).
        root: the rank that receives (the same on every rank).
        comm: the communicator (default: the one :func:`init` made).
        async_op: return a :class:`Handle` whose ``wait()`` gives the result.

    Returns:
        On ``root``, the stacked array; on every other rank, None.

    Raises:
        TypeError: ``x`` is not an array.
        ValueError: ``root`` is not a rank of ``comm``.
        MismatchError: (checked mode, and on the non-blocking paths) the ranks passed different shapes,
            dtypes or roots.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.init()
        >>> g = coll.gather(np.array([comm.rank, 10 * comm.rank]), root=0)
        >>> g.tolist() == [[r, 10 * r] for r in range(comm.size)] if comm.rank == 0 else g is None
        True
    """
    return _resolve(comm).gather(x, root, async_op=async_op)


def reduce_scatter(x, op: str = "sum", *, out=None, comm=None, async_op: bool = False,
                   reproducible: bool | None = None):
    """Reduce ``x`` over all ranks and give each rank one block of the result.

    The leading dimension of ``x`` is split into ``size`` equal blocks; rank r gets block r of the
    element-wise reduction (what ``allreduce(x, op)[r * n : (r + 1) * n]`` would hold, bit for bit, with
    ``n = x.shape[0] // size``). Every rank must call it with the same ``op`` and an array of the same
    shape and dtype. Same op/dtype rules as :func:`allreduce` (mean, float16/bfloat16 accumulated in
    float32, float min/max with NaN winning and -0.0 < +0.0; ``reproducible=True``: the blocks of
    :func:`allreduce`'s reproducible sum, bit for bit).

    Args:
        x: an array (host memory, or CUDA memory of torch/CuPy) whose ``x.shape[0]`` is divisible by the
            communicator's size; left unchanged.
        op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``"mean"``.
        out: where to write this rank's block instead of a new array: as :func:`allgather`'s ``out``, of
            shape ``(x.shape[0] // size, *x.shape[1:])`` (it may lie inside ``x``).
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).

    Returns:
        A new array of shape ``(x.shape[0] // size, *x.shape[1:])``, of x's library, dtype and device; or
        ``out``, written.

    Raises:
        ValueError: ``x`` is 0-d or its leading dimension is not divisible by the size (before any
            communication, on every rank that made such a call).
        TypeError: an illegal op/dtype pair.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> x = np.arange(2 * comm.size, dtype=np.int64).reshape(comm.size, 2)   # the same on every rank
        >>> mine = coll.reduce_scatter(x, op="sum")                            # block comm.rank of the sum
        >>> mine.shape, mine.tolist() == [(comm.size * x[comm.rank]).tolist()]
        ((1, 2), True)
        >>> buf = np.empty((1, 2), dtype=np.int64)
        >>> coll.reduce_scatter(x, op="sum", out=buf) is buf and buf.tolist() == mine.tolist()
        True
    """
    return _resolve(comm).reduce_scatter(x, op, out=out, async_op=async_op, reproducible=reproducible)


def alltoall(x, *, comm=None, async_op: bool = False):
    """Exchange blocks: block j of this rank's ``x`` goes to rank j; block i of the result came from rank i.

    The leading dimension of ``x`` is split into ``size`` equal blocks. Every rank must call it with an
    array of the same shape and dtype. Any dtype, bit for bit.

    Args:
        x: an array whose ``x.shape[0]`` is divisible by the communicator's size; left unchanged.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).

    Returns:
        A new array of x's shape, library, dtype and device.

    Raises:
        ValueError: ``x`` is 0-d or its leading dimension is not divisible by the size.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> x = np.array([10 * comm.rank + j for j in range(comm.size)])   # block j: for rank j
        >>> coll.alltoall(x).tolist() == [10 * i + comm.rank for i in range(comm.size)]
        True
    """
    return _resolve(comm).alltoall(x, async_op=async_op)


def send(x, dst: int, tag: int = 0, *, comm=None, async_op: bool = False):
    """Send ``x`` to rank ``dst`` of ``comm`` (point-to-point: only this rank and ``dst`` take part).

    ``dst`` must post a matching :func:`recv` (this rank, or any rank, as ``src``; the same ``tag``) with
    an array of x's dtype and number of elements. Messages from one rank to another with the same tag
    arrive in the order they were sent. Any dtype, bit for bit; host arrays travel over MPI, CUDA arrays
    of torch and CuPy over NCCL (else the communicator's CUDA transport).

    Args:
        x: the array to send (left unchanged; with ``async_op=True`` leave it alone until ``wait()``).
        dst: the destination rank, ``0 <= dst < size``. A blocking send to this rank itself is refused
            (it could not complete); with ``async_op=True`` it is allowed.
        tag: a non-negative integer up to MPI's ``MPI_TAG_UB`` (at least 32767), matched by the receive.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).
        async_op: return a :class:`Handle` at once; ``wait()`` returns None once ``x`` may be reused.

    Returns:
        None once ``x`` may be reused (the receiver may not have it yet), or a :class:`Handle`.

    Raises:
        TypeError, ValueError: ``x`` is not an array, ``dst`` is not a rank, ``tag`` out of range (before
            anything is sent).
        CollectiveTimeoutError: with ``COLLECTIVES_TIMEOUT``, the receiver did not take the message in
            time (the communicator is then unusable, as after a collective's timeout).

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        >>> h = coll.send(np.full(3, float(comm.rank)), right, tag=5, async_op=True)   # a ring
        >>> got = np.empty(3)
        >>> coll.recv(got, left, tag=5) == left and got.tolist() == [float(left)] * 3
        True
        >>> h.wait()
    """
    return _resolve(comm).send(x, dst, tag, async_op=async_op)


def recv(x, src: int | None = None, tag: int = 0, *, comm=None, async_op: bool = False):
    """Receive into ``x`` the message with ``tag`` from rank ``src`` (None: from any rank).

    The message must hold x's dtype and number of elements (its shape may differ): a message of another
    dtype raises ``TypeError``, of another size ``ValueError``, on this rank, with ``x`` unchanged (the
    message is received and dropped, the communicator stays usable); it is never truncated. The sender is
    told nothing: its send completed.

    Args:
        x: a writable array (NumPy, torch; also a non-contiguous view, a tensor that requires grad).
        src: the source rank, or None for any rank (the first matching message).
        tag: the tag the sender used.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).
        async_op: return a :class:`Handle` at once; ``wait()`` returns the sender's rank once ``x`` holds
            the message.

    Returns:
        The sender's rank (``src`` itself, or the rank an any-source receive matched), or a
        :class:`Handle` whose ``wait()`` returns it.

    Raises:
        TypeError, ValueError: ``x`` is not an array or is read-only (array-api-strict, JAX, a read-only
            NumPy array), ``src`` is not a rank, ``tag`` out of range (before anything is received); the
            message does not fit ``x`` (see above).
        CollectiveTimeoutError: with ``COLLECTIVES_TIMEOUT``, no matching message came in time.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> h = coll.send(np.arange(4) + 10 * comm.rank, (comm.rank + 1) % comm.size, async_op=True)
        >>> x = np.empty(4, dtype=np.int64)
        >>> sender = coll.recv(x, src=None)                  # from any rank: here, the left neighbour
        >>> sender == (comm.rank - 1) % comm.size and x.tolist() == [10 * sender + i for i in range(4)]
        True
        >>> h.wait()
    """
    return _resolve(comm).recv(x, src, tag, async_op=async_op)


def broadcast_object(obj, root: int = 0, *, comm=None):
    """Root's ``obj`` (any picklable object) on every rank.

    Every rank of ``comm`` must call it with the same ``root``; the other ranks' ``obj`` is ignored. The
    root pickles first and tells every rank whether that worked, so an object that cannot be pickled
    raises the same ``TypeError`` on every rank (and nothing else is sent).

    Returns:
        On root: ``obj`` itself. Elsewhere: a new object unpickled from root's bytes.

    Raises:
        TypeError: root's object cannot be pickled (on every rank), or ``root`` is not an integer.
        ValueError: ``root`` is out of range.

    Example:
        >>> import collectives as coll
        >>> comm = coll.world()
        >>> cfg = coll.broadcast_object({"lr": 0.1, "rank": comm.rank}, root=0)
        >>> cfg
        {'lr': 0.1, 'rank': 0}
    """
    return _resolve(comm).broadcast_object(obj, root)


def allgather_object(obj, *, comm=None) -> list:
    """Every rank's ``obj`` (any picklable object), in rank order.

    Every rank of ``comm`` must call it. If some rank's object cannot be pickled, every rank raises the
    same ``TypeError`` naming that rank, and no object is exchanged.

    Returns:
        A list of ``size`` objects: entry r is rank r's (this rank's entry is ``obj`` itself).

    Example:
        >>> import collectives as coll
        >>> comm = coll.world()
        >>> coll.allgather_object(f"rank {comm.rank}") == [f"rank {r}" for r in range(comm.size)]
        True
    """
    return _resolve(comm).allgather_object(obj)


def barrier(*, comm=None) -> None:
    """Return once every rank of ``comm`` has called it.

    Example:
        >>> import collectives as coll
        >>> coll.barrier()
    """
    _resolve(comm).barrier()


def synchronize(tree, root: int = 0, *, comm=None, bucket_bytes: int | None = None):
    """Make every leaf of ``tree`` equal to root's: parameters, buffers, optimizer state, settings.

    Every rank of ``comm`` must call it with the same ``root`` and a tree of the same structure. Before
    any data moves the ranks compare a 16-byte fingerprint of their trees (paths, array shapes, dtypes and
    device kinds; the paths of non-array leaves, not their values); if they differ, every rank raises
    :class:`MismatchError` naming the first differing leaf, and nothing changes anywhere.

    What moves:

    - array leaves (NumPy, torch incl. parameters that require grad, anything with ``__dlpack__``): root's
      values, bit for bit. Host leaves, when every rank is on one node: one pipeline of 1 MiB messages,
      the root packing into at most ``bucket_bytes`` of reused buffers and the others receiving straight
      into their leaves; across nodes (or with ``COLLECTIVES_TIMEOUT``): fused buckets, leaves of 4 MiB
      or more in their own memory. CUDA leaves one by one on their device's transport. In place where the
      library allows (writable NumPy arrays, torch tensors), else a new array in the returned tree
      (read-only NumPy, array-api-strict, JAX);
    - non-array leaves (``None``, Python and NumPy scalars, strings, any picklable object): root's, in
      one pickled broadcast for all of them;
    - a torch ``nn.Module``: its parameters and buffers, in place;
    - a torch ``Optimizer`` (or a :func:`DistributedOptimizer` wrapping one): root's whole ``state_dict``
      (state tensors, step counts and hyper-parameters such as ``lr``), loaded into every other rank's
      optimizer; ranks may hold different, even empty, state before. The parameters themselves are not
      part of an optimizer's state: synchronize the model too. Every rank's optimizer must be of the same
      class, with the same groups of parameters of the same shapes.

    Args:
        tree: a tree (see above) of arrays and other values.
        root: the rank whose values everybody gets.
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).
        bucket_bytes: the size bound of one fused buffer, and of the root's pack buffers (default
            ``COLLECTIVES_BUCKET_BYTES``, 25 MiB).

    Returns:
        The tree with root's values. On root: ``tree`` itself. Elsewhere: ``tree`` itself when every leaf
        was updated in place (NumPy, torch, modules, optimizers) and no leaf is a non-array value;
        otherwise a tree of the same structure whose containers are new where a leaf inside changed.

    Raises:
        MismatchError: the ranks' trees or roots differ (on every rank, nothing changed).
        ValueError: ``root`` out of range.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> state = {"w": np.full(3, float(comm.rank)), "step": comm.rank, "name": f"rank{comm.rank}"}
        >>> state = coll.synchronize(state, root=0)
        >>> state["w"].tolist(), state["step"], state["name"]
        ([0.0, 0.0, 0.0], 0, 'rank0')
    """
    return _resolve(comm).synchronize(tree, root, bucket_bytes=bucket_bytes)


def allreduce_tree(tree, op: str = "mean", *, comm=None, bucket_bytes: int | None = None, async_op: bool = False,
                   reproducible: bool | None = None):
    """Reduce every array leaf of ``tree`` over all ranks, fused into few collectives.

    Every rank must call it with the same ``op`` and a tree of the same structure (checked first, with
    one 17-byte Allgather; on a difference every rank raises :class:`MismatchError` and nothing changes).

    Small host leaves are packed into flat buffers per dtype of at most ``bucket_bytes`` each, one
    collective per buffer; a leaf of 256 KiB or more (or a quarter of ``bucket_bytes``) is reduced on its
    own, in its own memory when it is contiguous and writable, so large gradients are never copied.
    Leaves in CUDA memory are reduced on their device by its transport, per device in one call where it
    fuses (NCCL: one group). Results are written back into the caller's arrays where they are writable
    (NumPy, torch), else new arrays are returned in the result tree. Leaves may be of mixed dtypes and
    libraries; leaves that are the same object are reduced once (distinct leaves must not overlap in
    memory, e.g. ``x`` and ``x[:2]``: the overlap would be reduced twice).

    Leaves that are not arrays: Python and NumPy scalars are reduced too (and returned as the same type);
    ``None`` is kept (all ranks must have ``None`` there, e.g. a parameter without gradient); anything
    else is a TypeError.

    Args:
        tree: a tree of arrays (containers as in :func:`synchronize`, also an ``nn.Module``).
        op: ``"mean"`` (default), ``"sum"``, ``"prod"``, ``"min"`` or ``"max"``, with the dtype rules of
            :func:`allreduce` (``"mean"`` on an integer leaf is a TypeError naming the leaf).
        comm: a :class:`Communicator` or an mpi4py communicator (default: :func:`world`).
        bucket_bytes: the size bound of one fused buffer (default ``COLLECTIVES_BUCKET_BYTES``, 25 MiB);
            must be the same on every rank.
        async_op: return a :class:`Handle` at once; every fused host transfer is started as a
            non-blocking collective at the call, and ``handle.wait()`` returns what the blocking call
            returns. Leave the leaves alone until then. CUDA leaves and Python ints are reduced at the call.
        reproducible: ``True`` (op ``"sum"`` or ``"mean"``): every float and complex leaf is summed as
            :func:`allreduce` with ``reproducible=True`` does, element by element, so the bits do not depend
            on the number of ranks nor on ``bucket_bytes`` (integer leaves are exact anyway; a float leaf
            without a reproducible sum, such as longdouble, is a TypeError). ``None``: the communicator's
            default (:attr:`Communicator.reproducible`). Host leaves only.

    Returns:
        The tree with the reduced values: ``tree`` itself when every leaf was reduced in place.

    Raises:
        TypeError: an illegal op/dtype pair, or a leaf that cannot be reduced (raised on every rank,
            before any data moved).
        MismatchError: the ranks' trees or ops differ.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> grads = {"w": np.full((2, 2), float(comm.rank)), "b": np.ones(2), "loss": float(comm.rank)}
        >>> out = coll.allreduce_tree(grads, op="mean")
        >>> mean = (comm.size - 1) / 2
        >>> bool((out["w"] == mean).all()) and out["b"].tolist() == [1.0, 1.0] and out["loss"] == mean
        True
    """
    return _resolve(comm).allreduce_tree(tree, op, bucket_bytes=bucket_bytes, async_op=async_op,
                                         reproducible=reproducible)

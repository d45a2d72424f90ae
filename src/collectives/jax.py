"""Collectives inside ``jax.jit``: one compiled training step, no compiled extension.

``import collectives.jax`` (never imported by ``import collectives``: it imports JAX). Each function here is
usable inside ``jax.jit``, in ``lax.scan``/``fori_loop`` bodies, under ``jax.grad`` (reverse mode) and
``jax.vmap``, and eagerly:

>>> import jax, jax.numpy as jnp
>>> import collectives.jax as cj
>>> step = jax.jit(lambda g: cj.allreduce(g, op="mean") * 2)
>>> step(jnp.ones(3)).tolist()                  # every rank's ones, averaged, doubled
[2.0, 2.0, 2.0]

How it runs (docs/architecture.md, "Collectives inside jax.jit"): each call is an *ordered*
``jax.experimental.io_callback``. XLA calls it in program order, within one computation and across
computations (JAX threads a runtime token through every computation with an ordered effect), and never
removes or reorders it. The callback calls the Communicator's own collective on the host copy of the operand,
asynchronously (``async_op=True``) and waits for it: every guarantee of the eager call holds. The same op/dtype
rules (validated at trace time, so a bad call raises ``TypeError``/``ValueError`` when ``jit`` traces it,
before anything is compiled or sent); the fingerprint beside each transfer, so ranks whose compiled programs
differ (one rank retraced with another shape) raise ``MismatchError`` on every rank instead of exchanging
wrong data; the deadline (``COLLECTIVES_TIMEOUT``); the thread guard; the flight recorder's record.

An error inside the callback (a ``MismatchError``, a timeout) reaches the caller as JAX wraps a failing
callback: an ``XlaRuntimeError``/``JaxRuntimeError`` (a ``RuntimeError``) whose message holds the
library's exception, type name and message included (e.g. ``"MismatchError: ..."``).

Every rank must run the same collectives in the same order (every rank runs the same jitted program).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from . import _dtypes, _threads, _trace
from ._comm import Communicator, engine_of, world

__all__ = ["allgather", "allreduce", "allreduce_tree", "alltoall", "barrier", "broadcast", "reduce_scatter"]

_LINEAR = ("sum", "mean")  # the ops whose gradient is defined (the others: a TypeError under jax.grad)

# Version shims, all here. Before JAX 0.8.2 a custom_vmap function loses its ordered effect when lowered
# (a KeyError inside jit; seen on 0.4.38, 0.5.3, 0.6.2, 0.7.2, 0.8.0 and 0.8.1): there the collectives have
# no vmap rule, and jax.vmap raises JAX's own error for an ordered callback instead.
_VERSION = tuple(int(p) for p in re.findall(r"\d+", jax.__version__)[:3])
_VMAP_RULES = _VERSION >= (0, 8, 2)


def _dispatch_cpu_computations_inline() -> None:
    """Turn JAX's asynchronous dispatch of CPU computations off (``jax_cpu_enable_async_dispatch``), at
    import, before JAX makes its CPU client (the only time the setting is read).

    With it on, a jitted CPU computation runs on a thread of JAX's CPU client after the call returns, and
    our callbacks run inside it. ``io_callback`` hands the callback its operands as ``jax.Array`` values
    (``device_put`` to the CPU device): reading them (``np.asarray``) waits for JAX, and JAX's own docs say
    that a callback must not wait for JAX. It then deadlocks now and then: measured on JAX 0.10.2 under Open
    MPI, one run in 14 of ``tests/mpi/test_jax_jit.py`` hung with rank 1's callback thread in
    ``np.asarray`` of its operand and its main thread waiting for the previous step's result (the other
    rank waiting for it in the collective); with this setting off, 60 runs of 60 passed. See
    jax-ml/jax#25861 and #24255. GPU computations are not affected (the setting is the CPU client's).

    Where the CPU client exists already (JAX ran a computation before ``import collectives.jax``), the
    setting can no longer change: a RuntimeWarning says so once, and how to avoid it."""
    try:
        from jax._src import xla_bridge  # where the setting and the clients live (no public name for either)
    except ImportError:  # pragma: no cover - a JAX without it: nothing to change
        return
    flag = getattr(xla_bridge, "_CPU_ENABLE_ASYNC_DISPATCH", None)
    if flag is None or not flag.value:
        return
    if xla_bridge.backends_are_initialized():
        import warnings

        warnings.warn("collectives.jax: JAX's CPU client was made before collectives.jax was imported, with "
                      "asynchronous dispatch on; a jitted CPU computation that runs our collectives may then "
                      "deadlock in JAX (jax-ml/jax#25861). Import collectives.jax before the first JAX "
                      "computation, or call jax.config.update('jax_cpu_enable_async_dispatch', False) first",
                      RuntimeWarning, stacklevel=3)
        return
    jax.config.update("jax_cpu_enable_async_dispatch", False)


_dispatch_cpu_computations_inline()


# ---- the host side: one call, as a hashable value (JAX caches eager callbacks by it) ----

@dataclasses.dataclass(frozen=True)
class _Host:
    """What one callback runs on the host: ``collective`` of ``comm`` with ``op``/``root``, through the
    Communicator's asynchronous path (its fingerprint catches ranks whose calls differ), waited at once.
    Equal calls are equal values, so that JAX finds an eager call's compiled callback in its cache."""

    comm: Communicator = dataclasses.field(compare=False)
    comm_id: int
    collective: str
    op: str | None = None
    root: int | None = None
    site: tuple | None = None  # where jit traced the call: the flight recorder's call site for its record

    def __call__(self, *args):
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            with _trace.site_hint(None if self.site is None else list(self.site), _VIA):
                return self._run(args)
        finally:
            _inside.depth -= 1

    def _run(self, args):
        c = self.comm
        arrays = [np.asarray(a) for a in args]  # a read-only view of XLA's buffer: the library copies it
        name = self.collective
        if name == "barrier":
            c.barrier()
            return None
        op, root = self.op, self.root  # _host() is given the op of every reducing call, the root of a rooted one
        if name == "allreduce_tree":
            assert op is not None
            return list(c.allreduce_tree(arrays, op, async_op=True).wait())
        (x,) = arrays
        if name == "allreduce":
            assert op is not None
            h = c.allreduce(x, op, async_op=True)
        elif name == "broadcast":
            assert root is not None
            h = c.broadcast(x, root, async_op=True)
        elif name == "reduce_to":  # broadcast's transpose: the sum on root, zeros elsewhere
            assert op is not None and root is not None
            h = c.reduce(x, op, root, async_op=True)
            out = h.wait()
            return np.asarray(out) if c.rank == root else np.zeros_like(x)
        elif name == "reduce_scatter":
            assert op is not None
            h = c.reduce_scatter(x, op, async_op=True)
        elif name == "allgather":
            h = c.allgather(x, async_op=True)
        else:  # alltoall
            h = c.alltoall(x, async_op=True)
        return np.asarray(h.wait())


_VIA = "collectives.jax (jit)"  # the front end a record names in its path
_inside = threading.local()  # depth: how many of our callbacks this thread is running


def _settle() -> None:
    """Before an eager collective (``_threads.settle``): wait until the collectives of the jitted
    computations already dispatched have run. XLA may run a computation on its own thread after the
    dispatching call has returned; the eager call must not overtake its collectives. Not inside one of our
    callbacks (its computation is the one still running)."""
    if not getattr(_inside, "depth", 0):
        jax.effects_barrier()


def _host(comm: Communicator, collective: str, op: str | None = None, root: int | None = None,
          site: tuple | None = None) -> _Host:
    """The callback of one call (at trace time); from now on an eager collective first waits for the
    dispatched ones (``_settle``). ``site``: the line it stands for (default: the caller's, the first
    frame outside the library: the line in the jitted function; a gradient's, its forward call's)."""
    _threads.settle = _settle
    if site is None:
        found, _ = _trace.call_site()
        site = None if found is None else tuple(found)
    return _Host(comm, id(comm), collective, op, root, site)


def _result(spec: _Host, x) -> jax.ShapeDtypeStruct:
    shape, n = tuple(x.shape), spec.comm.size
    if spec.collective == "allgather":
        shape = (n, *shape)
    elif spec.collective == "reduce_scatter":
        shape = (shape[0] // n, *shape[1:])
    return jax.ShapeDtypeStruct(shape, x.dtype)


def _call(spec: _Host, x):
    """The ordered callback, batched by :func:`jax.vmap` as the collective of the stacked array."""
    if not _VMAP_RULES:
        return io_callback(spec, _result(spec, x), x, ordered=True)

    @jax.custom_batching.custom_vmap
    def run(x):
        return io_callback(spec, _result(spec, x), x, ordered=True)

    @run.def_vmap
    def _batched(axis_size, in_batched, x):
        (batched,) = in_batched
        if not batched:  # (vmap over other arguments only: one call, the same on every element)
            return run(x), False
        kind = spec.collective
        if kind in ("allreduce", "broadcast", "reduce_to"):  # element-wise: the stack at once
            return run(x), True
        if kind == "allgather":  # (B, ...) -> (size, B, ...) -> (B, size, ...)
            return jnp.moveaxis(run(x), 0, 1), True
        # reduce_scatter, alltoall: blocks along each element's leading axis
        return jnp.moveaxis(run(jnp.moveaxis(x, 0, 1)), 1, 0), True

    return run(x)


# ---- differentiation (reverse mode): each collective's transpose ----

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _collective(spec: _Host, x):
    return _call(spec, x)


def _forward(spec: _Host, x):
    return _call(spec, x), None


def _backward(spec: _Host, _residual, g):
    kind, op, c = spec.collective, spec.op, spec.comm
    if kind in ("allreduce", "reduce_scatter") and op not in _LINEAR:
        raise TypeError(f"jax.grad through collectives.jax.{kind}(op={op!r}) is not defined: only op='sum' "
                        f"and op='mean' have a gradient here (an allreduce/allgather of the cotangent); "
                        f"wrap the call in jax.lax.stop_gradient if no gradient should flow through it")
    if kind == "allreduce":  # d(sum_i x_i)/dx_r = 1: the cotangents' sum (mean: their mean)
        return (_collective(_host(c, "allreduce", op, site=spec.site), g),)
    if kind == "broadcast":  # only root's x reaches the outputs: every rank's cotangent, summed on root
        return (_collective(_host(c, "reduce_to", "sum", spec.root, spec.site), g),)
    if kind == "reduce_to":
        return (_collective(_host(c, "broadcast", None, spec.root, spec.site), g),)
    if kind == "allgather":  # rank r's x is row r of every rank's output
        return (_collective(_host(c, "reduce_scatter", "sum", site=spec.site), g).reshape(g.shape[1:]),)
    if kind == "reduce_scatter":  # block r of every x reaches rank r's output
        full = _collective(_host(c, "allgather", site=spec.site), g).reshape((-1, *g.shape[1:]))
        return (full / c.size if op == "mean" else full,)
    return (_collective(_host(c, "alltoall", site=spec.site), g),)  # alltoall: block j went to rank j, comes back from it


_collective.defvjp(_forward, _backward)


# ---- validation at trace time (the eager call's rules and words) ----

def _resolve(comm) -> Communicator:
    if comm is None:
        return world()
    if isinstance(comm, Communicator):
        return comm
    raise TypeError(f"comm must be a collectives.Communicator (or None for collectives.world()), got "
                    f"{type(comm).__name__}; make one with collectives.init(comm=...) outside jax.jit")


def _operand(x, collective: str):
    try:
        return jnp.asarray(x)
    except TypeError as exc:
        raise TypeError(f"collectives.jax.{collective}: expected a JAX array (or a NumPy array or scalar), got "
                        f"{type(x).__name__}; use collectives.jax.allreduce_tree for a tree of arrays") from exc


def _checked_op(x, op: str) -> str:
    op = _dtypes.check_op(op)
    _dtypes.check_reduction(_dtypes.from_numpy(np.dtype(x.dtype)), op)
    return op


def _checked_blocks(c: Communicator, collective: str, x) -> None:
    engine_of(c).check_blocks(collective, x)


# ---- the public functions ----

def allreduce(x, op: str = "sum", *, comm: Communicator | None = None):
    """Combine ``x`` element-wise over all ranks; every rank gets the result. Inside ``jax.jit`` or eagerly.

    Every rank must call it with the same ``op`` and an array of the same shape and dtype. The result is
    the eager :func:`collectives.allreduce`'s, bit for bit (the same rules: float16/bfloat16 accumulated in
    float32, ``mean`` divided once).

    Args:
        x: a JAX array (or tracer).
        op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``"mean"``, with the eager call's dtype rules
            (a wrong pair raises ``TypeError`` at trace time).
        comm: a :class:`collectives.Communicator` (default: :func:`collectives.world`).

    Returns:
        A new array, same shape and dtype. Under ``jax.grad`` (``op`` sum or mean) the cotangent is the
        allreduce of the cotangents with the same op; min, max and prod have no gradient (``TypeError``).
        Under ``jax.vmap`` the batch is reduced element-wise like any other axis.

    Example:
        >>> import jax, jax.numpy as jnp, collectives as coll, collectives.jax as cj
        >>> n = coll.world().size
        >>> jax.jit(cj.allreduce)(jnp.arange(3.0)).tolist() == [0.0, n * 1.0, n * 2.0]
        True
        >>> jax.grad(lambda x: cj.allreduce(x, op="mean").sum())(jnp.ones(2)).tolist()
        [1.0, 1.0]
    """
    c = _resolve(comm)
    x = _operand(x, "allreduce")
    op = _checked_op(x, op)
    return _collective(_host(c, "allreduce", op), x)


def broadcast(x, root: int = 0, *, comm: Communicator | None = None):
    """Root's ``x`` on every rank. Inside ``jax.jit`` or eagerly.

    Every rank must call it with the same ``root`` and an array of the same shape and dtype (bit for bit,
    any dtype). Under ``jax.grad`` root's cotangent is the sum of every rank's, the others' zeros.

    Example:
        >>> import jax, jax.numpy as jnp, collectives as coll, collectives.jax as cj
        >>> rank = coll.world().rank
        >>> jax.jit(cj.broadcast)(jnp.full(2, rank)).tolist()
        [0, 0]
    """
    c = _resolve(comm)
    x = _operand(x, "broadcast")
    root = engine_of(c).check_root(root)
    return _collective(_host(c, "broadcast", None, root), x)


def allgather(x, *, comm: Communicator | None = None):
    """Every rank's ``x``, stacked in rank order: shape ``(size, *x.shape)``. Inside ``jax.jit`` or eagerly.

    Every rank must call it with an array of the same shape and dtype. Under ``jax.grad`` the cotangent
    is the reduce-scatter (sum) of the cotangents.

    Example:
        >>> import jax, jax.numpy as jnp, collectives as coll, collectives.jax as cj
        >>> comm = coll.world()
        >>> g = jax.jit(cj.allgather)(jnp.full(2, comm.rank))
        >>> g.shape == (comm.size, 2) and g[:, 0].tolist() == list(range(comm.size))
        True
    """
    c = _resolve(comm)
    return _collective(_host(c, "allgather"), _operand(x, "allgather"))


def reduce_scatter(x, op: str = "sum", *, comm: Communicator | None = None):
    """Reduce ``x`` over the ranks, rank ``r`` gets block ``r`` of the leading axis (``size`` equal blocks).

    Inside ``jax.jit`` or eagerly; the eager :func:`collectives.reduce_scatter`'s rules and bits. Under
    ``jax.grad`` (sum or mean) the cotangent is the allgather of the cotangents (divided by ``size`` for
    mean).

    Example:
        >>> import jax, jax.numpy as jnp, collectives as coll, collectives.jax as cj
        >>> n = coll.world().size
        >>> jax.jit(cj.reduce_scatter)(jnp.ones(2 * n)).tolist() == [n * 1.0, n * 1.0]
        True
    """
    c = _resolve(comm)
    x = _operand(x, "reduce_scatter")
    op = _checked_op(x, op)
    _checked_blocks(c, "reduce_scatter", x)
    return _collective(_host(c, "reduce_scatter", op), x)


def alltoall(x, *, comm: Communicator | None = None):
    """Block ``j`` of ``x``'s leading axis goes to rank ``j``; block ``i`` of the result came from rank ``i``.

    Inside ``jax.jit`` or eagerly. Under ``jax.grad`` the cotangent is the alltoall of the cotangents.

    Example:
        >>> import jax, jax.numpy as jnp, collectives as coll, collectives.jax as cj
        >>> comm = coll.world()
        >>> y = jax.jit(cj.alltoall)(jnp.full(comm.size, comm.rank))
        >>> y.tolist() == list(range(comm.size))
        True
    """
    c = _resolve(comm)
    x = _operand(x, "alltoall")
    _checked_blocks(c, "alltoall", x)
    return _collective(_host(c, "alltoall"), x)


def barrier(*, comm: Communicator | None = None) -> None:
    """Wait until every rank has reached this point of its program. Inside ``jax.jit`` or eagerly.

    Returns nothing; inside ``jit`` it is ordered among the other collectives and ordered callbacks of the
    computation (and never removed for having no output).

    Example:
        >>> import jax, jax.numpy as jnp, collectives.jax as cj
        >>> @jax.jit
        ... def step(x):
        ...     cj.barrier()
        ...     return x + 1
        >>> step(jnp.zeros(1)).tolist()
        [1.0]
    """
    io_callback(_host(_resolve(comm), "barrier"), None, ordered=True)


def allreduce_tree(tree, op: str = "mean", *, comm: Communicator | None = None):
    """Allreduce every leaf of a pytree (the gradients) with one fused call. Inside ``jax.jit`` or eagerly.

    The eager :func:`collectives.allreduce_tree`'s result, bit for bit (one callback runs it on the whole
    tree: its buckets, one transfer each). Every rank must pass a tree of the same structure, shapes and
    dtypes. Under ``jax.grad`` (sum or mean): the allreduce_tree of the cotangents; under ``jax.vmap``
    each batched leaf is reduced whole.

    Example:
        >>> import jax, jax.numpy as jnp, collectives.jax as cj
        >>> grads = {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}
        >>> mean = jax.jit(cj.allreduce_tree)(grads)
        >>> mean["w"].tolist(), mean["b"].tolist()
        ([[1.0, 1.0], [1.0, 1.0]], [0.0, 0.0])
    """
    c = _resolve(comm)
    leaves, structure = jax.tree_util.tree_flatten(tree)
    leaves = [_operand(leaf, "allreduce_tree") for leaf in leaves]
    op = _dtypes.check_op(op)
    for leaf in leaves:
        _checked_op(leaf, op)
    if not leaves:
        return tree
    return jax.tree_util.tree_unflatten(structure, _tree_collective(_host(c, "allreduce_tree", op), tuple(leaves)))


def _tree_call(spec: _Host, leaves: tuple) -> tuple:
    if not _VMAP_RULES:
        return tuple(io_callback(spec, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves], *leaves,
                                 ordered=True))
    @jax.custom_batching.custom_vmap
    def run(*xs):
        return tuple(io_callback(spec, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs], *xs, ordered=True))

    @run.def_vmap
    def _batched(axis_size, in_batched, *xs):
        return run(*xs), tuple(in_batched)  # element-wise: each leaf's stack reduced whole

    return run(*leaves)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tree_collective(spec: _Host, leaves: tuple) -> tuple:
    return _tree_call(spec, leaves)


def _tree_forward(spec: _Host, leaves: tuple):
    return _tree_call(spec, leaves), None


def _tree_backward(spec: _Host, _residual, g: tuple):
    if spec.op not in _LINEAR:
        raise TypeError(f"jax.grad through collectives.jax.allreduce_tree(op={spec.op!r}) is not defined: only "
                        f"op='sum' and op='mean' have a gradient here; wrap the call in jax.lax.stop_gradient "
                        f"if no gradient should flow through it")
    return (_tree_collective(spec, tuple(g)),)


_tree_collective.defvjp(_tree_forward, _tree_backward)


"""Trees of arrays: structure fingerprints and the tree collectives (the flattening is ``_structure``'s).

A *tree* is any nesting of containers with leaves at the bottom. Containers: ``dict`` (and subclasses such
as ``OrderedDict``), ``list``, ``tuple``, namedtuples, dataclass instances, a torch ``nn.Module`` (its
parameters and buffers) and a torch ``Optimizer`` (its ``state_dict``). Everything else is a leaf: an
*array leaf* (NumPy, torch, anything with ``__dlpack__``) or an *object leaf* (``None``, numbers, strings,
any picklable object).

The flat order is canonical: dict keys are sorted (by value, or by ``(type name, repr)`` when the keys do
not sort), module entries by name, so two ranks that built the same dict in a different insertion order
still agree. Unflattening rebuilds each container in the caller's own order and returns the original
container object wherever none of its leaves changed identity.

The tree collectives follow one script:

1. flatten and validate locally; an error is *held*, not raised, so that no rank leaves the others waiting;
2. agree: every rank hashes its structure description (paths, shapes, dtypes, device kinds, plus the call's
   arguments) into 16 bytes and one small Allgather compares them; on a difference the full descriptions
   are gathered and every rank raises the same :class:`MismatchError` naming the first differing leaf; a
   held error is raised on every rank the same way. Nothing has moved yet, and the communicator is fine;
3. move the data in fused buckets (``_buckets``) and rebuild the tree (only where a leaf was replaced).

A repeated call on a tree of the same structure (a training loop) takes the description, its 16-byte
digest and the bucket plan from a small per-communicator cache (see "the plan cache" below), so it pays
for the walk over the tree, one look at each leaf, the 17-byte Allgather and the data, and nothing else.

torch is never imported here: a tensor, module or optimizer can only exist if the user imported torch, so
they are recognised through ``sys.modules``.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from . import _agree, _arrays, _buckets, _config, _dtypes, _finite, _ops, _reproducible
from ._agree import render_path
from ._structure import (  # noqa: F401 - re-exported: the tree's structure, as the front ends import it
    ARRAY, OBJECT, OPTIMIZER, WRAPPER_ATTRIBUTE, Flat, _torch, flatten, is_array, is_torch_optimizer, map_leaves,
    sorted_keys, unflatten)
from ._threads import collective

# ---------------------------------------------------------------------------------------------------------
# descriptions and the agreement check


def device_kind(device: tuple[int, int]) -> str:
    """The device *kind* of a DLPack device (``cpu`` for every host memory kind); indices may differ."""
    if device[0] in _arrays.HOST_DEVICE_TYPES:
        return "cpu"
    return _arrays.device_name(device).split(":")[0]


def array_desc(name: str, shape: tuple, kind: str) -> str:
    """How an array leaf is described: ``float32 (3, 4)``, ``bfloat16 (5,) on cuda``."""
    return f"{name} {shape}" if kind == "cpu" else f"{name} {shape} on {kind}"


def agree(engine, what: str, header: tuple, entries, error: BaseException | None, digest=None) -> None:
    """Agree on a tree call's description across ranks (:func:`collectives._agree.agree`)."""
    if engine.size == 1:
        if error is not None:
            raise error
        return
    _agree.agree(engine.transport_for(_arrays.HOST), what, header, entries, error, digest=digest, checked=False)


# ---------------------------------------------------------------------------------------------------------
# the plan cache
#
# A repeated call on a tree of the same structure (DistributedOptimizer's every step, a training loop's
# synchronize) skips building path strings, leaf descriptions, the fingerprint's hash and the bucket plan:
# they are kept per communicator under a key made of the call's arguments, the containers' kinds and keys
# (``Flat.sig``) and each leaf's dtype name and shape (``_Leaves.sig``), which together determine all of
# them. Only calls that described every leaf without error are cached; the agreement step still runs on
# every call (with the cached 16-byte digest), so a mismatch is still detected on every rank.

PLAN_CACHE = 8  # structures remembered per communicator (least recently used dropped first)


def _cached(engine, key):
    """``(entries, digest, plan)`` for ``key`` in the communicator's plan cache, or None."""
    cache = engine.plans
    hit = cache.get(key)
    if hit is not None:
        cache.move_to_end(key)
    return hit


def _remember(engine, key, what: str, header: tuple, entries: tuple, plan) -> None:
    cache = engine.plans
    cache[key] = (entries, _agree.fingerprint(what, header, entries), plan)
    while len(cache) > PLAN_CACHE:
        cache.popitem(last=False)


# ---------------------------------------------------------------------------------------------------------
# preparing leaves


def _bucket_bytes(bucket_bytes) -> int:
    if bucket_bytes is None:
        return _config.bucket_bytes()
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)):
        raise TypeError(f"bucket_bytes must be a positive integer, got {type(bucket_bytes).__name__}")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes}")
    return int(bucket_bytes)


_NUMPY = _arrays.NUMPY
_HOST = _arrays.HOST
_FROM_NUMPY = _dtypes.from_numpy
_Item = _buckets.Item


def _item(x) -> _buckets.Item:
    """The bucket item of an array leaf (raises what its host view raises).

    Host leaves get a NumPy view of their memory (fused collectives). Leaves on a device (CUDA) get none:
    their description comes from ``x.shape`` and ``x.dtype``, and they are moved by their device's
    transport, which is only made after every rank agreed (making one may itself be collective).
    """
    if type(x) is np.ndarray:  # the common case, without the adapter and device look-ups
        info = _dtypes.from_numpy(x.dtype)
        return _buckets.Item(x, _NUMPY, x if info.storage == x.dtype else x.view(info.storage), info, _HOST)
    a = _arrays.adapter(x)
    device = a.device(x)
    if device[0] not in _arrays.HOST_DEVICE_TYPES:
        return _buckets.Item(x, a, None, _dtypes.from_name(_dtypes.name_of(x)), device)
    view, info = a.host_view(x)
    return _buckets.Item(x, a, view, info, device)


def _shape(x) -> tuple:
    return tuple(int(n) for n in getattr(x, "shape", ()))


def _at(path, exc: BaseException) -> BaseException:
    """The same kind of exception, its message prefixed by the leaf's path."""
    try:
        new = type(exc)(f"leaf {render_path(path)}: {exc}")
    except Exception:  # noqa: BLE001 - an exception type with another signature: keep it as it is
        return exc
    new.__cause__ = exc.__cause__
    return new


_ORDINALS = ("", "2nd ", "3rd ")


class _Leaves:
    """The array leaves of one call, prepared: items, and what the cache key and descriptions need.

    ``add(i, x)`` makes the item of leaf ``i`` (or records why it could not), and appends the leaf's part
    of the cache key: ``(dtype name, shape)`` for a host array, the same plus the device kind and the
    device's ordinal in the tree for a device array (leaves on a tree's second CUDA device are described
    as such, so that every rank groups its device leaves the same way).
    """

    __slots__ = ("devices", "errors", "failed", "index", "items", "sig")

    def __init__(self):
        self.items: list[_buckets.Item] = []
        self.index: list[int] = []  # the leaf index of each item
        self.sig: list = []
        self.failed = False  # some leaf could not be described: nothing of this call is cached
        self.errors: dict[int, BaseException] = {}  # leaf index -> why it has no item
        self.devices: dict = {}  # device -> ordinal among the tree's device kinds' devices

    def add(self, i: int, x) -> _buckets.Item | None:
        if type(x) is np.ndarray:  # the common case, inline
            dtype = x.dtype
            info = _FROM_NUMPY(dtype)
            storage = info.storage
            item = _Item(x, _NUMPY, x if storage is dtype or storage == dtype else x.view(storage), info, _HOST)
            self.items.append(item)
            self.index.append(i)
            self.sig.append((info.name, x.shape))
            return item
        try:
            item = _item(x)
        except Exception as exc:  # noqa: BLE001 - held and re-raised on every rank by agree()
            self.errors[i] = exc
            self.failed = True
            self.sig.append(None)
            return None
        self.items.append(item)
        self.index.append(i)
        if item.view is not None:
            self.sig.append((item.info.name, item.view.shape))
        else:
            ordinal = self.devices.setdefault(item.device, len(self.devices))
            self.sig.append((device_kind(item.device), _dtypes.name_of(x), _shape(x), ordinal))
        return item

    def describe(self, item: _buckets.Item) -> str:
        if item.view is not None:
            return f"{item.info.name} {item.view.shape}"
        x = item.leaf
        text = array_desc(_dtypes.name_of(x), _shape(x), device_kind(item.device))
        ordinal = self.devices[item.device]
        if ordinal:
            nth = _ORDINALS[ordinal] if ordinal < len(_ORDINALS) else f"{ordinal + 1}th "
            text += f" (the tree's {nth}device)"
        return text

    def failure(self, i: int, x, path: str) -> tuple[str, BaseException]:
        """The description and the held error of leaf ``i``, which has no item."""
        exc = self.errors[i]
        try:
            device = _arrays.adapter(x).device(x)
        except Exception:  # noqa: BLE001 - the error itself is what gets reported
            device = _HOST
        return array_desc(_dtypes.name_of(x), _shape(x), device_kind(device)), _at(path, exc)


# ---------------------------------------------------------------------------------------------------------
# synchronize


class _TensorSlot(NamedTuple):
    """Stands for a tensor in a pickled optimizer state_dict skeleton."""

    position: int  # in the list of tensors (a field named index would hide tuple.index)
    shape: tuple
    dtype: str
    device: str


def _skeleton(obj, tensors: list):
    torch = _torch()
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), str(obj.dtype).replace("torch.", ""),
                           obj.device.type)
    if type(obj) is dict:
        return {k: _skeleton(v, tensors) for k, v in obj.items()}
    if type(obj) is list:
        return [_skeleton(v, tensors) for v in obj]
    if type(obj) is tuple:
        return tuple(_skeleton(v, tensors) for v in obj)
    return obj


def _slots(skel, out: list) -> list:
    if isinstance(skel, _TensorSlot):
        out.append(skel)
    elif type(skel) is dict:
        for v in skel.values():
            _slots(v, out)
    elif type(skel) in (list, tuple):
        for v in skel:
            _slots(v, out)
    return out


def _fill(skel, tensors: list):
    if isinstance(skel, _TensorSlot):
        return tensors[skel.position]
    if type(skel) is dict:
        return {k: _fill(v, tensors) for k, v in skel.items()}
    if type(skel) is list:
        return [_fill(v, tensors) for v in skel]
    if type(skel) is tuple:
        return tuple(_fill(v, tensors) for v in skel)
    return skel


def _optimizer_entries(opt, path) -> list:
    """Description entries of a torch optimizer: its class, its groups and every parameter's shape."""
    groups = opt.param_groups
    sizes = [len(g["params"]) for g in groups]
    entries = [(path, f"a {type(opt).__qualname__} with parameter groups of sizes {sizes}")]
    for g, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            name = str(p.dtype).replace("torch.", "")
            entries.append((f"{path}.param_groups[{g}]['params'][{i}]",
                            "parameter " + array_desc(name, tuple(p.shape), p.device.type)))
    return entries


@collective("synchronize")
def synchronize(engine, tree, root, bucket_bytes):
    """:func:`collectives.synchronize` on the communicator of ``engine`` (its ``_comm.Engine``)."""
    what = "synchronize"
    header = (("root", root), ("bucket_bytes", bucket_bytes))
    entries, error, flat = None, None, None
    prepared = _Leaves()
    payload = None
    key = cached = digest = None
    has_objects = has_optimizer = False
    try:
        root = engine.check_root(root)
        header = (("root", root), ("bucket_bytes", _bucket_bytes(bucket_bytes)))
        flat = flatten(tree)
        sig = prepared.sig
        for i, (leaf, kind) in enumerate(zip(flat.leaves, flat.kinds)):
            if kind == ARRAY:
                prepared.add(i, leaf)
            elif kind == OBJECT:
                has_objects = True
                sig.append(OBJECT)
            else:
                has_optimizer = True
        if not prepared.failed and not has_optimizer:  # an optimizer's description is its state's: not cached
            key = (what, header, flat.sig, tuple(sig))
            cached = _cached(engine, key)
        if cached is not None:
            entries, digest = cached[0], cached[1]
        else:
            entries, error = _sync_entries(flat, prepared)
        if engine.size > 1 and engine.rank == root and error is None and (has_objects or has_optimizer):
            # Pickle now, so that an unpicklable value fails here (held) instead of inside the broadcast.
            objects = [leaf for leaf, kind in zip(flat.leaves, flat.kinds) if kind == OBJECT]
            root_skeletons: list = []
            root_tensors: list = []
            for leaf, kind in zip(flat.leaves, flat.kinds):
                if kind == OPTIMIZER:
                    root_skeletons.append(_skeleton(leaf.state_dict(), root_tensors))
            payload = (pickle.dumps((objects, root_skeletons), protocol=pickle.HIGHEST_PROTOCOL), root_tensors)
    except Exception as exc:  # noqa: BLE001 - held, raised on every rank by agree()
        error = exc
    agree(engine, what, header, entries, error, digest)
    # agree() raised on every rank unless every rank flattened and described its tree
    assert flat is not None and entries is not None
    if engine.size == 1:
        if key is not None and cached is None:
            _remember(engine, key, what, header, entries, None)  # one rank moves nothing: no plan
        _buckets.mark_written(prepared.items)  # as on the root of a larger group (see below)
        return tree
    nbytes = header[1][1]
    is_root = engine.rank == root
    transport = engine.transport_for(_arrays.HOST)
    results = None
    items = prepared.items
    opt_items: list[_buckets.Item] = []
    loads = []  # (optimizer, root's state_dict skeleton) to load on non-root ranks
    if has_objects or has_optimizer:
        results = list(flat.leaves)
        assert payload is not None or not is_root  # the root pickled them above (agree() saw no error)
        data = transport.broadcast_object(payload[0] if payload is not None else None, root)
        err = None
        try:
            tensors: list = []
            if payload is not None:
                tensors = payload[1]
            else:
                objects, skeletons = pickle.loads(data)
                slots: list = []
                for skel in skeletons:
                    _slots(skel, slots)
                torch = _torch()
                for s in slots:  # on the device kind root's tensor is on ("cuda": the current device)
                    tensors.append(torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=s.device))
                objs = iter(objects)
                sk = iter(skeletons)
                for i, kind in enumerate(flat.kinds):
                    if kind == OBJECT:
                        results[i] = next(objs)
                    elif kind == OPTIMIZER:
                        loads.append((flat.leaves[i], next(sk)))
            opt_items = [_item(t) for t in tensors]
        except Exception as exc:  # noqa: BLE001 - e.g. a class root pickled that this rank cannot import
            err = exc
        agree(engine, what, (), [], err)  # all ranks unpickled root's values, or all raise
    plan = None if cached is None else cached[2]
    plan = _buckets.broadcast(engine, items + opt_items if opt_items else items, root, nbytes, plan)
    _buckets.mark_written(items)  # torch leaves: autograd's version counter (as a write under no_grad)
    if key is not None and cached is None:
        _remember(engine, key, what, header, entries, plan)
    if is_root:
        return tree
    for i, item in zip(prepared.index, items):
        if item.result is not item.leaf:
            if results is None:
                results = list(flat.leaves)
            results[i] = item.result
    if loads:
        tensors = [item.result for item in opt_items]
        for opt, skel in loads:
            opt.load_state_dict(_fill(skel, tensors))
    return tree if results is None else unflatten(flat, results)


def _sync_entries(flat: Flat, prepared: _Leaves) -> tuple[tuple, BaseException | None]:
    """The description entries of synchronize's tree, and the first error to hold (the slow path)."""
    entries = []
    error = None
    items = iter(prepared.items)
    for i, (leaf, path, kind) in enumerate(zip(flat.leaves, flat.paths, flat.kinds)):
        if kind == ARRAY:
            if i in prepared.errors:
                desc, err = prepared.failure(i, leaf, path)
                error = error or err
            else:
                desc = prepared.describe(next(items))
            entries.append((path, desc))
        elif kind == OPTIMIZER:
            entries.extend(_optimizer_entries(leaf, path))
        else:
            entries.append((path, "a non-array value"))
    return tuple(entries), error


# ---------------------------------------------------------------------------------------------------------
# allreduce_tree

_SCALARS = (bool, int, float, complex, np.generic)


@collective("allreduce_tree")
def allreduce_tree(engine, tree, op, bucket_bytes, asynchronous: bool = False, reproducible=None):
    """:func:`collectives.allreduce_tree` on the communicator of ``engine``; ``asynchronous``: the steps of a
    :class:`~collectives.Handle` instead (a generator: every host transfer started here, the tree
    returned once they are complete; see ``_buckets.start_allreduce``). ``reproducible``: True, False or
    None (the communicator's default): float and complex leaves summed reproducibly (``_reproducible``),
    part of what the ranks agree on."""
    what = "allreduce_tree"
    header: tuple[tuple[str, Any], ...] = (("op", op), ("bucket_bytes", bucket_bytes))
    repro = False
    entries, error, flat = None, None, None
    prepared = _Leaves()
    scalars: list[tuple[int, type]] = []  # (position in prepared.items, the scalar's type)
    pyints: list[int] = []  # leaf indices of Python ints: reduced exactly, in Python (arbitrary precision)
    aliases: list[tuple[int, int]] = []  # (leaf index, index of the first leaf that is the same object)
    key = cached = digest = None
    try:
        header = (("op", op), ("bucket_bytes", _bucket_bytes(bucket_bytes)))
        if asynchronous:  # agreed on: MPI does not match a non-blocking collective with a blocking one
            header += (("async_op", True),)
        op = _dtypes.check_op(op)
        repro = _reproducible_tree(reproducible, engine.reproducible, op)
        if repro:
            header += (("reproducible", True),)
        flat = flatten(tree)
        sig = prepared.sig
        seen: dict[int, int] = {}
        for i, (leaf, kind) in enumerate(zip(flat.leaves, flat.kinds)):
            if kind == ARRAY:
                first = seen.setdefault(id(leaf), i)
                if first != i:
                    aliases.append((i, first))
                    sig.append(first)
                else:
                    prepared.add(i, leaf)
            elif leaf is None:
                sig.append(None)
            elif type(leaf) is int:  # not bool, not np.integer: exact whatever its size (no int64 wrap)
                pyints.append(i)
                sig.append(int)
            elif isinstance(leaf, _SCALARS):
                item = _item(np.array(leaf))
                scalars.append((len(prepared.items), type(leaf)))
                prepared.items.append(item)
                prepared.index.append(i)
                sig.append((type(leaf), item.info.name))
            else:
                prepared.failed = True
                sig.append(OBJECT)
        if not prepared.failed:
            key = (what, header, flat.sig, tuple(sig))
            cached = _cached(engine, key)
        if cached is not None:
            entries, digest = cached[0], cached[1]
        else:
            entries, error = _reduce_entries(flat, prepared, op, repro)
    except Exception as exc:  # noqa: BLE001 - held, raised on every rank by agree()
        error = exc
    agree(engine, what, header, entries, error, digest)
    assert flat is not None  # agree() raised the error of a tree that did not flatten
    items = prepared.items
    if engine.check_nan:  # COLLECTIVES_CHECK_NAN: every rank, the tree agreed, before anything moves (_finite)
        paths, index = flat.paths, prepared.index
        _finite.check(engine.host, what, _finite.scan(None if it.view is None else (it.view, it.info) for it in items),
                      lambda n: f"leaf {render_path(paths[index[n]])}")
    plan = None if cached is None else cached[2]
    steps = None
    if asynchronous:
        plan, steps = _buckets.start_allreduce(engine, items, op, header[1][1], plan, reproducible=repro)
    else:
        plan = _buckets.allreduce(engine, items, op, header[1][1], plan, reproducible=repro)
    if key is not None and cached is None:
        assert entries is not None  # agree() raised the error of a tree that was not described
        _remember(engine, key, what, header, entries, plan)
    leaves = flat.leaves
    exact = _exact(engine, [leaves[i] for i in pyints], op) if pyints and engine.size > 1 else None  # blocking, now

    def finish():
        return _tree_result(flat, items, prepared, scalars, pyints, exact, aliases, tree)

    if steps is None:
        return finish()

    def run():
        yield from steps
        return finish()

    return run()


def _tree_result(flat, items, prepared, scalars, pyints, exact, aliases, tree):
    """allreduce_tree's result, once its transfers are complete: the tree itself where every leaf was
    updated in place, else a new tree with the new leaves."""
    _buckets.mark_written(items)  # torch leaves: autograd's version counter (as a write under no_grad)
    leaves = flat.leaves
    results = None
    if exact is not None:
        results = list(leaves)
        for i, value in zip(pyints, exact):
            results[i] = value
    for pos, scalar_type in scalars:
        item = items[pos]
        item.result = (item.result[()] if issubclass(scalar_type, np.generic)
                       else scalar_type(item.result.item()))
    for i, item in zip(prepared.index, items):
        if item.result is not leaves[i]:
            if results is None:
                results = list(leaves)
            results[i] = item.result
    if results is None:
        return tree
    for i, first in aliases:
        results[i] = results[first]
    return unflatten(flat, results)


_EXACT: dict[str, Callable[[Iterable[int]], int]] = {"sum": sum, "prod": math.prod, "min": min, "max": max}


def _exact(engine, values: list[int], op: str) -> list[int]:
    """Every rank's Python ints reduced with ``op`` in Python's arbitrary precision (one object allgather
    for all of a tree's ints; after the agreement, so every rank calls it), the same on every rank."""
    gathered = engine.transport_for(_arrays.HOST).allgather_object(values)
    return [_EXACT[op](column) for column in zip(*gathered)]


def _reproducible_tree(reproducible, default: bool, op: str) -> bool:
    """Whether allreduce_tree sums reproducibly: ``reproducible`` (True: only for sum and mean, else
    ValueError), else the communicator's ``default`` where ``op`` is a sum or mean."""
    if reproducible is None:
        return default and op in _reproducible.OPS
    if not isinstance(reproducible, (bool, np.bool_)):
        raise TypeError(f"reproducible must be True, False or None (the communicator's default), got "
                        f"{type(reproducible).__name__} {reproducible!r}")
    if reproducible and op not in _reproducible.OPS:
        raise ValueError(f"reproducible=True applies to op='sum' and op='mean', got op={op!r}: min and max give "
                         f"the same bits at any number of ranks already; drop reproducible=True")
    return bool(reproducible)


def _reproducible_leaf(info: _dtypes.DType, op: str) -> None:
    """A float or complex leaf of a reproducible tree must have a reproducible sum (integers are exact)."""
    if info.kind in "fc":
        _reproducible.check(info, op)


def _reduce_entries(flat: Flat, prepared: _Leaves, op: str, repro: bool = False) -> tuple[tuple, BaseException | None]:
    """The description entries of allreduce_tree's tree, and the first error to hold (the slow path)."""
    entries = []
    error = None
    paths = flat.paths
    items = iter(prepared.items)
    done: dict[int, int] = {}
    for i, (leaf, path, kind) in enumerate(zip(flat.leaves, paths, flat.kinds)):
        if kind == ARRAY:
            first = done.setdefault(id(leaf), i)
            if first != i:
                entries.append((path, f"the same array object as leaf {render_path(paths[first])}"))
                continue
            if i in prepared.errors:
                desc, err = prepared.failure(i, leaf, path)
            else:
                item = next(items)
                desc, err = prepared.describe(item), None
                try:
                    _dtypes.check_reduction(item.info, op)
                    if repro:
                        _reproducible_leaf(item.info, op)
                except TypeError as exc:
                    err = _at(path, exc)
            entries.append((path, desc))
            error = error or err
        elif leaf is None:
            entries.append((path, "None"))
        elif type(leaf) is int:
            entries.append((path, "a Python int (exact)"))
            try:
                _ops.check("i", "Python int", op)  # mean would truncate: refused, as for integer arrays
            except TypeError as exc:
                error = error or _at(path, TypeError(f"Python int scalar: {exc}"))
        elif isinstance(leaf, _SCALARS):
            item = next(items)
            info = item.info
            name = type(leaf).__name__ if isinstance(leaf, np.generic) else f"Python {type(leaf).__name__}"
            entries.append((path, f"a {name} scalar ({info.name})"))
            try:
                _dtypes.check_reduction(info, op)
                if repro:
                    _reproducible_leaf(info, op)
            except TypeError as exc:
                error = error or _at(path, TypeError(f"{name} scalar: {exc}"))
        else:
            entries.append((path, f"a {type(leaf).__name__} (not an array)"))
            hint = (_arrays.TRACER_HINT if _arrays.is_tracer(leaf)
                    else "use synchronize() to copy root's optimizer state" if kind == OPTIMIZER
                    else "allreduce_tree reduces arrays and numbers; take it out of the tree, or use "
                         "synchronize() to copy root's value")
            error = error or TypeError(f"leaf {render_path(path)}: cannot reduce a "
                                       f"{type(leaf).__name__}; {hint}")
    return tuple(entries), error

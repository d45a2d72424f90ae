"""Trees of arrays: canonical flattening, structure fingerprints, and the tree collectives.

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
3. move the data in fused buckets (``_buckets``) and rebuild the tree.

torch is never imported here: a tensor, module or optimizer can only exist if the user imported torch, so
they are recognised through ``sys.modules``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import pickle
import sys
from typing import Any, NamedTuple

import numpy as np

from . import _arrays, _buckets, _config, _dtypes
from ._errors import CollectiveError, MismatchError

# ---------------------------------------------------------------------------------------------------------
# flatten / unflatten
#
# A leaf's path is a string built on the way down: ``['key']`` for a dict key, ``[i]`` for a sequence index,
# ``.name`` for a namedtuple/dataclass field or a module's parameter (``.0.weight``); the tree itself is "".

ARRAY, OBJECT, OPTIMIZER = "array", "object", "optimizer"  # leaf kinds

# A marker class attribute by which wrappers (DistributedOptimizer) say "flatten my inner optimizer".
WRAPPER_ATTRIBUTE = "_collectives_inner_optimizer"


def render_path(path: str) -> str:
    """A path for messages (the empty path is the tree itself)."""
    return path or "<the tree itself>"


def _torch():
    return sys.modules.get("torch")


# What a type is, decided once per type: a container kind, or a leaf kind. Safe to cache: a torch type
# cannot be seen before torch is imported, and after that the checks below see it.
_DICT, _LIST, _TUPLE, _NAMEDTUPLE, _DATACLASS, _MODULE, _WRAPPER = (
    "dict", "list", "tuple", "namedtuple", "dataclass", "module", "wrapper")
_KIND: dict[type, str] = {dict: _DICT, list: _LIST, tuple: _TUPLE, np.ndarray: ARRAY}


def _kind_of_type(t: type) -> str:
    hit = _KIND.get(t)
    if hit is not None:
        return hit
    torch = _torch()
    if issubclass(t, dict):
        kind = _DICT
    elif issubclass(t, tuple):
        kind = _NAMEDTUPLE if hasattr(t, "_fields") else _TUPLE
    elif issubclass(t, list):
        kind = _LIST
    elif issubclass(t, np.ndarray) or torch is not None and issubclass(t, torch.Tensor):
        kind = ARRAY
    elif issubclass(t, (np.generic, type)):
        kind = OBJECT
    elif dataclasses.is_dataclass(t):
        kind = _DATACLASS
    elif getattr(t, WRAPPER_ATTRIBUTE, False):
        kind = _WRAPPER
    elif "torch.nn" in sys.modules and issubclass(t, sys.modules["torch.nn"].Module):
        kind = _MODULE
    elif "torch.optim" in sys.modules and issubclass(t, sys.modules["torch.optim"].Optimizer):
        kind = OPTIMIZER
    elif hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__"):
        kind = ARRAY
    else:
        kind = OBJECT
    _KIND[t] = kind
    return kind


def is_array(x) -> bool:
    """True for an array leaf: a NumPy array, a torch tensor, or anything with ``__dlpack__``."""
    return _kind_of_type(type(x)) == ARRAY


def is_torch_optimizer(x) -> bool:
    return _kind_of_type(type(x)) == OPTIMIZER


def sorted_keys(keys) -> list:
    """Keys in canonical order: sorted by value, else by ``(type name, repr)`` when they do not compare."""
    keys = list(keys)
    try:
        return sorted(keys)
    except TypeError:
        return sorted(keys, key=lambda k: (type(k).__name__, repr(k)))


class _Node:
    """One container in a tree definition."""

    __slots__ = ("kind", "obj", "keys", "children")

    def __init__(self, kind, obj, keys, children):
        self.kind = kind  # "dict" "list" "tuple" "namedtuple" "dataclass" "module" "wrapper"
        self.obj = obj  # the original container
        self.keys = keys  # the keys/indices/names of the children, in flat order
        self.children = children  # child nodes; None marks a leaf position


class Flat:
    """A flattened tree: ``leaves[i]`` sits at ``paths[i]`` and is of kind ``kinds[i]``."""

    __slots__ = ("leaves", "paths", "kinds", "treedef")

    def __init__(self):
        self.leaves: list = []
        self.paths: list[str] = []
        self.kinds: list[str] = []
        self.treedef = None


def flatten(tree) -> Flat:
    """Flatten ``tree`` in canonical order (see the module docstring).

    Example:
        >>> from collectives._tree import flatten
        >>> flat = flatten({"b": [1, 2], "a": {"y": None, "x": 3}})
        >>> flat.paths
        ["['a']['x']", "['a']['y']", "['b'][0]", "['b'][1]"]
        >>> flat.leaves
        [3, None, 1, 2]
    """
    flat = Flat()
    flat.treedef = _flatten(tree, "", flat, set())
    return flat


def _flatten(x, path: str, flat: Flat, active: set):
    kind = _kind_of_type(type(x))
    if kind in (ARRAY, OBJECT, OPTIMIZER):
        flat.leaves.append(x)
        flat.paths.append(path)
        flat.kinds.append(kind)
        return None
    if kind == _MODULE:
        named = dict(x.named_parameters())
        named.update(x.named_buffers())
        keys = sorted(named)
        for k in keys:
            flat.leaves.append(named[k])
            flat.paths.append(f"{path}.{k}")
            flat.kinds.append(ARRAY)
        return _Node(kind, x, keys, [None] * len(keys))
    if kind == _WRAPPER:
        return _Node(kind, x, [None], [_flatten(x.inner, path, flat, active)])
    if id(x) in active:
        raise ValueError(f"the tree contains itself at {render_path(path)}; trees must not be cyclic")
    active.add(id(x))
    try:
        if kind == _DICT:
            keys = sorted_keys(x.keys())
            children = [_flatten(x[k], f"{path}[{k!r}]", flat, active) for k in keys]
        elif kind == _LIST or kind == _TUPLE:
            keys = None
            children = [_flatten(v, f"{path}[{i}]", flat, active) for i, v in enumerate(x)]
        elif kind == _NAMEDTUPLE:
            keys = type(x)._fields
            children = [_flatten(v, f"{path}.{k}", flat, active) for k, v in zip(keys, x)]
        else:  # dataclass
            keys = [f.name for f in dataclasses.fields(x)]
            children = [_flatten(getattr(x, k), f"{path}.{k}", flat, active) for k in keys]
    finally:
        active.discard(id(x))
    return _Node(kind, x, keys, children)


def unflatten(flat: Flat, leaves: list) -> Any:
    """Rebuild the tree of ``flat`` with ``leaves`` (same order); unchanged containers are reused.

    Example:
        >>> from collectives._tree import flatten, unflatten
        >>> tree = {"b": (1, 2), "a": [3]}
        >>> flat = flatten(tree)
        >>> unflatten(flat, [30, 10, 20])
        {'b': (10, 20), 'a': [30]}
        >>> unflatten(flat, list(flat.leaves)) is tree
        True
    """
    it = iter(leaves)
    return _build(flat.treedef, it)


def _build(node, it):
    if node is None:
        return next(it)
    children = [_build(c, it) for c in node.children]
    x = node.obj
    kind = node.kind
    if kind == _MODULE or kind == _WRAPPER:  # updated in place
        return x
    if kind == _DICT:
        old = [x[k] for k in node.keys]
    elif kind == _DATACLASS:
        old = [getattr(x, k) for k in node.keys]
    else:
        old = x
    if all(a is b for a, b in zip(children, old)):
        return x
    t = type(x)
    if kind == _DICT:
        by_key = dict(zip(node.keys, children))
        if t is dict:
            return {k: by_key[k] for k in x}
        new = copy.copy(x)  # keeps OrderedDict order, a defaultdict's factory, ...
        for k in x:
            new[k] = by_key[k]
        return new
    if kind == _NAMEDTUPLE:
        return t._make(children)
    if kind == _DATACLASS:
        new = copy.copy(x)
        for k, a, b in zip(node.keys, children, old):
            if a is not b:
                object.__setattr__(new, k, a)  # also for frozen dataclasses
        return new
    if t is list or t is tuple:
        return t(children)
    try:
        return t(children)
    except TypeError:
        return list(children) if kind == _LIST else tuple(children)


def map_leaves(fn, tree, *rest):
    """``fn`` applied to the leaves of ``tree`` (and the matching leaves of ``rest``), same structure.

    Example:
        >>> from collectives._tree import map_leaves
        >>> map_leaves(lambda a, b: a + b, {"x": 1, "y": [2]}, {"x": 10, "y": [20]})
        {'x': 11, 'y': [22]}
    """
    flat = flatten(tree)
    others = [flatten(r).leaves for r in rest]
    for o in others:
        if len(o) != len(flat.leaves):
            raise ValueError(f"trees of different structure: {len(flat.leaves)} leaves and {len(o)} leaves")
    return unflatten(flat, [fn(*args) for args in zip(flat.leaves, *others)])


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


def digest(header: tuple, entries: list) -> bytes:
    """16 bytes identifying a description: blake2b of its text (stable across processes and runs)."""
    text = repr(header) + "\n" + "\n".join(map("\t".join, entries))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def agree(comm, what: str, header: tuple, entries: list | None, error: BaseException | None) -> None:
    """Make every rank agree on (header, entries) before any data moves; raise the same way everywhere.

    ``header`` is a tuple of ``(name, value)`` pairs (the call's arguments that must match); ``entries`` a
    list of ``(path, description)`` strings, or ``None`` when this rank could not describe its tree (then
    ``error`` is set). One Allgather of 17 bytes per rank when everything agrees.
    """
    if comm.size == 1:
        if error is not None:
            raise error
        return
    transport = comm._transport_for(_arrays.HOST)
    mine = np.zeros(17, dtype=np.uint8)
    if entries is not None:
        mine[:16] = np.frombuffer(digest(header, entries), dtype=np.uint8)
    mine[16] = error is not None
    table = np.empty((comm.size, 17), dtype=np.uint8)
    transport.allgather(mine, table)
    same = bool((table[:, :16] == table[0, :16]).all()) and entries is not None
    failed = bool(table[:, 16].any())
    if same and not failed:
        return
    if (table[:, :16] == 0).all(axis=1).any():
        same = False  # somebody could not describe its tree: report the error, not a mismatch
    note = None if error is None else f"{type(error).__name__}: {error}"
    gathered = transport.allgather_object((None if same else (header, entries), note))
    descriptions = [d for d, _ in gathered]
    if not same and all(d is not None and d[1] is not None for d in descriptions):
        raise MismatchError(mismatch_message(what, descriptions))
    if error is not None:
        raise error
    rank, text = next((r, n) for r, (_, n) in enumerate(gathered) if n is not None)
    raise CollectiveError(f"{what}: rank {rank} rejected the call ({text}); nothing was sent or changed on "
                          f"any rank")


def mismatch_message(what: str, descriptions: list) -> str:
    """Name the first difference between rank 0's description and the first rank that differs from it."""
    base = descriptions[0]
    differing = [r for r, d in enumerate(descriptions) if d != base]
    other = differing[0]
    (h0, e0), (h1, e1) = base, descriptions[other]
    ranks = ", ".join(map(str, differing))
    tail = (f" (ranks differing from rank 0: {ranks}). Every rank must pass the same arguments and a tree of "
            f"the same structure (keys, shapes, dtypes, device kinds); nothing was sent or changed on any rank")
    for (name, a), (_, b) in zip(h0, h1):
        if a != b:
            return f"{what}: {name}: rank 0 has {a!r}, rank {other} has {b!r}{tail}"
    m0, m1 = dict(e0), dict(e1)
    diffs = [(p, d, m1.get(p)) for p, d in e0 if m1.get(p) != d]
    diffs += [(p, None, d) for p, d in e1 if p not in m0]
    shown = "; ".join(f"leaf {render_path(p)}: rank 0 has {a or 'no such leaf'}, rank {other} has "
                      f"{b or 'no such leaf'}" for p, a, b in diffs[:3])
    more = f"; and {len(diffs) - 3} more" if len(diffs) > 3 else ""
    return f"{what}: {shown}{more}{tail}"


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


def _array_item(comm, x, path) -> tuple[_buckets.Item | None, str, BaseException | None]:
    """The bucket item and the description of an array leaf (and an error to hold, if any).

    Host leaves get a NumPy view (fused collectives). Leaves on a device (CUDA) get no view: they are
    moved one by one by the Communicator's own collectives, whose device transport is only made after
    every rank agreed (making one may itself be collective).
    """
    a = _arrays.adapter(x)
    if type(x) is np.ndarray:  # the common case, without the device look-up
        view, info = a.host_view(x)
        return _buckets.Item(x, a, view, info, _arrays.HOST), f"{info.name} {view.shape}", None
    device = a.device(x)
    kind = device_kind(device)
    if kind != "cpu":
        name = str(getattr(x, "dtype", "?")).replace("torch.", "")
        shape = tuple(int(n) for n in getattr(x, "shape", ()))
        return _buckets.Item(x, a, None, _info_from_name(name), device), array_desc(name, shape, kind), None
    try:
        view, info = a.host_view(x)
    except Exception as exc:  # noqa: BLE001 - held and re-raised on every rank by agree()
        name = str(getattr(x, "dtype", "?")).replace("torch.", "")
        shape = tuple(int(n) for n in getattr(x, "shape", ()))
        return None, array_desc(name, shape, kind), _at(path, exc)
    return _buckets.Item(x, a, view, info, device), f"{info.name} {view.shape}", None


def _info_from_name(name: str) -> _dtypes.DType:
    """A dtype description from a dtype's name (for arrays whose memory we cannot view from the host)."""
    if name == "bfloat16":
        return _dtypes.bfloat16()
    try:
        return _dtypes.from_numpy(np.dtype(name))
    except TypeError:
        return _dtypes.opaque(name, np.dtype(np.uint8))


def _at(path, exc: BaseException) -> BaseException:
    """The same kind of exception, its message prefixed by the leaf's path."""
    try:
        new = type(exc)(f"leaf {render_path(path)}: {exc}")
    except Exception:  # noqa: BLE001 - an exception type with another signature: keep it as it is
        return exc
    new.__cause__ = exc.__cause__
    return new


# ---------------------------------------------------------------------------------------------------------
# synchronize


class _TensorSlot(NamedTuple):
    """Stands for a tensor in a pickled optimizer state_dict skeleton."""

    index: int
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
        return tensors[skel.index]
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


def synchronize(tree, root: int = 0, *, comm=None, bucket_bytes: int | None = None):
    """Make every leaf of ``tree`` equal to root's: parameters, buffers, optimizer state, settings.

    Every rank of ``comm`` must call it with the same ``root`` and a tree of the same structure. Before
    any data moves the ranks compare a 16-byte fingerprint of their trees (paths, array shapes, dtypes and
    device kinds; the paths of non-array leaves, not their values); if they differ, every rank raises
    :class:`MismatchError` naming the first differing leaf, and nothing changes anywhere.

    What moves:

    - array leaves (NumPy, torch incl. parameters that require grad, anything with ``__dlpack__``): root's
      values, bit for bit, in fused buckets; in place where the library allows (writable NumPy arrays,
      torch tensors), else a new array in the returned tree (read-only NumPy, array-api-strict, JAX);
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
        bucket_bytes: the size bound of one fused buffer (default ``COLLECTIVES_BUCKET_BYTES``, 25 MiB).

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
    from ._comm import _resolve

    c = _resolve(comm)
    what = "synchronize"
    header = (("root", root), ("bucket_bytes", bucket_bytes))
    entries, error, flat, items = None, None, None, []
    payload = None
    try:
        root = c._check_root(root)
        header = (("root", root), ("bucket_bytes", _bucket_bytes(bucket_bytes)))
        flat = flatten(tree)
        entries = []
        for i, (leaf, path, kind) in enumerate(zip(flat.leaves, flat.paths, flat.kinds)):
            if kind == ARRAY:
                item, desc, err = _array_item(c, leaf, path)
                items.append((i, item))
                entries.append((path, desc))
                error = error or err
            elif kind == OPTIMIZER:
                entries.extend(_optimizer_entries(leaf, path))
            else:
                entries.append((path, "a non-array value"))
        if c.size > 1 and c.rank == root and error is None and any(k != ARRAY for k in flat.kinds):
            # Pickle now, so that an unpicklable value fails here (held) instead of inside the broadcast.
            objects = [leaf for leaf, kind in zip(flat.leaves, flat.kinds) if kind == OBJECT]
            skeletons, tensors = [], []
            for leaf, kind in zip(flat.leaves, flat.kinds):
                if kind == OPTIMIZER:
                    skeletons.append(_skeleton(leaf.state_dict(), tensors))
            payload = (pickle.dumps((objects, skeletons), protocol=pickle.HIGHEST_PROTOCOL), tensors)
    except Exception as exc:  # noqa: BLE001 - held, raised on every rank by agree()
        error = exc
    agree(c, what, header, entries, error)
    if c.size == 1:
        return tree
    nbytes = header[1][1]
    is_root = c.rank == root
    transport = c._transport_for(_arrays.HOST)
    results = list(flat.leaves)
    opt_items: list[_buckets.Item] = []
    loads = []  # (optimizer, root's state_dict skeleton) to load on non-root ranks
    if any(k != ARRAY for k in flat.kinds):
        data = transport.broadcast_object(payload[0] if is_root else None, root)
        err = None
        try:
            objects, skeletons = pickle.loads(data) if not is_root else (None, None)
            if is_root:
                tensors = payload[1]
            else:
                tensors, slots = [], []
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
            for t in tensors:
                item, _, e = _array_item(c, t, "")
                if e is not None:
                    raise e
                opt_items.append(item)
        except Exception as exc:  # noqa: BLE001 - e.g. a class root pickled that this rank cannot import
            err = exc
        agree(c, what, (), [], err)  # all ranks unpickled root's values, or all raise
    all_items = [item for _, item in items] + opt_items
    _buckets.broadcast(c, all_items, root, nbytes)
    if not is_root:
        for i, item in items:
            results[i] = item.result
        tensors = [item.result for item in opt_items]
        for opt, skel in loads:
            opt.load_state_dict(_fill(skel, tensors))
    return unflatten(flat, results)


# ---------------------------------------------------------------------------------------------------------
# allreduce_tree

_SCALARS = (bool, int, float, complex, np.generic)


def allreduce_tree(tree, op: str = "mean", *, comm=None, bucket_bytes: int | None = None):
    """Reduce every array leaf of ``tree`` over all ranks, fused into few collectives.

    Every rank must call it with the same ``op`` and a tree of the same structure (checked first, with
    one 17-byte Allgather; on a difference every rank raises :class:`MismatchError` and nothing changes).

    Small leaves are packed into flat buffers per (device, dtype) of at most ``bucket_bytes`` each, one
    collective per buffer; a leaf of 1 MiB or more (or a quarter of ``bucket_bytes``) is reduced on its
    own, in its own memory when it is contiguous and writable, so large gradients are never copied.
    Results are written back into the caller's arrays where they are writable (NumPy, torch), else new
    arrays are returned in the result tree. Leaves may be of mixed dtypes and libraries; leaves that are
    the same object are reduced once (distinct leaves must not overlap in memory, e.g. ``x`` and
    ``x[:2]``: the overlap would be reduced twice).

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
    from ._comm import _resolve

    c = _resolve(comm)
    what = "allreduce_tree"
    header = (("op", op), ("bucket_bytes", bucket_bytes))
    entries, error, flat = None, None, None
    items: list[tuple[int, _buckets.Item, Any]] = []  # (leaf index, item, how to return it)
    aliases: list[tuple[int, int]] = []  # (leaf index, index of the first leaf that is the same object)
    try:
        header = (("op", op), ("bucket_bytes", _bucket_bytes(bucket_bytes)))
        op = _dtypes.check_op(op)
        flat = flatten(tree)
        entries = []
        seen: dict[int, tuple[int, str]] = {}
        for i, (leaf, path, kind) in enumerate(zip(flat.leaves, flat.paths, flat.kinds)):
            if kind == ARRAY:
                first = seen.get(id(leaf))
                if first is not None:
                    aliases.append((i, first[0]))
                    entries.append((path, f"the same array object as leaf {render_path(first[1])}"))
                    continue
                seen[id(leaf)] = (i, path)
                item, desc, err = _array_item(c, leaf, path)
                entries.append((path, desc))
                if err is None:
                    try:
                        _dtypes.check_reduction(item.info, op)
                    except TypeError as exc:
                        err = _at(path, exc)
                    items.append((i, item, None))
                error = error or err
            elif leaf is None:
                entries.append((path, "None"))
            elif isinstance(leaf, _SCALARS):
                arr = np.array(leaf)
                info = _dtypes.from_numpy(arr.dtype)
                name = type(leaf).__name__ if isinstance(leaf, np.generic) else f"Python {type(leaf).__name__}"
                entries.append((path, f"a {name} scalar ({info.name})"))
                try:
                    _dtypes.check_reduction(info, op)
                except TypeError as exc:
                    error = error or _at(path, TypeError(f"{name} scalar: {exc}"))
                a = _arrays.adapter(arr)
                view, info = a.host_view(arr)
                items.append((i, _buckets.Item(arr, a, view, info, _arrays.HOST), type(leaf)))
            else:
                entries.append((path, f"a {type(leaf).__name__} (not an array)"))
                hint = ("use synchronize() to copy root's optimizer state" if kind == OPTIMIZER
                        else "allreduce_tree reduces arrays and numbers; take it out of the tree, or use "
                             "synchronize() to copy root's value")
                error = error or TypeError(f"leaf {render_path(path)}: cannot reduce a "
                                           f"{type(leaf).__name__}; {hint}")
    except Exception as exc:  # noqa: BLE001 - held, raised on every rank by agree()
        error = exc
    agree(c, what, header, entries, error)
    _buckets.allreduce(c, [item for _, item, _ in items], op, header[1][1])
    results = list(flat.leaves)
    for i, item, scalar_type in items:
        if scalar_type is None:
            results[i] = item.result
        elif issubclass(scalar_type, np.generic):
            results[i] = item.result[()]
        else:
            results[i] = scalar_type(item.result.item())
    for i, first in aliases:
        results[i] = results[first]
    return unflatten(flat, results)

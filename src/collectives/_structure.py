"""The structure of a tree of arrays: canonical flattening (:func:`flatten`), rebuilding
(:func:`unflatten`), and a map over the leaves (:func:`map_leaves`). What a tree is, and the canonical
order, are in ``_tree``'s docstring; the tree collectives there build on this.

torch is never imported here: a tensor, module or optimizer can only exist if the user imported torch, so
they are recognised through ``sys.modules``.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any

import numpy as np

from ._agree import render_path

# ---------------------------------------------------------------------------------------------------------
# flatten / unflatten
#
# A leaf's path is a string built on the way down: ``['key']`` for a dict key, ``[i]`` for a sequence index,
# ``.name`` for a namedtuple/dataclass field or a module's parameter (``.0.weight``); the tree itself is "".

ARRAY, OBJECT, OPTIMIZER = "array", "object", "optimizer"  # leaf kinds

# A marker class attribute by which wrappers (DistributedOptimizer) say "flatten my inner optimizer".
WRAPPER_ATTRIBUTE = "_collectives_inner_optimizer"


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
    elif issubclass(t, np.ndarray) or (torch is not None and issubclass(t, torch.Tensor)):
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
    if not isinstance(keys, (dict, list, tuple)):
        keys = list(keys)  # iterated twice when the keys do not compare
    try:
        return sorted(keys)
    except TypeError:
        return sorted(keys, key=lambda k: (type(k).__name__, repr(k)))


class _Node:
    """One container in a tree definition."""

    __slots__ = ("children", "keys", "kind", "obj")

    def __init__(self, kind, obj, keys, children):
        self.kind = kind  # "dict" "list" "tuple" "namedtuple" "dataclass" "module" "wrapper"
        self.obj = obj  # the original container
        self.keys = keys  # the keys/names of the children, in flat order (None for lists and tuples)
        self.children = children  # child nodes; None marks a leaf position


class Flat:
    """A flattened tree: ``leaves[i]`` sits at ``paths[i]`` and is of kind ``kinds[i]``.

    ``sig`` describes the containers (their kinds and keys, in flat order) so that, together with a
    description of the leaves, it identifies the tree's structure without building any path string;
    ``paths`` are made on first use (messages and fingerprints need them, a repeated call does not).
    """

    __slots__ = ("_paths", "kinds", "leaves", "sig", "treedef")

    def __init__(self):
        self.leaves: list = []
        self.kinds: list[str] = []
        self.treedef = None
        self.sig: tuple = ()
        self._paths: list[str] | None = None

    @property
    def paths(self) -> list[str]:
        if self._paths is None:
            out: list[str] = []
            _paths_of(self.treedef, "", out)
            self._paths = out
        return self._paths


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
    sig: list = []
    try:
        flat.treedef = _flatten(tree, flat.leaves, flat.kinds, sig)
    except RecursionError as exc:
        # A cyclic tree recurses without end; find the cycle and name it (iteratively: the tree is deep).
        _find_cycle(tree, "", set())
        raise ValueError(f"the tree is nested more than {sys.getrecursionlimit()} levels deep (Python's "
                         f"recursion limit): flatten it, or raise the limit with sys.setrecursionlimit()") from exc
    flat.sig = tuple(sig)
    return flat


_LEAF_KINDS = frozenset((ARRAY, OBJECT, OPTIMIZER))


def _flatten(x, leaves: list, kinds: list, sig: list):
    t = type(x)
    kind = _KIND.get(t) or _kind_of_type(t)
    if kind in _LEAF_KINDS:
        leaves.append(x)
        kinds.append(kind)
        return None
    if kind == _DICT:
        keys = sorted_keys(x)
        sig.append((kind, tuple(keys), tuple(map(type, keys))))  # 1 and True are equal keys, not equal paths
        return _Node(kind, x, keys, _children([x[k] for k in keys], leaves, kinds, sig))
    if kind in (_LIST, _TUPLE):
        sig.append((kind, len(x)))
        return _Node(kind, x, None, _children(x, leaves, kinds, sig))
    if kind == _NAMEDTUPLE:
        sig.append((kind, t))
        return _Node(kind, x, t._fields, _children(x, leaves, kinds, sig))
    if kind == _DATACLASS:
        keys = [f.name for f in dataclasses.fields(x)]
        sig.append((kind, tuple(keys)))
        return _Node(kind, x, keys, _children([getattr(x, k) for k in keys], leaves, kinds, sig))
    if kind == _MODULE:
        named = dict(x.named_parameters())
        named.update(x.named_buffers())
        keys = sorted(named)
        sig.append((kind, tuple(keys)))
        for k in keys:
            leaves.append(named[k])
            kinds.append(ARRAY)
        return _Node(kind, x, keys, [None] * len(keys))
    # a wrapper (DistributedOptimizer): its inner optimizer, at the same path
    sig.append((kind,))
    return _Node(kind, x, [None], [_flatten(x.inner, leaves, kinds, sig)])


def _children(values, leaves: list, kinds: list, sig: list) -> list:
    """The child nodes of a container's values (None for a leaf), leaves appended on the way."""
    out: list[_Node | None] = []
    for v in values:
        kind = _KIND.get(type(v))
        if kind is ARRAY or kind is OBJECT:  # the common leaves, without a call
            leaves.append(v)
            kinds.append(kind)
            out.append(None)
        else:
            out.append(_flatten(v, leaves, kinds, sig))
    return out


def _paths_of(node, path: str, out: list) -> None:
    """Append the path of every leaf under ``node`` (at ``path``), in flat order."""
    if node is None:
        out.append(path)
        return
    kind = node.kind
    if kind == _WRAPPER:
        _paths_of(node.children[0], path, out)
    elif kind == _DICT:
        for k, child in zip(node.keys, node.children):
            _paths_of(child, f"{path}[{k!r}]", out)
    elif kind in (_LIST, _TUPLE):
        for i, child in enumerate(node.children):
            _paths_of(child, f"{path}[{i}]", out)
    else:  # namedtuple, dataclass, module
        for k, child in zip(node.keys, node.children):
            _paths_of(child, f"{path}.{k}", out)


def _find_cycle(x, path: str, active: set) -> None:
    """Raise ValueError naming where ``x`` contains itself, if it does (after a RecursionError).

    Depth-first with an explicit stack (the tree is deeper than the recursion limit): ``active`` holds
    the ids of the containers on the current path; a ``None`` entry on the stack closes one of them.
    """
    stack: list = [(x, path)]
    open_ids: list = []
    while stack:
        entry = stack.pop()
        if entry is None:
            active.discard(open_ids.pop())
            continue
        x, path = entry
        kind = _kind_of_type(type(x))
        while kind == _WRAPPER:
            x = x.inner
            kind = _kind_of_type(type(x))
        if kind in _LEAF_KINDS or kind == _MODULE:
            continue
        if id(x) in active:
            raise ValueError(f"the tree contains itself at {render_path(path)}; trees must not be cyclic")
        active.add(id(x))
        open_ids.append(id(x))
        if kind == _DICT:
            children = [(x[k], f"{path}[{k!r}]") for k in sorted_keys(x)]
        elif kind == _DATACLASS:
            children = [(getattr(x, f.name), f"{path}.{f.name}") for f in dataclasses.fields(x)]
        elif kind == _NAMEDTUPLE:
            children = [(v, f"{path}.{k}") for k, v in zip(type(x)._fields, x)]
        else:
            children = [(v, f"{path}[{i}]") for i, v in enumerate(x)]
        stack.append(None)
        stack.extend(reversed(children))


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
    if kind in (_MODULE, _WRAPPER):  # updated in place
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

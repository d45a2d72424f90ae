"""A call as the user made it: the one description every check of a collective compares.

The engine describes each collective once, when it has validated it (``_comm.validate.prepare``, the tree
and bucket layers for their flat buffers), from what the caller passed, never from the buffer that goes on
the wire (after bool became uint8, floats' min/max ordered integers, mean a sum):

- ``collective``: allreduce, reduce, broadcast, ... (:data:`COLLECTIVES`);
- ``op``: the op as the caller named it (mean is not sum; the torch backend's AVG and PREMUL_SUM are ops
  of their own, named through :func:`naming`; a reproducible sum or mean, ``reproducible=True``, is
  ``"reproducible sum"`` or ``"reproducible mean"``, never matched by an ordinary sum);
- ``dtype``: a 62-bit digest of the caller's dtype described exactly (its name, kind, byte order, item
  size, datetime unit, fields: :func:`dtype_code`), the same for the same dtype in any process;
- ``structure``: the layout a tree bucket or a gradient bucket belongs to (0 for a single array);
- ``root`` (-1 where there is none) and ``count``, the caller's number of elements.

Checked mode's agreement compares this and the array's shape (``_comm.validate.agree_host``); the fingerprint
every non-blocking path reduces beside its call (``_backends.mpi``) carries these fields, so a call that
checked mode refuses for its collective, op, dtype, count or root is a MismatchError beside it too. NumPy
and the standard library only.

Example:
    >>> import numpy as np
    >>> from collectives import _call, _dtypes
    >>> f32, i32 = (_dtypes.from_numpy(np.dtype(t)) for t in ("float32", "int32"))
    >>> _call.describe("allreduce", "mean", f32, 8) == _call.describe("allreduce", "sum", f32, 8)
    False
    >>> _call.describe("allreduce", "min", f32, 8) == _call.describe("allreduce", "min", i32, 8)
    False
    >>> _call.render("dtype", _call.dtype_code(f32)), _call.render("op", _call.describe("reduce", "max", i32, 1)[1])
    ('float32', 'max')
"""

from __future__ import annotations

import contextlib
import hashlib
from contextvars import ContextVar

import numpy as np

from ._dtypes import DType, from_numpy

COLLECTIVES = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "alltoall", "barrier", "gather")
OPS = ("sum", "prod", "min", "max", "mean", "avg", "premul_sum",  # the library's and the torch backend's
       "reproducible sum", "reproducible mean")  # reproducible=True (_reproducible): calls of their own
FIELDS = ("collective", "op", "dtype", "structure", "root", "count")  # in this order (see describe)
_OP_CODES = {name: i for i, name in enumerate(OPS)}
_MASK = (1 << 62) - 1  # codes stay below 2**62: the fingerprint carries each field and its negation

_codes: dict[DType, int] = {}  # DType -> its code (computed once per dtype in use)
_heads: dict = {}  # (collective, op, id(info), root, naming) -> (info, head): see head
_names: dict[int, str] = {}  # code -> the dtype's name, for messages (the codes this process has met)
_naming: ContextVar[tuple[str | None, int]] = ContextVar("collectives_call_naming", default=(None, 0))


def dtype_code(info: DType) -> int:
    """The code of ``info``: a digest of its full description (name, and the exact NumPy storage dtype,
    whose repr names byte order, item size, unit and fields): one-to-one in practice (62 bits), stable
    across processes, runs and library versions."""
    code = _codes.get(info)
    if code is None:
        text = f"{info.name}\0{info.kind}\0{info.storage!r}".encode()
        code = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & _MASK
        _codes[info] = code
        _names.setdefault(code, info.name)
    return code


def structure_code(*parts) -> int:
    """A 62-bit digest of a layout (a tree's or gradient bucket's description; parts are str or int)."""
    text = "\0".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & _MASK or 1


@contextlib.contextmanager
def naming(op: str | None = None, structure: int = 0):
    """Calls made inside are described with ``op`` as their op (a front end's own name for what it runs as
    another op: the torch backend's ``avg`` of integers runs as a sum) and with ``structure`` (a bucket's
    layout). Nothing else changes about the calls.

    Example:
        >>> from collectives import _call
        >>> with _call.naming("avg"):
        ...     _call.naming_now()
        ('avg', 0)
    """
    token = _naming.set((op, structure))
    try:
        yield
    finally:
        _naming.reset(token)


def naming_now() -> tuple[str | None, int]:
    """``(op, structure)`` set by the innermost :func:`naming`, or ``(None, 0)``."""
    return _naming.get()


def head(collective: str, op: str | None, info: DType | None, root: int = -1) -> tuple[int, ...]:
    """The fields of a call but its count: ``(collective, op, dtype, structure, root)`` (see
    :func:`describe`; the hot path appends the count of each call)."""
    naming = _naming.get()
    key = (collective, op, id(info), root, naming)
    hit = _heads.get(key)
    if hit is not None and hit[0] is info:
        return hit[1]
    named, structure = naming
    fields = (COLLECTIVES.index(collective), -1 if op is None else _OP_CODES[named if named is not None else op],
              0 if info is None else dtype_code(info), structure, root)
    if len(_heads) >= 4096:  # a few per (collective, op, dtype, root) in use
        _heads.clear()
    _heads[key] = (info, fields)  # (info kept: its id is not reused while the entry lives)
    return fields


def describe(collective: str, op: str | None, info: DType | None, count: int, root: int = -1) -> tuple[int, ...]:
    """The description of a call (:data:`FIELDS`), as plain ints: ``op`` None for a collective without
    one, ``info`` None for one without an array (barrier)."""
    return head(collective, op, info, root) + (count,)


def dtype_name(code: int) -> str:
    """The name of the dtype of ``code``, if this process has met it (or it is a NumPy builtin)."""
    if code not in _names:
        _known()
    return _names.get(code, f"a dtype this rank has not used (code {code:#x})")


def _known() -> None:
    """Fill the names of NumPy's builtin dtypes, both byte orders and every datetime unit (for messages)."""
    kinds = [np.dtype(t) for t in np.sctypeDict.values() if t is not np.object_]
    units = ("Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as")
    kinds += [np.dtype(f"{k}8[{u}]") for k in "Mm" for u in units]
    for d in kinds:
        for dt in {d, d.newbyteorder(">"), d.newbyteorder("<")}:
            try:
                dtype_code(from_numpy(dt))
            except TypeError:
                pass


def render(field: str, value: int) -> str:
    """One field's value as a message names it."""
    if field == "collective":
        return COLLECTIVES[value] if 0 <= value < len(COLLECTIVES) else str(value)
    if field == "op":
        return OPS[value] if 0 <= value < len(OPS) else "none"
    if field == "dtype":
        return "none" if value == 0 else dtype_name(value)
    if field == "structure":
        return "a single array" if value == 0 else f"layout {value:#x}"
    return str(value)

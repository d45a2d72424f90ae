"""The record of one call, as the flight recorder keeps it (a list: :func:`new`, :func:`finish`, read by
:func:`as_dict`), and its call site: the first frame outside the library (:func:`call_site`), found through
the paths remembered (:func:`_raw_site`) and turned into a line only when read (:func:`site_of`).
``_trace`` keeps the records in the dumps.

Example:
    >>> import numpy as np
    >>> from collectives import _records
    >>> x = np.zeros(4, dtype=np.float32)
    >>> r = _records.new(1, "allreduce", "sum", None, x.dtype, x.shape, "asynchronous")
    >>> r[_records.ON] = "mpi"
    >>> _records.finish(r)
    >>> _records.state(r), _records.path(r), _records.nbytes(r)
    ('completed', 'asynchronous, mpi', 16)
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from types import FrameType

# Frames of these modules are not "the user's call site": the library itself and the frameworks that
# call it on the user's behalf (torch.distributed, DDP's hooks, Lightning, accelerate).
_LIBRARY_PREFIXES = ("collectives.", "torch.", "lightning.", "pytorch_lightning.", "accelerate.")


_clock = time.time  # (one global look-up each: a record is made on every general-path call)
_get_ident = threading.get_ident
_getframe = sys._getframe


# A record is a plain list, the cheapest object Python makes with its fields in it (a list of 15 items is
# made in about a quarter of the time of an object that sets 15 slots, and an asynchronous call's record is
# all that the flight recorder costs it): :func:`new` keeps only the facts that the call gives and that
# are gone once it returns (the array's dtype and shape objects, the call site as its code and instruction
# offset, the thread's ident, one clock reading); everything a reader sees is made when read
# (:func:`as_dict`, :func:`path`, :func:`state`, :func:`site`): the op's repr aside (an object op's repr
# is taken at the call), text, the byte count (shape times item size), the line of the site and the state.
SEQ, COLLECTIVE, OP, ROOT, DTYPE, SHAPE, NBYTES, PATH, VIA, CODE, LASTI, THREAD, START, END, ERROR, ON = range(16)
# NBYTES: None where the byte count is the shape's (made when read), else the count; CODE, LASTI: the call
# site's code object and instruction offset, or a ``[file, line, function]`` list (or None) and None;
# ON: the transport (and ", reproducible"), once validation has chosen it; END, ERROR: set by finish.

FIELDS = ("seq", "collective", "op", "root", "dtype", "shape", "nbytes", "path", "site", "thread", "start", "end",
          "state", "error")  # in the dumps' order


def new(seq: int, collective: str, op, root, dtype, shape, path: str) -> list:
    """The record of a call made now, from here (its call site: the first frame outside the library above
    the caller of ``new``), in the state "started". (``_comm.record.begin`` writes this out inline.)"""
    code, lasti, via = site_here(1)
    if _hinting[0]:
        code, lasti, via = hinted(code, lasti, via)
    return [seq, collective, op, root, dtype, shape, None, path, via, code, lasti, _get_ident(), _clock(), None, None,
            None]


def site_here(skip: int) -> tuple:
    """``(code, instruction offset, front end)`` of the call site, as a record keeps it: :func:`_raw_site`
    with depth 0 at ``skip`` frames above the caller (0: the caller itself)."""
    raw, via = _raw_site(skip + 1)
    return (None, None, via) if raw is None else (*raw, via)


def hinted(code, lasti, via) -> tuple:
    """The call site as a record keeps it, or the thread's hint (:func:`site_hint`) where one is set: a call
    made for a compiled program, placed where its source put it (collectives.jax)."""
    hint = _site_hint.value
    return (code, lasti, via) if hint is None else (hint[0], None, hint[1])


def finish(rec: list, error: BaseException | None = None) -> None:
    """Mark the call completed, or failed with ``error``."""
    rec[END] = _clock()
    if error is not None:
        rec[ERROR] = f"{type(error).__name__}: {error}"


def is_record(entry) -> bool:
    """Whether a ring entry is a record (a hot-path entry is its cached call or a tuple)."""
    return entry.__class__ is list


def path(rec: list) -> str:
    """How the call was made: ``blocking`` or ``asynchronous`` (or another path's name), the front end it
    came through, the transport it took."""
    text = rec[PATH] if rec[VIA] is None else f"{rec[PATH]}, {rec[VIA]}"
    return text if rec[ON] is None else f"{text}, {rec[ON]}"


def set_path(rec: list, value: str) -> None:
    """Replace the record's path, front end and transport with ``value``."""
    rec[PATH], rec[VIA], rec[ON] = value, None, None


def state(rec: list) -> str:
    """``started``, ``completed`` or ``failed``."""
    return "started" if rec[END] is None else "completed" if rec[ERROR] is None else "failed"


def site(rec: list) -> list | None:
    """``[file, line, function]`` of the user's call, or None."""
    code = rec[CODE]
    return site_of(code if rec[LASTI] is None else (code, rec[LASTI]))


def nbytes(rec: list) -> int | None:
    """The bytes of the call's array: its shape times its dtype's item size (or as kept), or None."""
    if rec[NBYTES] is not None:
        return int(rec[NBYTES])
    shape, itemsize = rec[SHAPE], getattr(rec[DTYPE], "itemsize", None)
    if shape is None or itemsize is None:
        return None
    count = 1
    for n in shape:
        count *= int(n)
    return count * int(itemsize)


def dtype_name(dtype) -> str | None:
    """A record's dtype as the dumps name it (``float32``, torch's without ``torch.``), remembered per dtype:
    NumPy's ``str(dtype)`` is some microseconds of Python, and the timeline names every call's."""
    if dtype is None:
        return None
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):  # (TypeError: an unhashable stand-in for a dtype)
        name = str(dtype).replace("torch.", "")
        if len(_DTYPE_NAMES) < 1024:
            with contextlib.suppress(TypeError):
                _DTYPE_NAMES[dtype] = name
        return name


_DTYPE_NAMES: dict = {}  # dtype -> its name in the dumps (dtype_name)


def fields(rec: list) -> tuple:
    """The record as the dumps show it, in :data:`FIELDS`' order, its thread as its ident."""
    shape, op = rec[SHAPE], rec[OP]
    return (rec[SEQ], rec[COLLECTIVE], op if op is None or op.__class__ is str else repr(op), rec[ROOT], dtype_name(rec[DTYPE]),
            None if shape is None else [int(n) for n in shape], nbytes(rec), path(rec), site(rec), rec[THREAD],
            rec[START], rec[END], state(rec), rec[ERROR])


def as_dict(rec: list) -> dict:
    """The record as the dumps show it (:data:`FIELDS`), its thread by name."""
    out = dict(zip(FIELDS, fields(rec)))
    out["thread"] = _thread_name(out["thread"])
    return out


def _thread_name(ident) -> str:
    for t in threading.enumerate():
        if t.ident == ident:
            return t.name
    return f"thread {ident} (ended)"


def is_library(module: str) -> bool:
    """Whether frames of ``module`` belong to the library or a framework calling it (not a call site)."""
    return module == "collectives" or module == "torch" or module.startswith(_LIBRARY_PREFIXES)


# The front ends a call can come through, named in its record's path (the innermost one found): a module
# or a package (every module of the package ``collectives.torch_backend`` is the torch backend's).
_FRONT_ENDS = {"collectives._overlap": "DistributedOptimizer gradient bucket", "collectives._optim":
               "DistributedOptimizer", "collectives.torch_backend": "torch.distributed backend",
               "collectives._tree": "tree", "collectives._shard": "shard"}


def _front_end(module: str) -> str | None:
    """The front end of ``module`` (``_FRONT_ENDS``: the module's own entry, else its package's), or None."""
    while module:
        via = _FRONT_ENDS.get(module)
        if via is not None:
            return via
        module = module.rpartition(".")[0]
    return None


# site_hint(): the (site, front end) the records made on this thread stand for while it is set: a
# collective inside a jitted JAX function runs in a callback of XLA, far from the line that wrote it
# (collectives.jax sets it, around each callback, to the site found when jit traced the call).
class _SiteHint(threading.local):
    value: tuple | None = None  # (a class default: reading it never raises, where getattr(local, name, None) would, at a cost)


_site_hint = _SiteHint()


@contextlib.contextmanager
def site_hint(site: list | None, via: str):
    """Records made inside this block on this thread get ``site`` and the front end ``via``."""
    saved = _site_hint.value
    _site_hint.value = (site, via)
    _hinting[0] += 1
    try:
        yield
    finally:
        _hinting[0] -= 1
        _site_hint.value = saved


_hinting = [0]  # site_hint blocks under way, on any thread (a record reads the thread's hint only then)


def call_site() -> tuple[list | None, str | None]:
    """``([file, line, function], front end)``: the first frame outside the library (see
    :func:`is_library`), and the front end the call came through (``_FRONT_ENDS``), or None."""
    raw, via = _raw_site()
    return site_of(raw), via


def site_of(raw) -> list | None:
    """``[file, line, function]`` of a site as :func:`_raw_site` keeps it (or as given: a list, None)."""
    if raw is None or raw.__class__ is list:
        return raw
    code, lasti = raw
    known = _LINES.get((id(code), lasti))  # (keyed by the code's id: hashing a code object hashes its
    if known is not None and known[0] is code:  # constants and names, some us for a large one; the entry
        line = known[1]  # holds the object, so its id is not reused while the entry exists)
    else:
        line = next((n for start, end, n in code.co_lines() if start <= lasti < end), None) or code.co_firstlineno
        if len(_LINES) < 65536:
            _LINES[(id(code), lasti)] = (code, line)
    return [code.co_filename, line, code.co_name]


_LINES: dict = {}  # (id of a code object, instruction offset) -> (the code object, its line): site_of's memo


def _raw_site(skip: int = 1) -> tuple[tuple | None, str | None]:
    """``((code, instruction offset), front end)`` of the first frame outside the library, from ``skip``
    frames above the caller on (1: from the caller's caller): what a record keeps of its call site. Its line is looked up
    only when the record is read (:func:`site_of`): a frame's ``f_lineno`` decodes the line table up to
    the instruction, some hundreds of ns in a large function or a script's top level.

    A walk along ``f_back`` makes a frame object of every frame it passes (some 100 ns each, in Python
    3.11+, where frames are objects only once asked for), and a record is made some six frames below the
    user's call: so the last few paths found are remembered (:data:`_PATHS`: the user frame's depth, its
    code and the instruction it was at), and a call that comes the same way is found with one
    ``sys._getframe(depth)`` (which makes only the frame asked for, and the user's frame of a loop is made
    once): the frame at that depth runs the same code at the same instruction, so it is making the same
    call into the library (a recursive user function at another level is at another instruction)."""
    paths = _PATHS
    for path in paths:
        depth, outer, lasti, via = path
        try:
            user = sys._getframe(depth + skip + 1)
        except ValueError:  # a shallower stack
            continue
        if user.f_code is outer and user.f_lasti == lasti:
            if path is not paths[0]:
                with contextlib.suppress(ValueError):  # (another thread may have moved it meanwhile)
                    paths.remove(path)
                    paths.insert(0, path)
            return (outer, lasti), via
    return _walk(skip + 1)


_PATHS: list = []  # (depth of the user frame above the recorder's caller, its code, its instruction offset,
# the front end): the last paths _walk found, the latest first (at most _KEPT_PATHS)
_KEPT_PATHS = 4


def _walk(skip: int) -> tuple[tuple | None, str | None]:
    """:func:`_raw_site` the long way: along ``f_back`` (and the path remembered)."""
    frame: FrameType | None = sys._getframe(skip + 1)
    depth = 0
    via = None
    kinds = _CODE_KINDS
    while frame is not None:
        code = frame.f_code
        # keyed by the code object's id, not the object: hashing a code object hashes its constants and
        # names each time (up to a microsecond for a large function); the entry holds the object itself,
        # so its id cannot be reused while the entry exists
        kind = kinds.get(id(code))
        if kind is None or kind[2] is not code:  # once per function: is it the library's, which front end
            module = frame.f_globals.get("__name__", "")
            kind = (is_library(module), _front_end(module), code)
            if len(kinds) < 65536:  # bounded: code objects of functions that come and go (exec, lambdas)
                kinds[id(code)] = kind
        if not kind[0]:
            lasti = frame.f_lasti
            _PATHS.insert(0, (depth, code, lasti, via))
            del _PATHS[_KEPT_PATHS:]
            return (code, lasti), via
        if via is None:
            via = kind[1]
        frame = frame.f_back
        depth += 1
    return None, via


_CODE_KINDS: dict = {}  # id(code object) -> (is the library's, front end or None, the code object): call_site's memo

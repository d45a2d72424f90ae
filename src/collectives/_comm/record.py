"""The flight recorder's side of the engine (``_trace`` keeps the records, the dumps and the watcher).

A communicator's record is a ring of its last calls, indexed by the sequence number (``comm._ring``,
``_seq``, ``_mask``: set up in ``Communicator.__init__``, read by the hot path itself). Here: starting a
record (:func:`begin`, :func:`begin_p2p`, :func:`traced`), a hot-path call's failure (:func:`note_failure`),
and the ring read back as the dumps and the timeline see it (:func:`entries`, :func:`snapshot`,
:func:`last`), through the communicator's ``Engine``.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np

from .. import _records
from .._backends.closed import CLOSED
from .._records import _PATHS, START, _clock, _get_ident, _getframe, _hinting, is_record

# the methods whose hot path is written in the method itself and keeps no shape in the record (see
# shape_in_progress)
HOT = ("allreduce", "broadcast", "reduce_scatter", "alltoall")


def traced(collective: str, path: str = "blocking", root_at: int | None = None):
    """A Communicator method whose calls the flight recorder keeps (``_trace``): its record is started
    before the call and finished with it (``root_at``: the position of its ``root`` argument)."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            root = kwargs.get("root", args[root_at] if root_at is not None and len(args) > root_at else None)
            rec = begin(self, collective, None, None, root if root_at is not None else None, path)
            try:
                result = fn(self, *args, **kwargs)
            except BaseException as exc:
                if rec is not None:
                    _records.finish(rec, exc)
                raise
            if rec is not None:
                _records.finish(rec)
            return result
        return call
    return wrap


def begin(comm, collective: str, x=None, op=None, root=None, path: str = "blocking"):
    """Start the flight recorder's record of a call (``_records.new``'s list) at the next sequence number,
    or None when the record is off (``COLLECTIVES_TRACE_BUFFER=0``).

    This is the whole cost of the record of an asynchronous call, so :func:`_records.new` is written out
    here (a call less): the array's dtype and shape objects, the call site (the first path remembered,
    checked inline, else ``_raw_site``), the thread's ident, one clock reading; the rest is made when read.
    Where the package was built with ``_recorder.c``, ``begin`` is its compiled copy (the same record; see
    :func:`_found`), and this function is ``record.python_begin``. Either is called directly by the
    function that starts the record (``validate.prepare``, the tree's driver, a traced method): the depth of
    a path remembered counts from this call."""
    ring = comm._ring
    if ring is None:
        return None
    n = comm._seq = comm._seq + 1
    try:  # (an array's attributes: cheaper read than getattr with a default)
        dtype, shape = x.dtype, x.shape
    except AttributeError:
        dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
    # the call site: each path remembered is checked here, in place (depth 0: this frame, as for
    # _raw_site(0)), so a program whose calls come from two or three lines in turn finds each without the
    # walk's reordering (0.9 against 2.2 us a record, two lines alternating, 1 process)
    try:
        for depth, code, lasti, via in _PATHS:  # noqa: B007 - via is the path found, read after the loop
            user = _getframe(depth)
            if user.f_code is code and user.f_lasti == lasti:
                break
        else:  # nothing remembered comes this way: the walk (which remembers it)
            code, lasti, via = _records.site_here(0)
    except ValueError:  # a shallower stack than a path remembered
        code, lasti, via = _records.site_here(0)
    if _hinting[0]:
        code, lasti, via = _records.hinted(code, lasti, via)
    rec = ring[n & comm._mask] = [n, collective, op, root, dtype, shape, None, path, via, code, lasti, _get_ident(),
                                  _clock(), None, None, None]  # (_records: SEQ ... ON)
    comm._last_activity = rec[START]
    return rec


python_begin = begin


def _found() -> tuple:
    """The call site as :func:`begin` finds it when no path remembered matches, or while a site hint is
    set: the compiled ``begin`` calls this from the frame that called it, so this frame stands where
    :func:`python_begin`'s would (depth 0 of a path)."""
    code, lasti, via = _records.site_here(0)
    return _records.hinted(code, lasti, via) if _hinting[0] else (code, lasti, via)


def _compiled():
    """``_recorder.begin`` set up to read ``_records``' paths, hint count and clock, or None where the
    package was built without it (or for a Python older than 3.11, or a build without the GIL)."""
    try:
        from .. import _recorder  # type: ignore[attr-defined]
    except ImportError:
        return None
    if not hasattr(_recorder, "begin"):
        return None
    _recorder.setup(_PATHS, _hinting, _found, _clock, _getframe)
    return _recorder.begin


begin = _compiled() or python_begin  # the compiled copy of the function above, where built


def begin_p2p(comm, what: str, x, asynchronous: bool):
    """The flight recorder's record of a point-to-point call, in the communicator's p2p ring (numbered
    apart from the collectives), or None when the record is off."""
    ring = comm._p2p_ring
    if ring is None:
        return None
    n = comm._p2p_seq = comm._p2p_seq + 1
    comm._p2p_at = comm._seq
    rec = _records.new(n, what, None, None, getattr(x, "dtype", None), getattr(x, "shape", None),
                       "point-to-point, " + ("asynchronous" if asynchronous else "blocking"))
    comm._last_activity = rec[START]
    ring.append(rec)
    return rec


def note_failure(comm, exc: BaseException, x) -> None:
    """A hot-path call raised (an MPI error, a timeout, a mismatch found beside it): its entry in the
    record gets the error and ``x``'s shape (which the hot path does not keep); a general-path call's
    record is finished by its driver."""
    ring = comm._ring
    if ring is not None:
        i = comm._seq & comm._mask
        entry = ring[i]
        if entry is not None and not is_record(entry):  # a hot-path entry (trace_entries)
            run, shape = entry[:2] if entry.__class__ is tuple else (entry, getattr(x, "shape", None))
            ring[i] = run, shape, f"{type(exc).__name__}: {exc}"


def name(c) -> str | None:
    """The communicator's name in dumps (``world``, ``world.0``, ...), or None when not recorded."""
    return c._name if c._ring is not None else None


def entries(c, inside: bool = False) -> list[dict]:
    """The record's entries, oldest first, as dicts (the last ``COLLECTIVES_TRACE_BUFFER``). A hot-path
    entry has no site or times; the last one is "started" when ``inside`` (a thread of the process is
    inside a collective), else "completed"."""
    ring, seq = c._ring, c._seq
    if ring is None:
        return []
    out = []
    for n in range(max(1, seq - min(c._kept, len(ring)) + 1), seq + 1):
        entry = ring[n & c._mask]
        if entry is None:
            continue
        if is_record(entry):
            out.append(_records.as_dict(entry))
            continue
        # a hot-path entry: its cached call, or (cached call, shape[, error]); a broadcast's or a reduce's
        # root is in _roots at the same index (written with the entry)
        run, shape, error = (*entry, None)[:3] if entry.__class__ is tuple else (entry, None, None)
        collective, op, dtype = c._hot_names.get(run, ("unknown", None, None))
        root = c._roots[n & c._mask] if collective in ("broadcast", "reduce") else None
        nbytes = None
        state = "failed" if error is not None else "started" if inside and n == seq else "completed"
        if shape is None and state == "started":
            shape = shape_in_progress(c)
        if shape is not None:
            shape = [int(n) for n in shape]  # as a general-path record's (_records.fields)
            try:
                nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            except TypeError:  # a dtype NumPy does not name (bfloat16 of torch)
                pass
        out.append({"seq": n, "collective": collective, "op": op, "root": root, "dtype": dtype, "shape": shape,
                    "nbytes": nbytes, "path": "hot path", "site": None, "thread": None, "start": None,
                    "end": None, "state": state, "error": error})
    return out


def snapshot(c, inside: bool = False) -> dict:
    """The communicator's part of a dump: its name, ranks, sequence number and record."""
    if c._ring is None or c._host is CLOSED:
        return {"name": c._name, "seq": None}
    return {"name": c._name, "rank": c.rank, "size": c.size, "seq": c._seq,
            "world_ranks": getattr(c._host, "world_ranks", None),
            "records": entries(c, inside),
            "p2p": [_records.as_dict(r) for r in (c._p2p_ring or ())]}


def last(c) -> tuple:
    """``(name, last entry as a dict, when the sequence number last moved on the general path)``: the
    last collective, or the last point-to-point call where it is still in progress and no collective
    was made since it began (then with ``"p2p": True``)."""
    p2p = c._p2p_ring[-1] if c._p2p_ring else None
    if p2p is not None and _records.state(p2p) == "started" and c._p2p_at == c._seq:
        return name(c), dict(_records.as_dict(p2p), p2p=True), c._last_activity
    made = entries(c, True)
    return name(c), (made[-1] if made else None), c._last_activity


def shape_in_progress(comm):
    """The shape of the array of the call a thread is inside on ``comm``, read from that thread's frame of
    the method (the hot path's record keeps no shape: what a dump or the stall warning of a call in
    progress shows); None when no thread is in one of them."""
    codes = {getattr(type(comm), name).__code__ for name in HOT}  # (the frames of those methods)
    for top in sys._current_frames().values():
        frame: Any = top
        while frame is not None:
            if frame.f_code in codes and frame.f_locals.get("self") is comm:
                return getattr(frame.f_locals.get("x"), "shape", None)
            frame = frame.f_back
    return None

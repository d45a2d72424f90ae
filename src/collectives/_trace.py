"""The flight recorder: every communicator's last calls, dumped per rank when a job hangs or fails.

Each :class:`~collectives.Communicator` keeps a ring of its last ``COLLECTIVES_TRACE_BUFFER`` calls
(default 2000; ``0``: none). A call that takes the general path (validation, the engine's steps: every
asynchronous call, every call of the torch backend and of the gradient buckets, every first call of a
kind) is a record (``_records``: a list of the raw facts, its text made when read): its sequence number on
the communicator, the collective, op, root, dtype, shape and bytes, the path taken, the user's call site (the first frame outside ``collectives`` and
torch), the thread, start and end times and its state. A call on the hot path (the cached call of a
NumPy or CPU torch array's second and later calls of the same kind) is recorded as the cached call only
(and a broadcast's root): one store into a preallocated list, so that the record costs the 8-byte
allreduce at most 5% (docs/performance.md); its kind, op and dtype are those of the cached call, its
shape, site and times are not kept (the dump's stacks show where a rank is stuck).

:func:`dump` writes one JSON file per rank into ``COLLECTIVES_TRACE_DIR`` (default ``./collectives-trace``,
made when needed): the rings of every live communicator of the process, its identity (host, pid, rank,
size, the job) and the Python stacks of all its threads. Dumps are written on a
:class:`~collectives.CollectiveTimeoutError`, a :class:`~collectives.MismatchError`, the failure path (an
uncaught exception that ends the job), ``SIGUSR1`` and :func:`collectives.dump_trace`. ``SIGUSR1`` is
dumped by the watcher thread (below), woken at once through Python's signal wakeup pipe: the handler only
notes the signal, so a signal that arrives during a dump never re-enters it, and a rank stuck inside a
blocking MPI call (where no Python handler runs) dumps too. Every file is written whole (a file of its
own, renamed over the dump). A dump for a
failure also writes a request file beside the dumps; every rank's watcher thread (a daemon thread that
wakes twice a second and never calls MPI) sees it and dumps too, whatever its main thread is doing (in
its own code, or stuck inside MPI). The same thread is the stall inspector: when a thread of the process
has been inside one collective for ``COLLECTIVES_STALL_WARN_S`` seconds (default 60; ``0``: off) without
the sequence numbers moving, it asks the other ranks, through files in the same directory, how far each
has come, and logs once which ranks have not entered the call yet.

``python -m collectives trace DIR`` (``collectives._tracetool``) reads the dumps and says where the ranks
diverged. With ``COLLECTIVES_TRACE_FORMAT=torch`` or ``both`` the dumps are (also) written in torch's
flight-recorder format (``_trace_torch``), for ``python -m torch.distributed.flight_recorder.fr_trace``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import platform
import re
import select
import signal
import sys
import threading
import time
import traceback
import weakref

from . import _config, _trace_torch
from ._records import call_site, site_hint  # noqa: F401 - re-exported: the engine's and front ends' names
from ._threads import GUARD as _GUARD

FORMAT = "collectives-trace/1"
POLL_S = 0.5  # how often the watcher thread looks for requests, queries and stalls
ANSWER_WAIT_S = 2.5 * POLL_S  # how long a stalled rank waits for the others' answers

_LIVE: weakref.WeakSet = weakref.WeakSet()  # the engines of live communicators (their trace_snapshot)
_job: dict = {"id": None, "rank": 0, "size": 1, "dir": None}
_reasons: list = []  # why this process dumped, in order
_ending: list = []  # the exception that is ending the job (every later dump shows it too)
_watcher: list = []  # the watcher thread, once started
_lock = threading.RLock()  # one dump at a time per thread; re-entrant: a dump may be re-entered on its thread
# (a user's signal handler calling dump_trace() during one); each write goes to a file of its own first
_signalled: list = []  # SIGUSR1s noted, not yet dumped: the handler only appends here (no lock, no I/O)
_serving = threading.Lock()  # held while signals are dumped (the watcher's, or at exit; never the handler's)
_dumping = [0]  # dumps under way (any thread)
_served_at = [0.0]  # when the handler last dumped for a signal (the watcher then leaves it be)
_wakeup: list = []  # [read end] of the signal wakeup pipe, where this module owns it (see start)
_tmp = itertools.count()  # numbers the temporary files of writes

def register(engine) -> None:
    """Keep ``engine`` (its ``trace_snapshot()``, ``trace_seq()``) among what dumps contain."""
    _LIVE.add(engine)


def enabled() -> bool:
    return _job["dir"] is not None


def start(job: str, rank: int, size: int) -> None:
    """Begin recording for this process (at the world communicator's ``init``): the job's id (the same on
    every rank), this rank; install ``SIGUSR1`` and start the watcher thread. Does nothing with
    ``COLLECTIVES_TRACE_BUFFER=0``."""
    if _config.trace_buffer() == 0:
        return
    _job.update(id=job, rank=rank, size=size, dir=_config.trace_dir(), format=_config.trace_format())
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
        try:
            if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
                signal.signal(signal.SIGUSR1, _on_signal)
                _own_wakeup()
        except (ValueError, OSError):  # not the main interpreter, or no signals here
            pass
    if not _watcher:
        atexit.register(_serve_signals)  # a signal noted just before the end is dumped before it
        thread = threading.Thread(target=_watch, name="collectives-trace-watcher", daemon=True)
        _watcher.append(thread)
        thread.start()


def _on_signal(signum, frame) -> None:
    """SIGUSR1's Python handler (on the main thread, between two bytecodes): dump here, at this point of
    the main thread, unless a dump is under way (maybe the very one this handler interrupted): then only
    note it, and the watcher thread dumps once that one is done (:func:`_serve_signals`)."""
    _signalled.append(signum)
    if _dumping[0] == 0 and _serving.acquire(blocking=False):
        try:
            if _signalled:
                del _signalled[:]
                dump("SIGUSR1")
                _served_at[0] = time.monotonic()
        finally:
            _serving.release()


def _own_wakeup() -> None:
    """Take Python's signal wakeup fd, unless something else (asyncio's loop) has it: CPython's C-level
    handler then writes each signal's number into it at once, so the watcher thread wakes and dumps even
    while the main thread is stuck inside a blocking MPI call, where no Python handler can run."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    if old != -1:  # someone else's: give it back, and rely on the handler's note (polled by the watcher)
        signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return
    _wakeup.append(r)


def _await_signal(seconds: float) -> None:
    """Sleep ``seconds``, or less: until a SIGUSR1 reaches the wakeup pipe (then noted) or the handler."""
    if _wakeup:
        try:
            ready, _, _ = select.select(_wakeup, [], [], seconds)
            if ready:
                data = os.read(_wakeup[0], 4096)
                if signal.SIGUSR1 in data:  # the handler dumps at once where the main thread runs Python;
                    t = time.monotonic()    # stuck inside MPI it never runs: then this thread dumps
                    while time.monotonic() < t + 0.3 and _served_at[0] < t - 0.25 and not _signalled:
                        time.sleep(0.01)
                    if _served_at[0] < t - 0.25:
                        _signalled.append(signal.SIGUSR1)
            return
        except (OSError, ValueError):  # (a closed pipe at the end of the process)
            pass
    end = time.monotonic() + seconds
    while not _signalled and time.monotonic() < end:
        time.sleep(0.02)


def _serve_signals() -> None:
    """Dump once for the signals noted so far (the watcher thread's loop; at exit)."""
    with _serving:
        if _signalled:
            del _signalled[:]
            dump("SIGUSR1")


def _path(kind: str, rank: int | None = None) -> str:
    name = f"{_job['id']}.{kind}" + (f"-rank{rank}" if rank is not None else "")
    return os.path.join(_job["dir"], name)


def dump_path(rank: int | None = None) -> str:
    """The file this rank's dump goes to (``<dir>/<job>.trace-rank<R>.json``; with
    ``COLLECTIVES_TRACE_FORMAT=torch``, torch's: ``<dir>/<job>.torch/collectives_trace_rank_<R>``)."""
    rank = _job["rank"] if rank is None else rank
    if _job.get("format") == "torch":
        return _trace_torch.path(_job["dir"], _job["id"], rank)
    return _path("trace", rank) + ".json"


def _write(path: str, data) -> None:
    """Write ``data`` as JSON to ``path`` whole: into a file of this write's own, renamed over ``path``
    (a reader, or a write interrupted and re-entered, never sees a torn file)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.{next(_tmp)}.tmp"
    try:
        # one string by the C encoder, then one write: json.dump (and any indent) takes the pure-Python
        # encoder, 4x slower on a full recorder (2 MiB per rank; every refusal dumps)
        text = json.dumps(data, default=repr, separators=(",", ":"))
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _threads() -> list[dict]:
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        stack = [[f.filename, f.lineno, f.name, f.line] for f in traceback.extract_stack(frame)]
        inside = any(_in_library(str(f[0])) for f in stack)
        out.append({"name": names.get(ident, f"thread {ident}"), "ident": ident, "stack": stack,
                    "inside_collective": inside and names.get(ident) != "collectives-trace-watcher"})
    return out


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _in_library(path: str) -> bool:
    """Whether a frame's file is one of the library's, other than this module (the recorder itself), the
    failure path and the timeline (which writes its file at exit)."""
    return path.startswith(_PACKAGE) and not path.endswith(("_trace.py", "_failure.py", "_timeline.py"))


def in_package(path: str) -> bool:
    """Whether a frame's file is one of the library's (this module included)."""
    return path.startswith(_PACKAGE)


def user_frame(dump: dict) -> tuple[list | None, str]:
    """The innermost frame outside the library of a rank's main thread in ``dump`` (a snapshot) or, where
    the main thread is in the failure path, of the exception that ended the job; and what it is."""
    threads = dump.get("threads", [])
    main = next((t for t in threads if t.get("name") == "MainThread"), threads[0] if threads else None)
    stack = [f for f in (main or {}).get("stack", []) if not in_package(f[0])]
    if stack and main is not None:
        return stack[-1], " (inside a collective)" if main.get("inside_collective") else ""
    exc = dump.get("exception")
    if exc:
        raised = [f for f in exc["stack"] if not in_package(f[0])]
        if raised:
            return raised[-1], f" (where it raised {exc['type']})"
    return None, ""


def snapshot(reason: str, exc: BaseException | None = None) -> dict:
    """Everything a dump holds, as a dict (``exc``: the exception that ends the job, with its traceback)."""
    threads = _threads()
    inside = any(t["inside_collective"] for t in threads)
    comms = []
    for engine in list(_LIVE):
        try:
            comms.append(engine.trace_snapshot(inside))
        except Exception as exc:  # noqa: BLE001 - a closed communicator must not stop the dump
            comms.append({"error": repr(exc)})
    return {"format": FORMAT, "job": _job["id"], "rank": _job["rank"], "size": _job["size"],
            "host": platform.node(), "pid": os.getpid(), "time": time.time(), "reason": reason,
            "reasons": list(_reasons), "inside_collective": inside,
            "communicators": [c for c in comms if c.get("seq") is not None or "error" in c],
            "threads": threads, "exception": None if exc is None else {
                "type": type(exc).__name__, "message": str(exc),
                "stack": [[f.filename, f.lineno, f.name, f.line] for f in traceback.extract_tb(exc.__traceback__)]}}


def dump(reason: str, *, tell_others: bool = False, exc: BaseException | None = None) -> str | None:
    """Write this rank's dump (``reason``: why); with ``tell_others`` also ask every other rank to dump
    (a request file their watcher threads see). Returns the file's path, or None when recording is off.
    Never raises: a dump must not hide the error it documents."""
    if not enabled():
        return None
    timeline = sys.modules.get("collectives._timeline")
    if timeline is not None:  # COLLECTIVES_TIMELINE: its calls so far on disk too (the job may be ending)
        timeline.flush_all()
    try:
        with _lock:
            _dumping[0] += 1
            try:
                _reasons.append(reason)
                if exc is not None and not _ending:
                    _ending.append(exc)
                path = dump_path()
                data = snapshot(reason, exc if exc is not None else (_ending[0] if _ending else None))
                form = _job.get("format")
                if form != "torch":
                    _write(_path("trace", _job["rank"]) + ".json", data)
                if form in ("torch", "both"):  # torch's format too (for its fr_trace): _trace_torch
                    frame, _ = user_frame(data)
                    _trace_torch.write(_trace_torch.path(_job["dir"], _job["id"], _job["rank"]),
                                       _trace_torch.convert(data, frame[:3] if frame else None))
                if tell_others and _job["size"] > 1:
                    _write(_path("request") + ".json", {"rank": _job["rank"], "reason": reason,
                                                        "time": time.time()})
            finally:
                _dumping[0] -= 1
        return path
    except Exception as exc:  # noqa: BLE001 - see above
        try:
            sys.stderr.write(f"collectives: could not write the trace dump ({exc})\n")
        except Exception:  # noqa: BLE001
            pass
        return None


def dump_trace(*, all_ranks: bool = False) -> str | None:
    """Write this rank's flight-recorder dump now: the last calls of every communicator of the process,
    its identity and the Python stacks of all its threads, as JSON in ``COLLECTIVES_TRACE_DIR`` (default
    ``./collectives-trace``). Returns the file's path (None with ``COLLECTIVES_TRACE_BUFFER=0``). Not
    collective, and it never calls MPI: any thread may call it, on any rank (``SIGUSR1`` does the same
    from outside). ``all_ranks=True`` also asks every other rank to dump (through a file in the trace
    directory that each rank's watcher thread looks for twice a second), whatever they are doing. Read
    the dumps with ``python -m collectives trace DIR``.

    Example:
        >>> import collectives as coll, json, numpy as np
        >>> comm = coll.world()
        >>> _ = coll.allreduce(np.ones(4), comm=comm)
        >>> path = coll.dump_trace()
        >>> dump = json.load(open(path))
        >>> (dump["rank"], dump["size"]) == (comm.rank, comm.size)
        True
        >>> world = next(c for c in dump["communicators"] if c["name"] == "world")
        >>> last = world["records"].pop()
        >>> last["collective"], last["state"]
        ('allreduce', 'completed')
    """
    return dump("collectives.dump_trace()", tell_others=all_ranks)


def failure(reason: str, exc: BaseException | None = None) -> str | None:
    """A failure (a timeout, the job ending with ``exc``): dump here and ask every other rank to dump."""
    path = dump(reason, tell_others=True, exc=exc)
    if path is not None and len(_reasons) == 1 + sum(r.startswith("asked by") for r in _reasons[:-1]):
        try:
            tool = f"`python -m collectives trace {_job['dir']}`"
            if _job.get("format") in ("torch", "both"):
                torch_dir = _trace_torch.directory(_job["dir"], _job["id"])
                tool = ("" if _job.get("format") == "torch" else tool + "; ") + \
                    f"torch's format: `python -m torch.distributed.flight_recorder.fr_trace {torch_dir}`"
            sys.stderr.write(f"collectives: trace written to {path} (every rank writes one; read them with "
                             f"{tool})\n")
        except Exception:  # noqa: BLE001
            pass
    return path


def await_others(seconds: float = 4 * POLL_S) -> None:
    """Wait (at most ``seconds``) until every other rank's dump is newer than this rank's request: the
    failure path calls it before the job is aborted, so that the other ranks' watchers have written."""
    if not enabled() or _job["size"] < 2:
        return
    asked = _mtime(_path("request") + ".json")
    deadline = time.monotonic() + seconds
    others = [r for r in range(_job["size"]) if r != _job["rank"]]
    while time.monotonic() < deadline:
        if all(_mtime(dump_path(r)) >= asked for r in others):
            return
        time.sleep(0.05)


# ---- the watcher thread: requests from other ranks, the stall inspector ----

def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _read(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _progress() -> dict:
    """What this rank answers a stall query with: how far each communicator has come, where it is."""
    threads = _threads()
    inside = [t for t in threads if t["inside_collective"]]
    main = next((t for t in threads if t["name"] == "MainThread"), threads[0] if threads else None)
    where = None
    for t in (inside[0] if inside else main,):
        if t is not None:
            user = [f for f in t["stack"] if not in_package(f[0])]
            where = user[-1] if user else t["stack"][-1]
    seqs, calls = {}, {}
    for engine in list(_LIVE):
        try:
            name, last, _ = engine.trace_last()
            seq = engine.trace_seq()
        except Exception:  # noqa: BLE001 - a closed communicator
            continue
        if name is not None:
            seqs[name] = seq
            if last is not None:  # which collective that number is: ranks at one number may be in two
                calls[name] = {k: last.get(k) for k in ("seq", "collective", "op", "root", "dtype", "shape", "site")}
    return {"rank": _job["rank"], "time": time.time(), "seqs": seqs, "calls": calls,
            "inside_collective": bool(inside), "where": where}


def _watch() -> None:
    seen_request = _mtime(_path("request") + ".json")
    seen_query = _mtime(_path("query") + ".json")
    since, last_total, warned = time.monotonic(), None, False
    while True:
        _await_signal(POLL_S)
        try:
            if _signalled:
                _serve_signals()
            request = _path("request") + ".json"
            t = _mtime(request)
            if t > seen_request:
                seen_request = t
                asked = _read(request) or {}
                if asked.get("rank") != _job["rank"]:
                    dump(f"asked by rank {asked.get('rank')}: {asked.get('reason')}")
            query = _path("query") + ".json"
            t = _mtime(query)
            if t > seen_query:
                seen_query = t
                _write(_path("progress", _job["rank"]) + ".json", _progress())
            stall = _config.stall_warn_s()
            if stall is None:
                continue
            inside = _inside_collective()
            total = sum(e.trace_seq() + e.trace_p2p_seq() for e in list(_LIVE))  # (a call made: not stalled)
            now = time.monotonic()
            if not inside or total != last_total:
                since, last_total, warned = now, total, False
            elif not warned and now - since >= stall:
                warned = True
                _stall(now - since)
                seen_query = _mtime(query)
        except Exception:  # noqa: BLE001 - the watcher must never take the process down
            continue


def _inside_collective() -> bool:
    """Whether a thread of this process is inside a collective: the thread guard is held (``_threads``),
    read from the lock's repr (``<locked ...``; trying to take it could refuse the thread's own next call).

    Never by reading the threads' frames, as the watcher did twice a second: on Python 3.11, reading the
    frames of another thread that is running (``sys._current_frames()``, their ``f_back``) races with that
    thread making and clearing its frames, a known use-after-free of CPython (it crashes the sampling
    profilers that do it) that crashed ranks here at random inside torch, in a SIGSEGV or a SIGABRT of the
    allocator, about once in three runs of the 3-rank test suite. The frames are still read, once, where
    a stall is reported, a dump is written or another rank asks where this one is."""
    return repr(_GUARD).startswith("<locked")


def _current() -> tuple:
    """``(communicator name, its last record as a dict)`` of the communicator whose call is in progress:
    the one with the latest sequence activity (the engines say so)."""
    best = (None, None, -1.0)
    for engine in list(_LIVE):
        try:
            name, entry, when = engine.trace_last()
        except Exception:  # noqa: BLE001
            continue
        if entry is not None and when >= best[2]:
            best = (name, entry, when)
    return best[0], best[1]


def describe(entry: dict) -> str:
    """A call as the messages show it: ``allreduce #12 (op=sum, float32 (4,))``."""
    parts = [f"{k}={entry[k]}" for k in ("op", "root") if entry.get(k) is not None]
    if entry.get("dtype") is not None:
        shape = tuple(entry["shape"]) if entry.get("shape") is not None else ""
        parts.append(f"{entry['dtype']} {shape}".strip())
    return f"{entry['collective']} #{entry['seq']}" + (f" ({', '.join(parts)})" if parts else "")


def _differs(theirs: dict, mine: dict) -> bool:
    """Whether another rank's call at the same number is another collective (or the same one with another
    op or root): what the stall warning must name instead of saying that the rank entered this call."""
    return any(theirs.get(k) != mine.get(k) for k in ("collective", "op", "root"))


def site_text(site) -> str:
    return f"{site[0]}:{site[1]} in {site[2]}" if site else "an unrecorded call site (the hot path)"


def _stall(waited: float) -> None:
    """Ask every rank how far it has come (a query file; their watchers answer with progress files) and
    log once which ranks have not entered this rank's current call."""
    name, entry = _current()
    if entry is None:
        return
    asked = time.time()
    _write(_path("query") + ".json", {"rank": _job["rank"], "time": asked, "comm": name, "seq": entry["seq"]})
    mine = _progress()
    _write(_path("progress", _job["rank"]) + ".json", mine)
    if entry.get("site") is None and mine["where"]:  # a hot-path call keeps no site: the stack has it
        entry = dict(entry, site=mine["where"][:3])
    time.sleep(ANSWER_WAIT_S)
    if entry.get("p2p"):
        _stall_p2p(name, entry, waited, asked)
        return
    behind, inside, elsewhere, silent = [], [], [], []
    for r in range(_job["size"]):
        if r == _job["rank"]:
            continue
        answer = _read(_path("progress", r) + ".json")
        if answer is None or answer.get("time", 0) < asked - POLL_S:
            silent.append(r)
            continue
        seq = answer.get("seqs", {}).get(name, 0)
        where = answer.get("where")
        if seq < entry["seq"]:
            at = f" in {where[0]}:{where[1]} in {where[2]}" if where else ""
            behind.append(f"rank {r} (at #{seq}{at})")
            continue
        theirs = answer.get("calls", {}).get(name)
        if theirs is not None and seq == entry["seq"] and _differs(theirs, entry):
            site = theirs.get("site") or (where[:3] if where else None)
            elsewhere.append(f"rank {r} is in {describe(theirs)}, called at {site_text(site)}")
        elif seq > entry["seq"]:
            elsewhere.append(f"rank {r} is past it (at #{seq})")
        else:
            inside.append(str(r))
    text = (f"collectives: stall: {describe(entry)} on {name}, called at {site_text(entry.get('site'))}, has "
            f"waited {waited:.0f} s on rank {_job['rank']} of {_job['size']}")
    if behind:
        text += "; not entered by " + ", ".join(behind)
    if elsewhere:
        text += ("; " + ", ".join(elsewhere) + f" (call #{entry['seq']} is a different collective there: the ranks "
                 "have diverged and this call cannot complete)")
    if inside:
        text += f"; rank{'s' if len(inside) > 1 else ''} {','.join(inside)} entered it too"
    if silent:
        text += f"; no answer from rank{'s' if len(silent) > 1 else ''} {','.join(map(str, silent))}"
    _warn_stall(text)


_PEER = re.compile(r"\b(src|dst)=(any|\d+), tag=(\d+)")


def _stall_p2p(name: str, entry: dict, waited: float, asked: float) -> None:
    """The stall warning of a point-to-point call in progress (a send or recv whose peer has not made the
    matching call): where the peer is (every other rank for a receive from any rank), from its answer."""
    m = _PEER.search(entry.get("path") or "")
    side, peer, tag = (m[1], m[2], m[3]) if m else ("src", "any", "?")
    peers = [r for r in range(_job["size"]) if r != _job["rank"]] if peer == "any" else [int(peer)]
    what = "from" if side == "src" else "to"
    parts = []
    for r in peers:
        answer = _read(_path("progress", r) + ".json")
        if answer is None or answer.get("time", 0) < asked - POLL_S:
            parts.append(f"rank {r}: no answer")
            continue
        where = answer.get("where")
        at = f"{where[0]}:{where[1]} in {where[2]}" if where else "an unknown place"
        parts.append(f"rank {r} is at {at} (after collective #{answer.get('seqs', {}).get(name, 0)} on {name})")
    detail = "point-to-point"
    if entry.get("dtype") is not None and entry.get("shape") is not None:
        detail += f", {entry['dtype']} {tuple(entry['shape'])}"
    text = (f"collectives: stall: {entry['collective']} #{entry['seq']} ({detail}) {what} {'any rank' if peer == 'any' else f'rank {peer}'} with tag {tag} on {name}, called at "
            f"{site_text(entry.get('site'))}, has waited {waited:.0f} s on rank {_job['rank']} of {_job['size']}; "
            + "; ".join(parts))
    _warn_stall(text)


def _warn_stall(text: str) -> None:
    """Write a stall warning (``text``, then what it is and how to act) to stderr; never raises."""
    text += (" (a warning: the job goes on; COLLECTIVES_STALL_WARN_S sets when it is given, "
             "coll.dump_trace() or SIGUSR1 writes the record)\n")
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a warning must not raise in the watcher thread
        pass

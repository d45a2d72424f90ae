"""The timeline (``COLLECTIVES_TIMELINE=FILE``): every call of every communicator, with its phases, per rank.

Off (the default) nothing here runs: ``Communicator.__init__`` reads the variable and, only when it is set,
calls :func:`install`. On, each communicator made gets instruments in place of some of its parts (the
hot path's code itself is untouched), and every call, on every path (the hot path, the general path,
asynchronous calls, point-to-point, trees, and so every call of the torch backend and of the gradient
buckets, which are made through them), is timed as it happens:

- a hot-path call (the cached call of a NumPy or CPU torch array's repeated call): the cached call is
  replaced by a timed one (``Engine.instrument_hot``), which appends ``(kind, seq, bytes or root, start,
  end)`` to a list; its one phase is ``transfer``. Where the transport's cached call can time itself
  (the MPI transport's allreduce and broadcast closures, ``Operation.bind``'s ``timed``), it does, in
  its own frame: no frame around it;
- a blocking general-path call's event spans the call; its phases: ``validation`` (the checks, up to the
  first transfer; it holds checked mode's ``agreement`` and the NaN check's exchange), each ``transfer``
  (the host transport's own calls where they are made, else the step), ``host`` (the work between two
  transfers), ``write-back`` (after the last transfer: the result written into the caller's array or
  wrapped), and ``host reduction`` (the widening, ordering or division of values the transport cannot
  reduce as they are, around and including their transfer). The fingerprint of a host transfer travels
  beside it, inside ``transfer``;
- an asynchronous call's event spans the call to its completion (noticed by ``wait()`` or ``done()``):
  ``start`` (validation and the start of the transfer, at the call), ``transfer`` (in flight),
  ``host`` and ``write-back`` (at completion).

Methods without a hot path get an entry in place of the public method; those with one (allreduce,
broadcast, reduce_scatter, alltoall, allgather, reduce) are timed in the blocking driver and the asynchronous call
(``Engine.instrument``). A daemon thread writes what has accumulated every :data:`FLUSH_S` seconds to
``FILE.<rank>.raw`` (marshal, one batch per write; what each call was: its kind, named when its cached
call was made, or the flight recorder's record of a general-path call), as does a flight-recorder dump.
At the end of the process (``atexit``) the batches become ``FILE.<rank>``: a Chrome trace
(``traceEvents`` JSON; chrome://tracing, https://ui.perfetto.dev): one process per rank, one thread per
communicator (and one for its point-to-point calls), one event per call (``cat`` ``call``; ``args``: its
sequence number, collective, op, root, dtype, shape, bytes, path, state, error, call site and its
``phases``), the phases of a general-path call as events nested in it (``cat`` ``phase``). ``python -m
collectives trace FILE --timeline OUT`` merges the ranks' files (or their raw batches, of a job that
died) into one, with each collective call's arrival skew across ranks (``late_us``).
"""

from __future__ import annotations

import atexit
import functools
import glob
import json
import marshal
import os
import re
import threading
import time
import weakref

from . import _records

FORMAT = "collectives-timeline/2"
FLUSH_S = 0.25  # how often the daemon thread writes what has accumulated (40 bytes a hot-path call)
_ns = time.time_ns  # the hosts' clock (as the flight recorder's records): comparable across ranks of a host

_marks: list = []  # the phases of the call in progress, (name, start, end): appended by the instrumented
# steps below, taken by the call's entry when it returns (one thread at a time is inside a collective)
_collect = [0]  # general-path calls under way: only they collect phases (a hot-path call is one transfer)
_jobs: dict = {}  # path prefix -> _Timeline (one per process, normally)
_HOT = ("allreduce", "broadcast", "reduce_scatter", "alltoall", "allgather", "reduce")  # the methods with a hot path
_P2P = ("send", "recv")
METHODS = ("broadcast", "allreduce", "allreduce_units", "reduce", "allgather", "gather", "reduce_scatter",
           "alltoall", "send", "recv", "split", "broadcast_object", "allgather_object", "barrier",
           "synchronize", "allreduce_tree")


def install(comm, engine) -> None:
    """Put the timeline's instruments in place (``COLLECTIVES_TIMELINE`` is set when ``comm`` is made;
    ``engine``: its Engine, through which they read it): entries in place of the public methods without a
    hot path; the hot path's cached calls timed (``Engine.instrument_hot``); the general path of the
    methods with a hot path timed in the blocking driver and the asynchronous call (``Engine.instrument``);
    the host transport's agreement and transfers marked as phases."""
    from . import _config

    prefix = _config.timeline()
    if prefix is None:
        return
    job = _jobs.get(prefix)
    host = engine.host_transport()
    if job is None:
        ranks = getattr(host, "world_ranks", None)
        job = _jobs[prefix] = _Timeline(prefix, int(ranks[host.rank]) if ranks else int(host.rank))
        _patch_reduction()
    tags = {name: job.tag(engine, name) for name in METHODS}
    for name in METHODS:
        if name not in _HOT:
            method = getattr(comm, name)
            setattr(comm, name, functools.wraps(method)(_general(job, engine, method, tags[name], name in _P2P)))
    engine.instrument_hot(functools.partial(_timed_run, job, engine, tags))
    engine.instrument("_blocking", functools.partial(_blocking, job, engine, tags))
    engine.instrument("_async", functools.partial(_asynchronous, job, engine, tags))
    agree = host.agree_allgather

    def agree_allgather(send, recv):
        t = _ns()
        try:
            return agree(send, recv)
        finally:
            if _collect[0]:
                _marks.append(("agreement", t, _ns()))

    host.agree_allgather = agree_allgather
    for name in _TRANSFERS:  # the host transport's own transfers (a direct call the hot path caches is not one)
        setattr(host, name, _transfer(getattr(host, name)))


# the host transport's methods whose calls are transfers (``start``, an asynchronous one, is not: its
# transfer is the time until completion)
_TRANSFERS = ("broadcast", "allreduce", "reduce", "reduce_scatter", "allgather", "gather", "alltoall", "barrier",
              "objects_broadcast", "objects_allgather", "send", "recv")


def _transfer(method):
    @functools.wraps(method)
    def transfer(*args, **kwargs):
        t = _ns()
        try:
            return method(*args, **kwargs)
        finally:
            if _collect[0]:
                _marks.append(("transfer", t, _ns()))

    transfer.timeline_transfer = True  # type: ignore[attr-defined]
    return transfer


def _patch_reduction() -> None:
    """``host reduction``: the time of ``_reduction.reduce_buffer`` (the host rules around a transfer), for
    every communicator of the process (looked up at each call, by the runners too)."""
    from . import _reduction

    plain = _reduction.reduce_buffer
    if getattr(plain, "timed", False):
        return

    @functools.wraps(plain)
    def reduce_buffer(*args, **kwargs):
        t = _ns()
        try:
            return plain(*args, **kwargs)
        finally:
            if _collect[0]:
                _marks.append(("host reduction", t, _ns()))

    reduce_buffer.timed = True  # type: ignore[attr-defined]
    _reduction.reduce_buffer = reduce_buffer


def _phased(steps):
    """A blocking call's steps (see ``Communicator._blocking``), with their phases marked."""
    t = _ns()
    try:
        step = next(steps)
    except StopIteration as stop:  # no transfer (one rank, nothing to move)
        _marks.append(("validation", t, _ns()))
        return stop.value
    except BaseException:
        _marks.append(("validation", t, _ns()))
        raise
    _marks.append(("validation", t, _ns()))
    while True:
        t = _ns()
        n = len(_marks)
        got = yield step
        t1 = _ns()
        if not any(m[0] == "transfer" for m in _marks[n:]):  # (else the transport's own calls marked it)
            _marks.append(("transfer", t, t1))
        try:
            step = steps.send(got)
        except StopIteration as stop:
            _marks.append(("write-back", t1, _ns()))
            return stop.value
        _marks.append(("host", t1, _ns()))


def _in_flight(steps, marks: list, since: int):
    """An asynchronous call's steps (the Handle's), with their phases marked in ``marks``: the time
    between the call (``since``) or a step and the next resumption is the transfer in flight."""
    while True:
        t = _ns()
        marks.append(("transfer", since, t))
        try:
            request = next(steps)
        except StopIteration as stop:
            marks.append(("write-back", t, _ns()))
            return stop.value
        since = _ns()
        marks.append(("host", t, since))
        yield request


def _take_marks(since: int) -> list:
    """The marks of the call that began at ``since`` (older ones, left by work outside any call such as a
    communicator's set-up, are dropped)."""
    marks = [m for m in _marks if m[1] >= since]
    del _marks[:]
    return marks


# ---- the instruments ----
# A hot-path call is its cached call, timed: it appends (kind, seq, bytes or root, start, end) to the job's
# array (kind: what the cached call is, named when it was made). Any other call is a tuple in job.slow,
# made by the entry of its method (methods without a hot path) or, for a method with one, by the blocking
# driver or the asynchronous call when no entry is around it (_depth).

_depth = [0]  # entries under way (the calls they make inside are theirs, not events of their own)


def _timed_run(job, engine, tags, names, run):
    """The hot path's cached call ``run`` (of ``names``: collective, op, dtype), timed."""
    kind, tag = job.kind(tags.get(names[0], tags["allreduce"]), names)
    if getattr(run, "timeline_transfer", False):  # the transport's own call, marked as a phase: itself here
        run = run.__wrapped__
    extend, seq, comm = job.fast.append, engine.seq_reader(), engine.communicator  # (a tuple appended to a
    # list: a third of what array.extend takes, which converts each integer; marshal writes the list)
    if getattr(run, "asynchronous", False):  # the asynchronous hot path's steps: from the call to completion
        def timed_steps(buf, x):
            t0 = _ns()
            n, entry = engine.trace_entry(False)  # (started by the Handle: the call's own number and entry)
            try:
                result = yield from run(buf, x)
            except BaseException as exc:  # (the event of a failed call: its entry, the error)
                job.slow.append((tag, n, t0, _ns(), entry, [], f"{type(exc).__name__}: {exc}"))
                raise
            extend((kind, n, buf.nbytes, t0, _ns()))
            return result

        timed_steps.asynchronous = True  # type: ignore[attr-defined]
        return timed_steps
    timed_in_place = getattr(run, "timed", None)
    if timed_in_place is not None:  # the transport's own call timed in its frame (mpi/ops.py Operation.bind):
        # a frame less than the wrappers below on the 8-byte path
        return timed_in_place((extend, kind, seq, comm, lambda t0, exc: job.failed(engine, tag, False, t0, exc)))
    if names[0] in ("broadcast", "reduce"):  # (a rooted call: its root kept, as a broadcast's)
        def timed_rooted(x, root):
            t0 = _ns()
            try:
                run(x, root)
            except BaseException as exc:
                job.failed(engine, tag, False, t0, exc)
                raise
            extend((kind, seq(comm), root, t0, _ns()))

        return timed_rooted
    if names[0] in ("reduce_scatter", "alltoall", "allgather"):
        def timed_blocks(x, out):
            t0 = _ns()
            try:
                run(x, out)
            except BaseException as exc:
                job.failed(engine, tag, False, t0, exc)
                raise
            extend((kind, seq(comm), x.nbytes, t0, _ns()))

        return timed_blocks

    def timed(x):
        t0 = _ns()
        try:
            run(x)
        except BaseException as exc:
            job.failed(engine, tag, False, t0, exc)
            raise
        extend((kind, seq(comm), x.nbytes, t0, _ns()))

    return timed


def _blocking(job, engine, tags, blocking):
    """The blocking driver (``Communicator._blocking``), with the phases of the call's steps marked; the
    call's event where no entry is around it (a general-path call of a method with a hot path)."""
    def driver(steps):
        if _depth[0]:
            return blocking(_phased(steps))
        t0 = _ns()
        _collect[0] += 1
        try:
            result = blocking(_phased(steps))
        except BaseException as exc:
            seq, entry = engine.trace_entry(False)
            job.slow.append((tags.get(getattr(entry, "collective", None), tags["allreduce"]), seq, t0, _ns(),
                             entry, _take_marks(t0), f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            _collect[0] -= 1
        seq, entry = engine.trace_entry(False)
        job.slow.append((tags.get(getattr(entry, "collective", None), tags["allreduce"]), seq, t0, _ns(), entry,
                         _take_marks(t0), None))
        return result

    return driver


def _asynchronous(job, engine, tags, call):
    """The asynchronous call (``Communicator._async``): its event where no entry is around it."""
    def asynchronous(what, define, *args):
        if _depth[0]:
            return call(what, define, *args)
        return job.asynchronous(engine, tags.get(what, tags["allreduce"]), call, (what, define, *args), {},
                                what in _P2P)

    return asynchronous


def _general(job, engine, method, tag, p2p: bool):
    def call(*args, **kwargs):
        _depth[0] += 1
        _collect[0] += 1
        try:
            if kwargs.get("async_op"):
                return job.asynchronous(engine, tag, method, args, kwargs, p2p)
            t0 = _ns()
            try:
                result = method(*args, **kwargs)
            except BaseException as exc:
                job.failed(engine, tag, p2p, t0, exc)
                raise
            seq, entry = engine.trace_entry(p2p)
            job.slow.append((tag, seq, t0, _ns(), entry, _take_marks(t0), None))
            return result
        finally:
            _depth[0] -= 1
            _collect[0] -= 1

    return call


class _Finish:
    """Stands for an asynchronous call's flight-recorder record in its Handle (``Handle._record``): its
    completion finishes the record (if any) and writes the call's event."""

    __slots__ = ("entry", "job", "marks", "record", "seq", "start", "tag")

    def __init__(self, job, tag, seq, start, entry, marks, record):
        self.job, self.tag, self.seq, self.start = job, tag, seq, start
        self.entry, self.marks, self.record = entry, marks, record

    def finish(self, error: BaseException | None = None) -> None:
        if self.record is not None:
            _records.finish(self.record, error)
        self.job.slow.append((self.tag, self.seq, self.start, _ns(), self.entry, self.marks,
                              None if error is None else f"{type(error).__name__}: {error}"))


# ---- what each rank writes ----

class _Timeline:
    def __init__(self, prefix: str, rank: int):
        self.prefix, self.rank = prefix, rank
        self.raw = f"{prefix}.{rank}.raw"
        self.out = f"{prefix}.{rank}"
        os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
        for stale in (self.raw, self.out):  # a file of an earlier job with the same name
            try:
                os.unlink(stale)
            except OSError:
                pass
        self.file = open(self.raw, "ab")  # noqa: SIM115 - open for the life of the process, closed at exit
        self.fast: list = []  # (kind, seq, size (a broadcast or reduce: root), start, end) of each hot-path call
        self.slow: list = []  # (tag, seq, start, end, entry, marks, error) of every other call
        self.kinds: list = []  # kind -> (tag, collective, op, dtype) of a hot-path cached call
        self.tags: list = []  # tag -> (weak reference to the communicator, method)
        self.lock = threading.Lock()
        self.done = False
        atexit.register(self.close)
        thread = threading.Thread(target=self._flusher, name="collectives-timeline", daemon=True)
        thread.start()

    def tag(self, engine, name: str) -> int:
        self.tags.append((weakref.ref(engine), name))
        return len(self.tags) - 1

    def kind(self, tag: int, names: tuple) -> tuple[int, int]:
        """``(kind, tag)`` of a hot-path cached call (``names``: collective, op, dtype) of ``tag``'s comm."""
        engine = self.tags[tag][0]
        own = next((t for t, (ref, name) in enumerate(self.tags) if ref is engine and name == names[0]), tag)
        self.kinds.append((own, *names))
        return len(self.kinds) - 1, own

    def failed(self, engine, tag: int, p2p: bool, t0: int, exc: BaseException) -> None:
        """A call that raised: its record's entry where the call made one (its seq moved), else none."""
        seq, entry = engine.trace_entry(p2p)
        state = _records.state(entry) if _records.is_record(entry) else None
        if entry is not None and not (state == "failed" or (entry.__class__ is tuple and len(entry) == 3)):
            seq, entry = -1, None  # refused before it was recorded (another thread inside a collective)
        self.slow.append((tag, seq, t0, _ns(), entry, _take_marks(t0), f"{type(exc).__name__}: {exc}"))

    def asynchronous(self, engine, tag: int, method, args, kwargs, p2p: bool = False):
        t0 = _ns()
        _collect[0] += 1
        try:
            handle = method(*args, **kwargs)
        except BaseException as exc:
            self.failed(engine, tag, p2p, t0, exc)
            raise
        finally:
            _collect[0] -= 1
        t1 = _ns()
        seq, entry = engine.trace_entry(p2p)
        marks = [("start", t0, t1), *_take_marks(t0)]
        if handle._finished:
            self.slow.append((tag, seq, t0, t1, entry, marks, None if handle._error is None else
                              f"{type(handle._error).__name__}: {handle._error}"))
            return handle
        handle._record = _Finish(self, tag, seq, t0, entry, marks, handle._record)
        handle._steps = _in_flight(handle._steps, marks, t1)
        return handle

    def _flusher(self) -> None:
        while not self.done:
            time.sleep(FLUSH_S)
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the timeline must never take the process down
                pass

    def flush(self) -> None:
        """Write the calls kept so far as one batch (see :func:`read`)."""
        with self.lock:
            n = len(self.fast)
            rows = self.fast[:n]
            del self.fast[:n]
            k = len(self.slow)
            slow = self.slow[:k]
            del self.slow[:k]
            if (not n and not k) or self.file.closed:
                return
            table = [(_name(ref()), name) for ref, name in self.tags]
            events = [(tag, seq, t0, t1, _describe(self.tags[tag][0](), entry), m, error)
                      for tag, seq, t0, t1, entry, m, error in slow]
            marshal.dump((FORMAT, self.rank, table, list(self.kinds), rows, events), self.file)
            self.file.flush()

    def close(self) -> None:
        """At the end of the process: write what is left and turn the batches into the Chrome trace."""
        if self.done:
            return
        self.done = True
        try:
            self.flush()
        finally:
            self.file.close()
        trace = chrome(read(self.raw))
        tmp = f"{self.out}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps(trace))  # (in one piece: json.dump writes chunk by chunk, several times slower)
        os.replace(tmp, self.out)
        os.unlink(self.raw)


def flush_all() -> None:
    """Write every timeline's calls kept so far (a flight-recorder dump does: the job may be ending)."""
    for job in list(_jobs.values()):
        try:
            job.flush()
        except Exception:  # noqa: BLE001 - never in the way of the dump
            pass


def _name(engine) -> str:
    return "?" if engine is None else str(engine.name())


def _describe(engine, entry) -> tuple:
    """What a ring entry says of its call: ``(collective, op, root, dtype, shape, nbytes, path, site, state,
    error)`` (a hot-path entry: the cached call, with its shape and error where it keeps them)."""
    if entry is None:
        return (None,) * 10
    if _records.is_record(entry):  # (seq, collective, ..., thread, start, end, state, error): _records.FIELDS
        made = _records.fields(entry)
        return made[1:9] + made[12:]
    run, shape, error = (*entry, None)[:3] if entry.__class__ is tuple else (entry, None, None)
    collective, op, dtype = (None, None, None) if engine is None else engine.hot_name(run)
    return (collective, op, None, dtype, None if shape is None else [int(n) for n in shape], None, "hot path", None,
            "failed" if error else "completed", error)


# ---- reading ----

def read(path: str) -> dict:
    """A rank's raw batches (``<prefix>.<rank>.raw``) as ``{"rank", "calls"}``: one dict per call (``comm``,
    ``method``, ``seq``, ``start``, ``end`` in ns, the fields of :func:`_describe`, ``phases``), in order of
    completion. A batch cut short (the process died while writing it) ends the reading."""
    calls: list = []
    rank = None
    fields = ("collective", "op", "root", "dtype", "shape", "nbytes", "path", "site", "state", "error")
    with open(path, "rb") as f:
        while True:
            try:
                form, rank, table, kinds, rows, events = marshal.load(f)
            except (EOFError, ValueError, TypeError):
                break
            if form != FORMAT:
                break
            for kind, seq, aux, t0, t1 in rows:
                tag, collective, op, dtype = kinds[kind]
                info = dict.fromkeys(fields)
                info.update(collective=collective, op=op, dtype=dtype, path="hot path", state="completed")
                if collective in ("broadcast", "reduce"):
                    info["root"] = aux
                else:
                    info["nbytes"] = aux
                calls.append(_call(table[tag], seq, t0, t1, info, None))
            for tag, seq, t0, t1, described, marks, error in events:
                info = dict(zip(fields, described))
                if error is not None:
                    info["state"], info["error"] = "failed", error
                elif info["state"] is None or info["state"] == "started":
                    info["state"] = "completed"
                calls.append(_call(table[tag], seq, t0, t1, info, marks or []))
    return {"rank": rank, "calls": calls}


def _call(where, seq, t0, t1, info, marks) -> dict:
    comm, method = where
    call = {"comm": comm, "method": method, "p2p": method in _P2P, "seq": seq, "start": t0, "end": t1}
    call.update(info)
    if call["collective"] is None:
        call["collective"] = method
    marks = [[str(name), int(a), int(b)] for name, a, b in marks or ()]
    if not any(m[0] in ("transfer", "start") for m in marks):  # a call whose transfers no transport call marked
        # (a hot-path call: the cached call; a tree's buckets): the time after its other phases
        marks.append(["transfer", max((m[2] for m in marks), default=t0), t1])
    call["phases"] = marks
    return call


def chrome(timeline: dict, pid: int | None = None, origin: int | None = None) -> dict:
    """A rank's calls (:func:`read`) as a Chrome trace: one event per call (``cat`` ``call``), its phases
    nested in it (``cat`` ``phase``); times in microseconds since ``origin`` (ns of the hosts' clock;
    default: the whole second before the first call), which ``otherData`` keeps (``origin_ns``)."""
    rank = timeline["rank"] if pid is None else pid
    if origin is None:
        origin = min((c["start"] for c in timeline["calls"]), default=0) // 10**9 * 10**9
    events: list = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    lanes: dict = {}
    for c in timeline["calls"]:
        lane = f"{c['comm']} p2p" if c["p2p"] else c["comm"]
        tid = lanes.setdefault(lane, len(lanes))
        args = {k: c.get(k) for k in ("seq", "comm", "op", "root", "dtype", "shape", "nbytes", "path", "state", "error",
                                      "site")}
        args["phases"] = [[name, (a - origin) / 1e3, (b - a) / 1e3] for name, a, b in c["phases"]]
        if "late_us" in c:
            args["late_us"] = c["late_us"]
        events.append({"name": c["collective"], "cat": "call", "ph": "X", "pid": rank, "tid": tid,
                       "ts": (c["start"] - origin) / 1e3, "dur": max(0.0, (c["end"] - c["start"]) / 1e3),
                       "args": args})
        if len(c["phases"]) == 1 and c["phases"][0][1:] == [c["start"], c["end"]]:
            continue  # one phase, the call itself (a hot-path call): in its args only
        for name, a, b in c["phases"]:
            events.append({"name": name, "cat": "phase", "ph": "X", "pid": rank, "tid": tid, "ts": (a - origin) / 1e3,
                           "dur": max(0.0, (b - a) / 1e3), "args": {"seq": c["seq"]}})
    for lane, tid in lanes.items():
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"format": FORMAT, "rank": rank,
                                                                          "origin_ns": origin}}


_FILE = re.compile(r"\.(\d+)(\.raw)?$")


def load(prefix: str) -> dict[int, dict]:
    """Every rank's timeline of ``prefix`` (``<prefix>.<rank>``, or the raw batches of a rank that died
    before writing it) as ``{rank: {"rank", "calls"}}``."""
    found: dict[int, dict] = {}
    for path in sorted(glob.glob(glob.escape(prefix) + ".*")):
        m = _FILE.search(path[len(prefix):])
        if m is None or path[len(prefix):] != m.group(0):
            continue
        rank = int(m[1])
        if m[2]:
            if rank not in found:
                found[rank] = read(path)
            continue
        with open(path) as f:
            trace = json.load(f)
        found[rank] = _calls(trace, rank)
    return found


def _calls(trace: dict, rank: int) -> dict:
    """A rank's Chrome trace back as its calls (what :func:`read` gives)."""
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    origin = int(trace.get("otherData", {}).get("origin_ns", 0))
    calls = []
    for e in trace["traceEvents"]:
        if e.get("cat") != "call":
            continue
        a = e["args"]
        calls.append({**a, "collective": e["name"], "comm": a.get("comm"), "p2p": lanes.get(e["tid"], "").endswith(" p2p"),
                      "start": origin + round(e["ts"] * 1e3), "end": origin + round((e["ts"] + e["dur"]) * 1e3),
                      "phases": [[n, origin + round(t * 1e3), origin + round((t + d) * 1e3)]
                                 for n, t, d in a.get("phases", [])]})
    return {"rank": rank, "calls": calls}


def merge(timelines: dict[int, dict]) -> dict:
    """One Chrome trace of every rank's timeline; each collective call's args get ``late_us``: how much
    later this rank started it than the first rank to (its arrival skew, from the hosts' clocks)."""
    first: dict = {}
    for t in timelines.values():
        for c in t["calls"]:
            if not c["p2p"] and c["seq"] >= 0:
                key = (c["comm"], c["seq"])
                first[key] = min(first.get(key, c["start"]), c["start"])
    events: list = []
    origin = min((c["start"] for t in timelines.values() for c in t["calls"]), default=0) // 10**9 * 10**9
    for rank, t in sorted(timelines.items()):
        for c in t["calls"]:
            if not c["p2p"] and c["seq"] >= 0:
                c["late_us"] = (c["start"] - first[(c["comm"], c["seq"])]) / 1e3
        events.extend(chrome(t, rank, origin)["traceEvents"])
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"format": FORMAT, "origin_ns": origin,
                                                                          "ranks": sorted(timelines)}}

"""The flight recorder (issue 22), in one job: what each front end's calls leave in the record, the ring's
bound, the off switch, and the analyzer's verdict on the dumps every rank writes. The crash suite runs the
failing jobs (a rank that skips a call, a different collective, a stall, SIGUSR1)."""

import json
import os

import numpy as np
import pytest

import collectives as coll
from collectives._comm import engine_of  # the record as the dumps see it (Engine.trace_entries)


def records(comm):
    return engine_of(comm).trace_entries()


def fresh(comm, **env):
    """A communicator over a duplicate of comm's MPI communicator, made with ``env`` set."""
    mpi = pytest.importorskip("mpi4py.MPI")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        return coll.init(comm=mpi.COMM_WORLD.Dup())
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_every_front_end_is_recorded_in_order(comm):
    c = fresh(comm)
    try:
        x = np.ones(5, np.float32)
        c.allreduce(x)  # the general path (it fills the hot path's cache)
        c.allreduce(x)  # the hot path
        c.broadcast(x, root=c.size - 1)
        c.broadcast(x, root=c.size - 1)
        c.allreduce(np.ones(3), "max", async_op=True).wait()
        c.barrier()
        c.allgather_object(c.rank)
        coll.allreduce_tree({"a": np.ones(2), "b": [np.zeros(3)]}, op="sum", comm=c)
        h = coll.allreduce_tree({"a": np.ones(2)}, op="sum", comm=c, async_op=True)
        h.wait()
        c.allreduce(np.ones((2, 3), np.int32), "min", async_op=True).wait()  # the general path (it fills ...
        h = c.allreduce(np.ones((2, 3), np.int32), "min", async_op=True)  # ... the asynchronous hot path's table)
        pending = records(c)[-1]
        h.wait()
        got = records(c)
        assert [e["seq"] for e in got] == list(range(1, 12)), got
        assert [e["collective"] for e in got] == ["allreduce", "allreduce", "broadcast", "broadcast", "allreduce",
                                                 "barrier", "allgather_object", "allreduce_tree",
                                                 "allreduce_tree", "allreduce", "allreduce"], got
        assert [e["path"].split(",")[0] for e in got] == ["blocking", "hot path", "blocking", "hot path",
                                                          "asynchronous", "blocking", "blocking", "tree buckets",
                                                          "tree buckets", "asynchronous", "hot path"], got
        # the asynchronous hot path's record: the call, started until its handle completes it, without a site
        assert got[10]["path"] == "hot path, asynchronous" and pending["state"] == "started", (got, pending)
        assert (got[10]["op"], got[10]["dtype"], got[10]["shape"]) == ("min", "int32", [2, 3]), got
        assert got[10]["site"] is None and got[10]["start"] <= got[10]["end"], got  # its times, not its site
        assert got[0]["op"] == got[1]["op"] == "sum" and got[4]["op"] == "max"
        assert got[2]["root"] == got[3]["root"] == c.size - 1
        assert got[0]["dtype"] == got[1]["dtype"] == "float32" and got[0]["shape"] == [5]
        assert got[1]["shape"] is None and got[3]["shape"] is None  # the hot path keeps no shape (its cost)
        assert all(e["state"] == "completed" for e in got), got
        here = os.path.abspath(__file__)
        assert got[0]["site"][0] == here and got[0]["site"][2] == "test_every_front_end_is_recorded_in_order"
        assert got[1]["site"] is None  # the hot path keeps no site
        assert got[0]["start"] <= got[0]["end"]
        every = c.allgather_object([(e["seq"], e["collective"]) for e in records(c)])
        assert all(r == every[0][:len(r)] for r in every), "every rank recorded the same calls"
    finally:
        c.close()


def test_the_allgather_hot_path_is_recorded_with_its_shape(comm):
    """allgather's hot path (a repeated call on a C-contiguous NumPy array, read-only ones too) keeps its
    cached call and the array's shape, as reduce_scatter's and alltoall's do; the bits are the general path's."""
    c = fresh(comm)
    try:
        x = np.arange(4, dtype=np.int16) + c.rank
        first = c.allgather(x)
        x.flags.writeable = False
        again = c.allgather(x)
        strided = c.allgather(np.repeat(x, 2)[::2])  # the same values, not contiguous: the general path
        got = records(c)
        assert [(e["collective"], e["path"].split(",")[0]) for e in got] == [
            ("allgather", "blocking"), ("allgather", "hot path"), ("allgather", "blocking")], got
        assert (got[1]["dtype"], got[1]["shape"], got[1]["nbytes"]) == ("int16", [4], 8), got
        assert first.tobytes() == again.tobytes() == strided.tobytes()
        assert again.shape == (c.size, 4) and again[-1].tolist() == list(range(c.size - 1, c.size + 3))
    finally:
        c.close()


def test_the_reduce_hot_path_is_recorded_with_its_root(comm):
    """reduce's hot path (a repeated call on a C-contiguous writable NumPy array) keeps its cached call, the
    array's shape and the call's root; one cached call serves every root; the bits are the general path's."""
    c = fresh(comm)
    try:
        root = c.size - 1
        x = np.arange(3, dtype=np.float64) + c.rank
        first = c.reduce(x.copy(), "sum", root)
        again = c.reduce(x.copy(), "sum", root)
        to_0 = c.reduce(x.copy(), "sum", 0)
        got = records(c)
        assert [(e["collective"], e["path"].split(",")[0], e["root"]) for e in got] == [
            ("reduce", "blocking", root), ("reduce", "hot path", root), ("reduce", "hot path", 0)], got
        assert (got[1]["op"], got[1]["dtype"], got[1]["shape"], got[1]["nbytes"]) == ("sum", "float64", [3], 24), got
        want = [float(sum(i + r for r in range(c.size))) for i in range(3)]
        if c.rank == root:
            assert first.tolist() == again.tolist() == want
        else:
            assert first.tolist() == again.tolist() == x.tolist()  # a non-root rank's array unchanged
        assert to_0.tolist() == (want if c.rank == 0 else x.tolist())
    finally:
        c.close()


def test_failed_calls_are_recorded_as_failed(comm):
    c = fresh(comm)
    try:
        with pytest.raises(TypeError):
            c.allreduce(np.ones(2, bool), "sum")  # bool sum: refused before any communication
        with pytest.raises(ValueError):
            c.broadcast(np.ones(2), root=c.size)
        got = records(c)
        assert [(e["collective"], e["state"]) for e in got] == [("allreduce", "failed"), ("broadcast", "failed")]
        assert got[0]["error"].startswith("TypeError") and got[1]["error"].startswith("ValueError")
    finally:
        c.close()


def test_the_ring_keeps_the_last_calls_only(comm):
    c = fresh(comm, COLLECTIVES_TRACE_BUFFER=5)
    try:
        x = np.ones(1)
        for _ in range(12):
            c.allreduce(x)
        assert [e["seq"] for e in records(c)] == [8, 9, 10, 11, 12]
    finally:
        c.close()


def test_buffer_zero_records_nothing(comm):
    c = fresh(comm, COLLECTIVES_TRACE_BUFFER=0)
    try:
        c.allreduce(np.ones(2))
        c.allreduce(np.ones(2))
        assert records(c) == [] and engine_of(c).trace_name() is None
    finally:
        c.close()


def test_split_communicators_are_named_alike_on_every_rank(comm):
    sub = comm.split(comm.rank % 2)
    try:
        names = comm.allgather_object(engine_of(sub).trace_name())
        assert all(n == names[0] for n in names) and names[0].startswith("world.")
    finally:
        sub.close()


def test_dumps_of_every_rank_read_as_no_divergence(comm):
    """Every rank's dump, read back and given to the analyzer's verdict together (in memory: the trace
    directory is shared with the rest of the suite, whose timeouts ask every rank to dump again later)."""
    from collectives import _tracetool

    x = np.arange(4.0)
    comm.allreduce(x)
    comm.barrier()
    path = coll.dump_trace()
    with open(path) as f:
        dump = json.load(f)
    assert dump["rank"] == comm.rank and dump["size"] == comm.size and dump["pid"] == os.getpid()
    assert any(t["name"] == "MainThread" for t in dump["threads"])
    dumps = dict(enumerate(comm.allgather_object(dump)))
    first = _tracetool.verdict(dumps)[0]
    assert first.startswith("no divergence on world"), first


def test_a_hot_path_record_agrees_with_a_general_one_of_the_same_call(comm):
    """The hot path keeps no shape: where rank 0 repeats a call on the hot path while the others take the
    general path for the same call (a strided view), the analyzer sees one call, not a divergence."""
    from collectives import _tracetool

    c = fresh(comm)
    try:
        c.allreduce(np.ones(3))  # the general path on every rank (fills the hot path's cache)
        c.allreduce(np.ones(3) if c.rank == 0 else np.ones(6)[::2])  # hot on rank 0, general elsewhere
        mine = records(c)
        assert mine[1]["path"].split(",")[0] == ("hot path" if c.rank == 0 else "blocking") and mine[1]["shape"] in (None, [3])
        # one name on every rank (a communicator of init(comm=...) is named by how many this process made,
        # which the rest of the suite can make differ between ranks)
        snapshot = dict(engine_of(c).trace_snapshot(), name="under-test")
        dump = {"rank": c.rank, "size": c.size, "threads": [], "communicators": [snapshot]}
        dumps = dict(enumerate(c.allgather_object(dump)))
        first = _tracetool.verdict(dumps)[0]
        assert first.startswith("no divergence on under-test"), first
        assert "completed is #2" in first, first
    finally:
        c.close()


def _sigusr1_is_ours() -> bool:
    import signal

    from collectives import _trace  # whether the recorder installed its handler (pytest's run may not allow it)

    return hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) is _trace._on_signal


def _read_dump(path: str) -> dict:
    with open(path) as f:
        return json.load(f)  # a torn file would not parse


def test_sigusr1_in_a_loop_during_dumps_of_every_kind_never_deadlocks(comm):
    """Issue 32: a signal arriving while the main thread is inside a dump (the user's dump_trace(), a
    MismatchError's, a fingerprint's, one asked for by another rank) never re-enters it, and no dump file
    is ever torn. A hang here is the pytest timeout."""
    import signal
    import threading
    import time

    if not _sigusr1_is_ours():
        pytest.skip("SIGUSR1 is not the flight recorder's in this process")
    stop = threading.Event()

    def shoot():
        while not stop.is_set():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.0005)

    shooter = threading.Thread(target=shoot, daemon=True)
    shooter.start()
    try:
        c = fresh(comm)
        c.check = True
        end = time.monotonic() + 1.0
        rounds = 0
        while True:
            rounds += 1
            _read_dump(coll.dump_trace())
            if c.size > 1:
                with pytest.raises(coll.MismatchError):  # checked mode: dumps, the communicator stays usable
                    c.allreduce(np.ones(2 + (c.rank == c.size - 1)))
            if rounds % 10 == 0:
                _read_dump(coll.dump_trace(all_ranks=True))
            # every rank leaves the loop together (the clock of rank 0 decides)
            if c.broadcast(np.array([time.monotonic() > end]), root=0)[0]:
                break
        size = c.size
        c.close()
        for _ in range(3 if size > 1 else 0):  # the fingerprint's dump, beside an asynchronous call
            f = fresh(comm)
            with pytest.raises(coll.MismatchError):
                f.allreduce(np.ones(2), "sum" if f.rank else "mean", async_op=True).wait()
            f.close()
    finally:
        stop.set()
        shooter.join()
    path = coll.dump_trace()
    served = len(_read_dump(path)["reasons"])
    os.kill(os.getpid(), signal.SIGUSR1)  # after the storm, a signal is still served (by the watcher)
    deadline = time.monotonic() + 10
    # (another rank's all_ranks request may be answered in between: look for the reason among the new ones)
    while "SIGUSR1" not in _read_dump(path)["reasons"][served:] and time.monotonic() < deadline:
        time.sleep(0.05)
    from collectives import _trace  # (why, if not: the recorder's own state)
    state = (_trace._wakeup, list(_trace._signalled), [t.is_alive() for t in _trace._watcher], _trace._serving.locked(),
             _read_dump(path)["reasons"][-3:])
    assert "SIGUSR1" in _read_dump(path)["reasons"][served:], state


def test_sigusr1_dumps_a_rank_blocked_inside_mpi(comm):
    """The watcher thread dumps on SIGUSR1 while the main thread is inside a blocking MPI receive, where
    no Python signal handler can run."""
    import signal
    import time

    from support.comms import gather_objects

    if comm.size < 2:
        pytest.skip("needs a second rank to signal the blocked one and then unblock it")
    ours = all(gather_objects(_sigusr1_is_ours()))
    if not ours:
        pytest.skip("SIGUSR1 is not the flight recorder's in this process")
    c = fresh(comm)
    pids = gather_objects((os.getpid(), coll.dump_trace()))
    x = np.zeros(4)
    if c.rank == 0:
        c.recv(x, src=1, tag=9)  # MPI_Recv: blocked in C until rank 1 sends
        assert x.tolist() == [1.0] * 4
    elif c.rank == 1:
        pid, path = pids[0]
        before = len(_read_dump(path)["reasons"])
        time.sleep(1.0)  # rank 0 is inside MPI_Recv by now
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + 20
        dumped = None
        while time.monotonic() < deadline:  # (a later dump may overwrite it: its reasons keep it)
            d = _read_dump(path)
            if "SIGUSR1" in d["reasons"][before:]:
                dumped = d
                break
            time.sleep(0.05)
        c.send(np.ones(4), dst=0, tag=9)
        assert dumped is not None, "rank 0 did not dump on SIGUSR1 while inside MPI_Recv"
        main = [t for t in dumped["threads"] if t["name"] == "MainThread"]
        assert main and any("recv" in frame[2] for frame in main[0]["stack"]), main
    c.barrier()
    c.close()


def _outer_call(c, x, depth, function):
    """A user function that calls itself ``depth`` times, then makes an asynchronous allreduce (through the
    module's function, one frame deeper, or the method)."""
    if depth:
        return _outer_call(c, x, depth - 1, function)
    if function:
        return coll.allreduce(x, "max", comm=c, async_op=True).wait()
    return c.allreduce(x, "max", async_op=True).wait()


def test_call_sites_stay_right_when_the_paths_alternate(comm):
    """The record finds a call site through the paths it remembers (a frame checked per path, its code and
    instruction, not the whole stack walked): calls that alternate between paths of different depths,
    through the module function and the method, from a recursive user function at different depths (where
    a frame of the same function sits at a remembered depth, at another instruction), each get their own
    line. (Float max: a pair the asynchronous hot path never takes, so every call keeps its record and site.)"""
    import inspect

    c = fresh(comm)
    x = np.ones(2)
    lines = inspect.getsource(test_call_sites_stay_right_when_the_paths_alternate).splitlines()
    first = test_call_sites_stay_right_when_the_paths_alternate.__code__.co_firstlineno
    line = {tag: first + next(i for i, t in enumerate(lines) if t.endswith(f"# {tag}")) for tag in ("METHOD", "FUNCTION")}
    recursive = _outer_call.__code__.co_firstlineno + 6
    got = []
    for i in range(12):
        c.allreduce(x, "max", async_op=True).wait()  # METHOD
        got.append((records(c)[-1]["site"][1:], ("METHOD", "test_call_sites_stay_right_when_the_paths_alternate")))
        coll.allreduce(x, "max", comm=c, async_op=True).wait()  # FUNCTION
        got.append((records(c)[-1]["site"][1:], ("FUNCTION", "test_call_sites_stay_right_when_the_paths_alternate")))
        _outer_call(c, x, i % 3, True)
        got.append((records(c)[-1]["site"][1:], ("RECURSIVE-FUNCTION", "_outer_call")))
        _outer_call(c, x, (i + 1) % 3, False)
        got.append((records(c)[-1]["site"][1:], ("RECURSIVE-METHOD", "_outer_call")))
    expected = {"METHOD": line["METHOD"], "FUNCTION": line["FUNCTION"], "RECURSIVE-FUNCTION": recursive,
                "RECURSIVE-METHOD": recursive + 1}
    for site, (tag, function) in got:
        assert site == [expected[tag], function], (site, tag, got)
    c.close()


def test_the_watcher_reads_no_other_thread_s_frames_while_nothing_stalls(comm, monkeypatch):
    """The watcher thread polls twice a second; it must not read the threads' frames to do it: on Python
    3.11 reading the frames of a thread that is running (``sys._current_frames()``) is a use-after-free
    that crashed ranks at random inside torch. It learns that a collective is in progress from the thread
    guard. (``sys._current_frames`` is counted: nothing public shows what the watcher reads.)"""
    import sys
    import threading
    import time

    if not any(t.name == "collectives-trace-watcher" for t in threading.enumerate()):
        pytest.skip("no watcher thread in this process (the record is off)")
    # an earlier test's dump_trace(all_ranks=True) leaves a request file that a watcher serves at its next
    # poll (twice a second; later on an oversubscribed machine), and serving it reads the frames, as it
    # should: let every watcher serve what is pending before counting (3 polls)
    comm.barrier()
    time.sleep(1.5)
    comm.barrier()
    readers = []
    real = sys._current_frames

    def counting():
        readers.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(sys, "_current_frames", counting)
    x = np.ones(4)
    for _ in range(160):  # 1.6 s or more: three polls, with collectives in progress and between them (a
        comm.allreduce(x, "sum")  # count, not a time: every rank makes the same calls)
        time.sleep(0.01)
    monkeypatch.undo()
    assert "collectives-trace-watcher" not in readers, readers

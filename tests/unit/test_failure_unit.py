"""Single-process checks of the failure machinery: the agreement messages, the refusal of invalid calls in
checked mode, the abort hook, and the deadline transport (with stand-in MPI objects; the real thing runs
under mpiexec in tests/crash)."""

import io
import subprocess
import sys
import textwrap
import time
import types

import numpy as np
import pytest

from collectives import CollectiveError, CollectiveTimeoutError, MismatchError, _agree, _failure
from collectives._launcher import job_environment


class RecordingTransport:
    """A stand-in host transport; the other ranks make the scripted calls ``others``, each
    ``(what, header, entries)`` or ``(what, error text)`` for a rank that refused. Records what this rank
    sent in each round. (The agreement protocol is private: a unit test is the only place that can script
    what the other ranks say.)"""

    name = "fake"

    def __init__(self, rank, others):
        self.rank, self.size = rank, len(others) + 1
        self.others = others
        self.sent = []
        self.rounds = []

    def agree_allgather(self, send, recv):  # round one: fingerprints
        self.rounds.append("fingerprints")
        for r, other in enumerate(self.others):
            row = recv[r if r < self.rank else r + 1]
            refused = len(other) == 2
            row[:16] = 0 if refused else np.frombuffer(_agree.fingerprint(*other), dtype=np.uint8)
            row[16] = refused
        recv[self.rank] = send

    def allgather_object(self, obj):  # round two: the descriptions themselves
        self.rounds.append("calls")
        self.sent.append(obj)
        calls = [(o[0], None, o[1]) if len(o) == 2 else (o[0], o, None) for o in self.others]
        calls.insert(self.rank, obj)
        return calls


def header(**kw):
    return tuple(kw.items())


# ---- the agreement step ----

def test_agree_passes_when_every_rank_agrees():
    h = header(op="sum", shape=(3,), dtype="float64", device="host")
    t = RecordingTransport(0, [("allreduce", h, ()), ("allreduce", h, ())])
    _agree.agree(t, "allreduce", h)
    assert t.rounds == ["fingerprints"]  # one fixed-size allgather when all agree


def test_fingerprint_depends_on_every_value():
    h = dict(op="sum", root=0, shape=(3,), dtype="float64")
    prints = {_agree.fingerprint("reduce", header(**dict(h, **change))) for change in
              ({}, {"op": "max"}, {"root": 1}, {"shape": (3, 1)}, {"dtype": "float32"})}
    prints.add(_agree.fingerprint("x", header(**h)))
    prints.add(_agree.fingerprint("reduce", header(**h), (("['w']", "float32 (3,)"),)))
    assert len(prints) == 7 and len(_agree.fingerprint("reduce", header(**h))) == 16


def test_mismatch_message_names_every_side():
    base = dict(op="sum", shape=(3,), dtype="float64")
    calls = [("allreduce", header(**base), ()), ("allreduce", header(**dict(base, shape=(4,))), ()),
             ("allreduce", header(**dict(base, shape=(4,), dtype="float32")), ())]
    msg = _agree.mismatch_message(calls, " (checked mode)")
    assert "ranks disagree about allreduce (checked mode): shape: rank 0 has (3,), ranks 1,2 have (4,)" in msg
    assert "dtype: ranks 0,1 have 'float64', rank 2 has 'float32'" in msg
    assert "op:" not in msg  # agreeing keys are not listed
    with pytest.raises(MismatchError, match="ranks disagree about allreduce"):
        _agree.agree(RecordingTransport(1, calls[:1] + calls[2:]), *calls[1])


def test_mismatch_message_names_different_collectives_and_leaves():
    a = ("allreduce_tree", header(op="mean"), (("['w']", "float32 (3,)"), ("['b']", "float32 (2,)")))
    b = ("allreduce_tree", header(op="mean"), (("['w']", "float32 (4,)"), ("['b']", "float32 (2,)")))
    msg = _agree.mismatch_message([a, a, b])
    assert "leaf ['w']: ranks 0,1 have float32 (3,), rank 2 has float32 (4,)" in msg
    assert "['b']" not in msg and "(ranks differing from rank 0: 2)" in msg
    msg = _agree.mismatch_message([("barrier", (), ()), a])
    assert msg.startswith("ranks called different collectives: rank 0 called barrier, rank 1 called allreduce_tree")


def test_a_refusing_rank_raises_its_error_and_the_others_name_it():
    h = header(op="mean", shape=(3,), dtype="float64", device="host")
    t = RecordingTransport(1, [("allreduce", h, ())])
    err = TypeError("op='mean' on integer dtype int64 would truncate")
    with pytest.raises(TypeError) as caught:
        _agree.agree(t, "allreduce", (), None, err)
    assert caught.value is err and t.rounds == ["fingerprints", "calls"]
    assert t.sent == [("allreduce", None, "TypeError: " + str(err))]
    if sys.version_info >= (3, 11):
        assert "rank 1 refused this allreduce call" in err.__notes__[0]
    # the other rank hears about it
    with pytest.raises(MismatchError, match=r"allreduce refused by rank 1 \(checked mode\): rank 1 raised "
                                            r"TypeError: op='mean'.*Nothing was sent or changed on any rank"):
        _agree.agree(RecordingTransport(0, [("allreduce", t.sent[0][2])]), "allreduce", h)
    msg = _agree.refusal_message([("reduce", None, "ValueError: x"), ("reduce", None, "TypeError: y"),
                                  ("broadcast", ("broadcast", (), ()), None)])
    assert "refused by ranks 0,1" in msg and "rank 1 raised TypeError: y" in msg
    assert "(other ranks called broadcast)" in msg


def test_a_refusal_alone_or_closed_raises_at_once():
    for transport in (None, RecordingTransport(0, [])):
        with pytest.raises(ValueError, match="x"):
            _agree.agree(transport, "allreduce", (), None, ValueError("x"))


# ---- the abort hook ----

class FakeWorld:
    def __init__(self, rank, size):
        self.rank, self.size, self.aborted = rank, size, []

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Abort(self, code):
        self.aborted.append(code)


@pytest.fixture
def fake_mpi(monkeypatch):
    world = FakeWorld(1, 3)
    mpi = types.SimpleNamespace(COMM_WORLD=world, Is_initialized=lambda: True, Is_finalized=lambda: False)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    monkeypatch.setattr(_failure, "REPORT_GRACE_S", 0.0)
    monkeypatch.delenv("COLLECTIVES_ABORT_ON_ERROR", raising=False)
    saved = sys.excepthook
    yield world
    _failure.uninstall()
    sys.excepthook = saved


def test_hook_reports_chains_and_aborts(fake_mpi, monkeypatch):
    seen = []
    sys.excepthook = lambda *a: seen.append(a)
    assert _failure.install(types.SimpleNamespace(name="mpi")) and _failure.installed()
    assert _failure.install(types.SimpleNamespace(name="mpi"))  # idempotent
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    exc = ValueError("boom")
    sys.excepthook(ValueError, exc, None)
    assert err.getvalue().startswith("collectives: rank 1 of 3 failed with ValueError: boom\n")
    assert "aborting all 3 ranks" in err.getvalue() and "COLLECTIVES_ABORT_ON_ERROR=0" in err.getvalue()
    assert seen == [(ValueError, exc, None)]  # the previous hook printed the traceback
    assert fake_mpi.aborted == [1]


def test_hook_aborts_even_if_reporting_fails(fake_mpi, monkeypatch):
    def broken(*a):
        raise RuntimeError("hook of someone else")

    sys.excepthook = broken
    _failure.install(types.SimpleNamespace(name="mpi"))

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no")

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    sys.excepthook(Unprintable, Unprintable(), None)
    assert "failed with Unprintable: <unprintable>" in sys.stderr.getvalue()
    assert fake_mpi.aborted == [1]


@pytest.mark.parametrize("why", ["variable", "self", "one-process", "finalized"])
def test_hook_not_installed_when_it_does_not_apply(fake_mpi, monkeypatch, why):
    before = sys.excepthook
    transport = types.SimpleNamespace(name="mpi")
    if why == "variable":
        monkeypatch.setenv("COLLECTIVES_ABORT_ON_ERROR", "0")
    elif why == "self":
        transport.name = "self"
    elif why == "one-process":
        fake_mpi.size = 1
    else:
        sys.modules["mpi4py.MPI"].Is_finalized = lambda: True
    assert not _failure.install(transport)
    assert sys.excepthook is before and not _failure.installed()


def test_uninstall_restores_and_a_wrapped_hook_stops_acting(fake_mpi, monkeypatch):
    prev = sys.excepthook
    _failure.install(types.SimpleNamespace(name="mpi"))
    _failure.uninstall()
    assert sys.excepthook is prev
    # someone wrapped ours, then we were uninstalled: ours passes through without aborting
    seen = []
    _failure.install(types.SimpleNamespace(name="mpi"))
    monkeypatch.setattr(_failure, "_previous", lambda *a: seen.append(a))
    ours = sys.excepthook
    sys.excepthook = ours
    _failure.uninstall()
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    sys.excepthook(KeyError, KeyError("k"), None)
    assert len(seen) == 1 and fake_mpi.aborted == []


def test_abort_on_error_variable_is_validated(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_ABORT_ON_ERROR", "maybe")
    with pytest.raises(ValueError, match="COLLECTIVES_ABORT_ON_ERROR='maybe'"):
        _failure.abort_on_error()


# ---- the deadline transport, with stand-in requests ----

class Request:
    def __init__(self, done_after=None):
        self.left = done_after

    def Test(self):
        if self.left is None:
            return False
        self.left -= 1
        return self.left < 0


def deadline_transport(timeout):
    from collectives._backends.mpi import DeadlineMPITransport

    t = object.__new__(DeadlineMPITransport)
    t.timeout, t.rank, t.size, t.comm = timeout, 1, 2, None
    return t


def test_deadline_waits_for_a_request_that_completes():
    t = deadline_transport(5.0)
    t._wait(("allreduce", None, None), Request(done_after=200))
    t._wait(("barrier", None, None), Request(done_after=0))


def test_deadline_expires_with_a_typed_error_and_the_transport_stays_failed(capsys):
    t = deadline_transport(0.2)
    buf = np.zeros(7, dtype=np.float32)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        t._wait(("allreduce", buf, "op=sum"), Request(None))
    took = time.monotonic() - start
    assert 0.2 <= took < 1.5
    msg = str(info.value)
    assert ("allreduce of 7 x float32 (op=sum) did not complete on rank 1 of 2 within "
            "COLLECTIVES_TIMEOUT=0.2") in msg
    assert "COLLECTIVES_CHECK=1" in msg
    assert "collectives: allreduce of 7 x float32 (op=sum) timed out on rank 1 of 2" in capsys.readouterr().err
    with pytest.raises(CollectiveError, match="unusable: allreduce of 7 x float32 .* timed out"):
        t.barrier()  # refused at once: the transport stays failed
    t.close()  # does not free a communicator with a pending request
    assert t.comm is None


def test_deadline_polling_sleeps_after_a_while_instead_of_spinning():
    """Polling is continuous at first (MPI progresses only inside MPI_Test); a long wait, for a straggler,
    sleeps between polls instead of burning a core."""
    t = deadline_transport(1.5)
    t.SPIN_S = 0.1
    cpu, wall = time.process_time(), time.monotonic()
    with pytest.raises(CollectiveTimeoutError):
        t._wait(("barrier", None, None), Request(None))
    assert time.monotonic() - wall >= 1.5
    assert time.process_time() - cpu < 0.1 + 0.4


def run_python(code, env_extra):
    env = job_environment(drop=("COLLECTIVES_",), **env_extra)  # a fresh process (collectives._launcher)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("timeout", ["", "2.5"])
def test_timeout_variable_chooses_the_transport_once(timeout):
    pytest.importorskip("mpi4py")
    proc = run_python("""
        import numpy as np, collectives as coll
        from collectives._backends.mpi import MPITransport, DeadlineMPITransport
        c = coll.init("mpi")
        t = c._host
        x = np.arange(3.0)
        c.allreduce(x); c.broadcast(x); c.reduce(x); c.allgather(x); c.barrier()
        print(type(t).__name__, t.timeout, t.allgather_object({"a": 1}), t.broadcast_object([2], 0))
        print(type(t).allreduce is MPITransport.allreduce)
    """, {"COLLECTIVES_TIMEOUT": timeout})
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    if timeout:
        assert first == "DeadlineMPITransport 2.5 [{'a': 1}] [2]" and second == "False"
    else:
        assert first == "MPITransport None [{'a': 1}] [2]" and second == "True"


def test_mpi_errors_become_collective_errors_and_others_pass_through():
    from mpi4py import MPI

    from collectives._errors import transport_failure, translating

    err = transport_failure(MPI.Exception(MPI.ERR_TRUNCATE), "broadcast")
    assert isinstance(err, CollectiveError)
    assert str(err).startswith("MPI failed in broadcast on rank 0 of 1: ")
    assert f"MPI error class {MPI.ERR_TRUNCATE}" in str(err) and "COLLECTIVES_CHECK=1" in str(err)
    assert transport_failure(ValueError("x"), "broadcast") is None

    @translating("synchronize")
    def fails(exc):
        raise exc

    with pytest.raises(CollectiveError, match="MPI failed in synchronize") as info:
        fails(MPI.Exception(MPI.ERR_COUNT))
    assert isinstance(info.value.__cause__, MPI.Exception)
    with pytest.raises(TypeError, match="wrong"):  # not MPI's: untouched
        fails(TypeError("wrong"))

"""The agreement vocabulary of ``_agree`` (issue 33) in one process: ``size`` stand-in ranks, one thread each,
exchanging through a shared table (:class:`World`), so that every rank's result and error can be compared.
Each exchange is counted: the vocabulary never adds one (one gather, one fixed-size allgather, one allreduce)."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest

from collectives import MismatchError, _agree, _config


class World:
    """``size`` stand-in ranks; each exchange meets every rank's contribution (two barriers: deposit, read)."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=10)
        self.slots: list = [None] * size
        self.calls: list = []  # (rank, exchange)
        self.lock = threading.Lock()

    def exchange(self, rank: int, what: str, value) -> list:
        with self.lock:
            self.calls.append((rank, what))
        self.slots[rank] = value
        self.barrier.wait()
        out = copy.deepcopy(self.slots)
        self.barrier.wait()
        return out

    def run(self, fn) -> list:
        """``fn(rank's stand-in)`` on every rank at once: each rank's result or exception, in rank order."""
        results: list = [None] * self.size

        def one(r):
            try:
                results[r] = fn(Rank(self, r))
            except BaseException as exc:  # noqa: BLE001 - compared below
                results[r] = exc

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        return results


class Rank:
    """One rank's transport (``allgather_object``, ``agree_allgather``) and Communicator (``allreduce``)."""

    name = "fake"

    def __init__(self, world: World, rank: int):
        self.world, self.rank, self.size = world, rank, world.size

    def allgather_object(self, obj):
        return self.world.exchange(self.rank, "allgather_object", obj)

    def agree_allgather(self, send, recv):
        recv[...] = np.stack(self.world.exchange(self.rank, "agree_allgather", send.copy()))

    def allreduce(self, buf, op, async_op=False):
        assert op == "max" and buf.dtype == np.int64
        buf[...] = np.max(np.stack(self.world.exchange(self.rank, "allreduce", buf.copy())), axis=0)
        return Done() if async_op else buf


class Done:
    def wait(self):
        return None


def exchanges(world: World) -> dict:
    """How many of each exchange every rank made (the same on every rank, or the test fails)."""
    per_rank = [sorted(w for r, w in world.calls if r == rank) for rank in range(world.size)]
    assert all(p == per_rank[0] for p in per_rank), per_rank
    return {w: per_rank[0].count(w) for w in set(per_rank[0])}


# ---- gather, gather_rows ----

def test_gather_gives_every_rank_the_same_list_in_one_exchange():
    world = World(3)
    got = world.run(lambda t: _agree.gather(t, {"rank": t.rank, "nccl": t.rank != 1}))
    want = [{"rank": r, "nccl": r != 1} for r in range(3)]
    assert got == [want] * 3 and exchanges(world) == {"allgather_object": 1}


def test_gather_alone_sends_nothing():
    assert _agree.gather(None, ("x", 1)) == [("x", 1)]


def test_gather_rows_is_one_fixed_size_allgather_of_the_same_bits():
    world = World(3)
    rows = {0: (0, -1, 0), 1: (2, 5, 1), 2: (0, (1 << 62) + 7, 3)}
    got = world.run(lambda t: _agree.gather_rows(t, np.array(rows[t.rank], dtype=np.int64)))
    for table in got:
        assert table.dtype == np.int64 and table.tolist() == [list(rows[r]) for r in range(3)]
    assert exchanges(world) == {"agree_allgather": 1}
    alone = _agree.gather_rows(None, np.array([1, 2], dtype=np.uint8))
    assert alone.shape == (1, 2) and alone.dtype == np.uint8


# ---- Ballot ----

FIELDS = {"off": "any", "on": "all", "threshold": "max", "slot": "min", "digest": "same"}


def test_a_ballot_combines_every_field_in_one_allreduce_of_a_fixed_size():
    world = World(3)
    votes = {0: dict(off=False, on=True, threshold=4096, slot=1 << 20, digest=11),
             1: dict(off=True, on=True, threshold=0, slot=4096, digest=11),
             2: dict(off=False, on=False, threshold=1 << 40, slot=8192, digest=12)}

    def vote(t):
        ballot = _agree.Ballot(FIELDS)
        size = ballot.buf.size
        out = ballot.combine(t, votes[t.rank])
        assert ballot.buf.size == size == 6  # one slot per field, two for "same": whatever the values
        return out

    got = world.run(vote)
    assert got == [dict(off=True, on=False, threshold=1 << 40, slot=4096, digest=False)] * 3, got
    assert exchanges(world) == {"allreduce": 1}
    same = World(2).run(lambda t: _agree.Ballot({"digest": "same"}).combine(t, {"digest": -5}))
    assert same == [{"digest": True}] * 2


def test_a_ballot_keeps_the_bits_of_the_hand_written_buffers():
    """The overlap flag (``[any missing, digest, -digest]``) and the start-up settings travel as before."""
    assert _agree.Ballot({"missing": "any", "frozen": "same"}).fill({"missing": 3 > 2, "frozen": 7}).tolist() == [1, 7, -7]
    ballot = _agree.Ballot({"a": "max", "b": "min", "c": "all"})
    assert ballot.fill({"a": 9, "b": 4, "c": True}).tolist() == [9, -4, 0]
    assert ballot.combine(None, {"a": 9, "b": 4, "c": True}) == {"a": 9, "b": 4, "c": True}


def test_a_ballot_started_is_read_once_waited_for():
    world = World(2)

    def vote(t):
        ballot = _agree.Ballot({"missing": "any"})
        handle = ballot.start(t, {"missing": t.rank == 1})
        handle.wait()
        return ballot.result()

    assert world.run(vote) == [{"missing": True}] * 2 and exchanges(world) == {"allreduce": 1}


def test_a_ballot_refuses_an_unknown_combination():
    with pytest.raises(ValueError, match="'mean'"):
        _agree.Ballot({"x": "mean"})


# ---- refusing together, and the one way to name ranks ----

def test_ranks_and_holding_name_ranks_one_way():
    assert _agree.ranks([2]) == "rank 2" and _agree.ranks([0, 1]) == "ranks 0,1"
    assert _agree.holding(["X", "X", "Y"]) == "ranks 0,1 have X, rank 2 has Y"
    assert _agree.holding(["Y", "X", "Y"]) == "ranks 0,2 have Y, rank 1 has X"


def test_every_rank_raises_the_same_typed_error_naming_the_rank():
    """A malformed variable on rank 2 only (the start-up refusal): every rank raises one ValueError, the same
    text, naming rank 2 and its variable; with none anywhere, nobody raises."""
    world = World(3)
    problems = {2: ["COLLECTIVES_TIMEOUT='abc': expected seconds"]}
    got = world.run(lambda t: _agree.refuse_together(t, problems.get(t.rank, []), _config.malformed))
    assert all(isinstance(e, ValueError) for e in got), got
    assert len({str(e) for e in got}) == 1 and "(rank 2: COLLECTIVES_TIMEOUT='abc'" in str(got[0])
    assert World(3).run(lambda t: _agree.refuse_together(t, [], _config.malformed)) == [None] * 3


def test_refuse_raises_the_error_it_is_given():
    world = World(2)

    def check(t):
        votes = _agree.gather(t, "on" if t.rank == 0 else "off")
        if len(set(votes)) > 1:
            _agree.refuse(MismatchError("X differs: " + _agree.holding(votes)))

    got = world.run(check)
    assert all(isinstance(e, MismatchError) and str(e) == "X differs: rank 0 has on, rank 1 has off" for e in got)


def test_an_mpi4py_communicator_is_used_as_it_is_at_start_up():
    """Before a transport exists (the start-up settings, the malformed variables) the vocabulary talks on the
    mpi4py communicator itself: its pickled allgather, its buffer Allreduce (here alone, on COMM_SELF)."""
    mpi4py = pytest.importorskip("mpi4py")
    from collectives._backends.mpi import import_mpi

    try:
        MPI = import_mpi()
    except Exception as exc:  # noqa: BLE001 - a broken libmpi: nothing to test here
        pytest.skip(f"MPI is not usable: {exc}")
    assert mpi4py
    assert _agree.gather(MPI.COMM_SELF, {"a": 1}) == [{"a": 1}]
    assert _agree.Ballot({"n": "min", "on": "any"}).combine(MPI.COMM_SELF, {"n": 7, "on": 1}) == {"n": 7, "on": True}

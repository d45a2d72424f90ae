"""Issue 12 (hardening): the defects an adversarial pass found, one test (or a few) each.

Written in terms of ``comm.rank`` and ``comm.size``: passes under ``mpiexec -n 1``, ``-n 2`` and ``-n 3``.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import collectives as coll


def _closed_communicator():
    c = coll.init(comm=MPI.COMM_WORLD.Dup())
    c.close()  # collective: every rank closes its own
    return c


# ---- item 10: a closed communicator raises BackendUnavailableError everywhere, never AttributeError ----

CLOSED_CALLS = {
    "allreduce": lambda c: c.allreduce(np.ones(3)),
    "broadcast": lambda c: c.broadcast(np.ones(3)),
    "reduce": lambda c: c.reduce(np.ones(3)),
    "allgather": lambda c: c.allgather(np.ones(3)),
    "barrier": lambda c: c.barrier(),
    "synchronize": lambda c: c.synchronize({"w": np.ones(3)}),
    "allreduce_tree": lambda c: c.allreduce_tree({"w": np.ones(3)}),
    "coll.synchronize": lambda c: coll.synchronize({"w": np.ones(3)}, comm=c),
    "coll.allreduce_tree": lambda c: coll.allreduce_tree([np.ones(3)], comm=c),
    "coll.allreduce": lambda c: coll.allreduce(np.ones(3), comm=c),
    "coll.broadcast": lambda c: coll.broadcast(np.ones(3), comm=c),
    "shard": lambda c: coll.shard(list(range(10)), comm=c),
    "DistributedOptimizer": lambda c: coll.DistributedOptimizer(_Sgd(), comm=c),
    "rank": lambda c: c.rank,
    "size": lambda c: c.size,
    "local_rank": lambda c: c.local_rank,
    "local_size": lambda c: c.local_size,
    "backend": lambda c: c.backend,
}


class _Sgd:
    @staticmethod
    def init(params):
        return ()

    @staticmethod
    def update(grads, state, params=None):
        return grads, state


@pytest.mark.parametrize("call", sorted(CLOSED_CALLS))
def test_a_closed_communicator_raises_backend_unavailable(comm, call):
    c = _closed_communicator()
    assert c.closed and "closed" in repr(c)
    with pytest.raises(coll.BackendUnavailableError, match="clos|finaliz"):
        CLOSED_CALLS[call](c)
    c.close()  # still idempotent


def test_a_warm_hot_path_on_a_closed_communicator_raises(comm):
    c = coll.init(comm=MPI.COMM_WORLD.Dup())
    x = np.ones(3)
    for _ in range(3):  # warm: the cached direct calls are filled
        c.allreduce(x)
        c.broadcast(x)
    c.close()
    for call in (c.allreduce, c.broadcast, lambda y: coll.allreduce(y, comm=c),
                 lambda y: coll.broadcast(y, comm=c)):
        with pytest.raises(coll.BackendUnavailableError):
            call(x)


# ---- item 8: communicators are looked up by the MPI communicator, not by the Python wrapper ----

def test_a_new_wrapper_of_the_same_communicator_finds_the_same_communicator(comm):
    base = MPI.COMM_WORLD.Dup()
    try:
        first = coll.init(comm=base)
        again = coll.init(comm=MPI.Intracomm(base))  # another Python object for the same MPI communicator
        assert again is first
        x = np.ones(2)
        for _ in range(2500):  # frameworks hand a fresh wrapper every call; MPICH ran out at ~2000 dups
            coll.allreduce(x, comm=MPI.Intracomm(base))
            x[:] = 1
        assert coll.init(comm=MPI.Intracomm(base)) is first and not first.closed
    finally:
        base.Free()


def test_freeing_the_users_communicator_releases_ours(comm):
    base = MPI.COMM_WORLD.Dup()
    ours = coll.init(comm=base)
    base.Free()  # collective, as MPI requires
    assert ours.closed  # its MPI duplicate and shared memory were released with it
    with pytest.raises(coll.BackendUnavailableError):
        ours.allreduce(np.ones(2))
    # MPI reuses the freed handle for the next communicator: that must not find the released one
    other = MPI.COMM_WORLD.Dup()
    try:
        fresh = coll.init(comm=other)
        assert fresh is not ours and not fresh.closed
        x = np.ones(2)
        fresh.allreduce(x)
        assert (x == comm.size).all()
    finally:
        other.Free()
    assert fresh.closed


def test_a_closed_communicator_is_not_returned_for_its_mpi_communicator(comm):
    base = MPI.COMM_WORLD.Dup()
    try:
        ours = coll.init(comm=base)
        ours.close()
        again = coll.init(comm=base)
        assert again is not ours and not again.closed
    finally:
        base.Free()


# ---- item 2: a malformed setting on one rank is refused on every rank, naming variable and value ----

MALFORMED = [
    ("COLLECTIVES_TIMEOUT", "abc"),
    ("COLLECTIVES_MAX_COUNT", "lots"),
    ("COLLECTIVES_MAX_COUNT", "-4"),
    ("COLLECTIVES_SHM", "maybe"),
    ("COLLECTIVES_SHM_THRESHOLD", "1.5"),
    ("COLLECTIVES_SHM_SLOT_BYTES", "0"),
    ("COLLECTIVES_SIMULATE_NODES", "two"),
    ("COLLECTIVES_SYNC_PIPELINE", "2"),
    ("COLLECTIVES_BUCKET_BYTES", "25MB"),
    ("COLLECTIVES_CHECK", "please"),
    ("COLLECTIVES_ABORT_ON_ERROR", "never"),
    ("COLLECTIVES_DISABLE_NCCL", "nope"),
    ("COLLECTIVES_CUDA_AWARE_MPI", "perhaps"),
    ("COLLECTIVES_NCCL_EAGER", "soon"),
    ("COLLECTIVES_MPI_THREAD_LEVEL", "many"),
]


@pytest.mark.parametrize(("name", "value"), MALFORMED)
def test_a_malformed_setting_on_one_rank_is_refused_on_every_rank(comm, monkeypatch, name, value):
    if comm.rank == comm.size - 1:
        monkeypatch.setenv(name, value)
    base = MPI.COMM_WORLD.Dup()
    try:
        with pytest.raises(ValueError) as info:
            coll.init(comm=base)  # would hang at 2+ ranks if only the last rank raised
        text = str(info.value)
        assert name in text and repr(value) in text and f"rank {comm.size - 1}" in text, text
    finally:
        base.Free()
    monkeypatch.delenv(name, raising=False)
    again = coll.init(comm=MPI.COMM_WORLD.Dup())  # nothing was left behind: init works again
    x = np.ones(1)
    again.allreduce(x)
    assert x[0] == comm.size
    again.close()

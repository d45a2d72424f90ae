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

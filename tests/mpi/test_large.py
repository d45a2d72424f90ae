"""Counts past 2**31 - 1 elements (the int count of classic MPI calls), with real buffers (~2 GiB)."""

import os

import numpy as np
import pytest

import collectives as coll

N = 2**31 + 5
pytestmark = pytest.mark.skipif(os.environ.get("COLLECTIVES_TEST_SKIP_LARGE") == "1",
                                reason="COLLECTIVES_TEST_SKIP_LARGE=1")


@pytest.mark.timeout(1200)
def test_broadcast_and_allreduce_past_int_max(comm):
    x = np.zeros(N, dtype=np.uint8)
    root = comm.size - 1
    if comm.rank == root:
        x[0], x[2**31 - 1], x[2**31], x[-1] = 1, 2, 3, 4
    coll.broadcast(x, root=root, comm=comm)
    assert (x[0], x[2**31 - 1], x[2**31], x[-1]) == (1, 2, 3, 4)
    assert int(x[1:2**31 - 1].max(initial=0)) == 0
    x[-1] = comm.rank + 10
    x[2**31] = 100 - comm.rank
    coll.allreduce(x, op="max", comm=comm)
    assert x[-1] == comm.size + 9 and x[2**31] == 100 and x[0] == 1
    del x

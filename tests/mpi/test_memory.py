"""Repeated collectives do not grow the process: every cache the library keeps is bounded.

Each case makes up to 10,000 calls after a warm-up and compares the resident set size (``/proc/self/statm``)
before and after, allowing 2 MiB of slack. A time budget per case keeps the file under ~30 s even where
ranks share cores (3 ranks on 2 cores: MPICH's blocking calls spin, and take milliseconds each): when the
budget is spent, rank 0 says stop (an allreduce every block of calls, so every rank stops after the same
call) and the case checks the calls it made, at least ``MIN_CALLS``. The ``deadline-`` cases run on a
communicator made with ``COLLECTIVES_TIMEOUT`` set (the polled, non-blocking path).

Why an allreduce (issue 13): with a broadcast from rank 0 between blocks, nothing kept the other ranks
from running ahead of a rooted collective's root, and the MPI's own pools grew with the backlog at the
root. Open MPI 5.0, 3 ranks on 2 cores, 10,000 ``reduce`` calls in that pattern: the root grew 0.9-4 MiB,
and raw mpi4py ``comm.Reduce`` in the same pattern, same job, grew the same 1.3-4 MiB, then nothing over
the next 30,000 calls; whichever of the two ran second grew 0 KiB. So that growth was Open MPI's (free
lists at a high-water mark), not ours (``benchmarks/memory_rooted.py`` measures it). With the
synchronising allreduce, ours grows 0 KiB on ``reduce`` and at most 0.3 MiB on ``broadcast`` there.
"""

import gc
import os
import time

import numpy as np
import pytest

import collectives as coll
from support.comms import deadline_communicator

CALLS = 10_000
MIN_CALLS = 100
WARMUP = 30
BLOCK = 50
BUDGET_S = 1.5
SLACK = 2 * 2**20

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cases(comm):
    x = np.ones(64, dtype=np.float32)
    base = np.ones(128)
    strided = base[::2]
    small = np.arange(8, dtype=np.int64)
    out = {
        "allreduce": lambda: comm.allreduce(x),
        "allreduce-strided-mean": lambda: comm.allreduce(strided, op="mean"),
        "reduce": lambda: comm.reduce(small, op="max", root=comm.size - 1),
        "broadcast": lambda: comm.broadcast(x, root=0),
        "allgather": lambda: comm.allgather(small),
        "barrier": comm.barrier,
    }
    try:
        import torch

        t = torch.ones(16, dtype=torch.bfloat16)
        out["allreduce-torch-bfloat16"] = lambda: comm.allreduce(t, op="max")
    except ImportError:
        pass
    if hasattr(coll, "allreduce_tree"):
        tree = {"w": np.ones(4), "b": [np.zeros(2, dtype=np.float32)]}
        out["allreduce_tree"] = lambda: coll.allreduce_tree(tree, op="sum", comm=comm)
        frozen = np.arange(6.0)
        frozen.flags.writeable = False  # received into a new buffer (new MPI datatypes) on every call
        synced = {"w": np.ones(300), "b": np.zeros(3, dtype=np.float32), "frozen": frozen}
        out["synchronize"] = lambda: coll.synchronize(synced, comm=comm)
    return out


NAMES = ["allreduce", "allreduce-strided-mean", "reduce", "broadcast", "allgather", "barrier",
         "allreduce-torch-bfloat16", "allreduce_tree", "synchronize", "checked-allreduce", "deadline-allreduce",
         "deadline-allgather", "deadline-checked-broadcast"]


@pytest.fixture(scope="module")
def deadline_comm(comm):
    """A second communicator whose transport has a deadline (``COLLECTIVES_TIMEOUT`` set at its init)."""
    if comm.backend != "mpi":
        pytest.skip("the deadline is a property of the MPI transport")
    with deadline_communicator() as c:
        yield c


@pytest.fixture
def young_collections():
    """``gc.collect()`` scanning only the objects made since the case began: ``gc.freeze()`` moves every
    object that exists to a permanent generation, which collections skip (with torch and JAX imported, a
    full collection takes 0.3 s or more; a case makes two), and ``gc.unfreeze()`` gives them back after it.
    The garbage of the calls under test is made after the freeze, so the collections still see all of it."""
    gc.freeze()
    yield
    gc.unfreeze()


def calls_within_budget(comm, call) -> int:
    flag = np.zeros(1, dtype=np.uint8)
    done, start = 0, time.monotonic()
    while done < CALLS:
        for _ in range(BLOCK):
            call()
        done += BLOCK
        flag[0] = comm.rank == 0 and done >= MIN_CALLS and time.monotonic() - start > BUDGET_S
        # rank 0's clock decides for everybody; an allreduce, not a broadcast, so that no rank gets more
        # than a block ahead (a rooted collective's messages would pile up at a slower root)
        comm.allreduce(flag, op="max")
        if flag[0]:
            break
    return done


@pytest.mark.parametrize("name", NAMES)
def test_repeated_calls_do_not_grow_memory(request, comm, name, young_collections):
    if name.startswith("deadline-"):
        comm = request.getfixturevalue("deadline_comm")
        name = name.removeprefix("deadline-")
    checked = name.startswith("checked-")
    table = cases(comm)
    key = name.removeprefix("checked-")
    if key not in table:
        pytest.skip(f"{key} is not available here")
    call = table[key]
    saved = comm.check
    comm.check = checked
    try:
        for _ in range(WARMUP):
            call()
        gc.collect()
        before = rss()
        done = calls_within_budget(comm, call)
        gc.collect()
        grown = rss() - before
    finally:
        comm.check = saved
    everyone = comm.allgather(np.array([grown, done], dtype=np.int64))
    print(f"\n[memory] {name}: {done} calls, RSS growth per rank (KiB): {(everyone[:, 0] // 1024).tolist()}")
    assert (everyone[:, 1] == done).all()
    assert (everyone[:, 0] < SLACK).all(), (
        f"{name}: resident memory grew by {(everyone[:, 0] / 2**20).round(2).tolist()} MiB on the ranks "
        f"over {done} calls (allowed {SLACK / 2**20:g} MiB)")


@pytest.mark.parametrize("collective", ["synchronize", "allreduce_tree"])
def test_tree_collectives_hold_at_most_one_bucket_of_extra_memory(comm, collective):
    """Issue 7's memory bound: whatever the tree's size, a fused collective adds at most one bucket
    (bucket_bytes) of buffers per (device, dtype), counting the buffers it keeps for the next call. On a
    new communicator (nothing pooled yet), with tracemalloc, which sees NumPy's data allocations: the peak
    during two calls, and what is still held after them."""
    import tracemalloc

    if comm.backend != "mpi":
        pytest.skip("needs the MPI transport")
    from mpi4py import MPI

    mine = MPI.COMM_WORLD.Dup()
    fresh = coll.init(comm=mine)
    bucket = 1 << 20  # leaves of a quarter of it or more are reduced in place: these are packed
    tree = {f"w{i:02d}": np.full(24 << 10, float(comm.rank)) for i in range(24)}  # 24 x 192 KiB = 4.5 MiB
    run = {"synchronize": lambda: coll.synchronize(tree, comm=fresh, bucket_bytes=bucket),
           "allreduce_tree": lambda: coll.allreduce_tree(tree, op="max", comm=fresh, bucket_bytes=bucket)}
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        run[collective]()
        run[collective]()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        fresh.close()
        mine.Free()
    slack = 128 << 10  # plans, datatypes' Python objects, the agreement's messages: not data buffers
    assert peak - before <= bucket + slack, f"{collective}: peak {peak - before} bytes over its inputs"
    assert held - before <= bucket + slack, f"{collective}: keeps {held - before} bytes for the next call"
    assert all((v == (0.0 if collective == "synchronize" else comm.size - 1)).all() for v in tree.values())

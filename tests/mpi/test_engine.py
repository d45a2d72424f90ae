"""What every front end inherits from the one call path (issue 21): ranks that disagree never return data.

- ranks calling *different* collectives, or the same collective with a different count, dtype, op or root,
  raise on every rank on the non-blocking paths (asynchronous handles, the deadline transport, the torch
  backend, the gradient buckets), and the communicator stays failed afterwards;
- an object some receiver cannot unpickle is one TypeError on every rank, the root included;
- a cache entry of one collective is never found by another (``reduce_scatter(op="alltoall")``);
- DistributedOptimizer's gradient buckets agree on their layout (models that differ are a MismatchError);
- the torch backend's ``Work.wait`` bounds every operation by the group's timeout, and a timed-out group
  stays failed: later operations raise, and the timed-out tensor is not written afterwards.

Each scenario runs on a communicator of its own (a failed communicator cannot be used again).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

import collectives as coll
from support.comms import communicator, gather_objects

pytestmark = pytest.mark.skipif(coll.world().size < 2 or coll.world().backend != "mpi",
                                reason="needs two or more MPI ranks")


@contextlib.contextmanager
def fresh(mode: str):
    """A communicator for one scenario: ``"deadline"`` (COLLECTIVES_TIMEOUT) or ``"async"`` (plain)."""
    with communicator(**({"COLLECTIVES_TIMEOUT": 60} if mode == "deadline" else {})) as c:
        yield c


def call(c, name: str, x, mode: str, **kw):
    """``c.<name>(x, ...)``, blocking on the deadline transport or asynchronous (then waited)."""
    fn = getattr(c, name)
    args = () if name == "barrier" else (x,)
    if mode == "deadline":
        return fn(*args, **kw)
    return fn(*args, async_op=True, **kw).wait()


def raises_everywhere(c, run) -> str:
    """Run ``run()``; it must raise MismatchError (or time out) on this rank; the communicator must then
    refuse every later call at once. Returns the error text."""
    with pytest.raises((coll.MismatchError, coll.CollectiveTimeoutError)) as info:
        run()
    with pytest.raises(coll.CollectiveError, match="unusable"):
        c.allreduce(np.ones(2), "sum")
    return str(info.value)


@pytest.mark.parametrize("mode", ["deadline", "async"])
@pytest.mark.parametrize("other", ["barrier", "allgather", "gather", "broadcast", "reduce_scatter"])
def test_a_rank_calling_another_collective_never_returns_data(comm, mode, other):
    if mode == "async" and other == "barrier":
        pytest.skip("barrier has no async_op (a blocking barrier against an asynchronous call hangs, by design)")
    with fresh(mode) as c:
        x = np.full(2 * c.size, float(c.rank + 1))

        def run():
            if c.rank == 1:
                return call(c, other, x, mode)
            return call(c, "allreduce", x, mode, op="sum")

        text = raises_everywhere(c, run)
        assert "different collectives" in text and "allreduce" in text and other in text


@pytest.mark.parametrize("mode", ["deadline", "async"])
@pytest.mark.parametrize("what", ["count", "dtype", "op", "root", "gather root"])
def test_the_same_collective_with_other_arguments_never_returns_data(comm, mode, what):
    with fresh(mode) as c:
        odd = c.rank == c.size - 1
        x = np.full(8 if (odd and what == "count") else 4, float(c.rank + 1),
                    dtype=np.float32 if (odd and what == "dtype") else np.float64)

        def run():
            if what == "root":
                return call(c, "broadcast", x, mode, root=1 if odd else 0)
            if what == "gather root":
                return call(c, "gather", x, mode, root=1 if odd else 0)
            return call(c, "allreduce", x, mode, op="max" if (odd and what == "op") else "sum")

        text = raises_everywhere(c, run)
        assert "disagree" in text


def test_gradient_buckets_of_different_models_are_a_mismatch(comm):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4) if comm.rank == 0 else torch.nn.Linear(7, 2)  # 16 and 16 elements
    with pytest.raises(coll.MismatchError, match="DistributedOptimizer"):
        coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model = torch.nn.Linear(3, 4)  # the same model: fine afterwards
    opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(2, 3)).sum().backward()
    opt.step()


class OnlyOnRankZero:
    """Pickles everywhere; unpickles only where ``ok`` is set (rank 0's process)."""

    ok = False

    def __reduce__(self):
        return (_rebuild, ())


def _rebuild():
    if not OnlyOnRankZero.ok:
        raise AttributeError("OnlyOnRankZero cannot be rebuilt here")
    return OnlyOnRankZero()


def test_an_object_a_receiver_cannot_unpickle_is_an_error_on_every_rank(comm):
    OnlyOnRankZero.ok = comm.rank == 0
    try:
        with pytest.raises(TypeError, match="cannot be unpickled on rank 1"):
            comm.broadcast_object(OnlyOnRankZero(), root=0)
        with pytest.raises(TypeError, match="cannot be unpickled on rank 1"):
            comm.allgather_object(OnlyOnRankZero() if comm.rank == 0 else None)
    finally:
        OnlyOnRankZero.ok = False
    assert comm.broadcast_object({"still": "usable"}, root=0) == {"still": "usable"}


def test_no_cache_entry_of_one_collective_serves_another(comm):
    x = np.arange(comm.size * 2, dtype=np.float64)
    comm.alltoall(x)
    comm.alltoall(x)  # cached
    with pytest.raises(ValueError, match="op"):
        comm.reduce_scatter(x, op="alltoall")
    assert comm.reduce_scatter(x, op="sum").tolist() == (comm.size * x[2 * comm.rank:2 * comm.rank + 2]).tolist()


def test_torch_different_collectives_raise_on_every_rank(comm):
    pytest.importorskip("torch")
    import torch
    import torch.distributed as dist

    import collectives.torch_backend as ctb

    with communicator() as c:
        pg = ctb.ProcessGroupCollectives(c)
        t = torch.full((4,), float(comm.rank + 1))
        with pytest.raises(coll.MismatchError):
            if comm.rank == 1:
                pg.allgather([[torch.empty(4) for _ in range(comm.size)]], [t]).wait()
            else:
                pg.allreduce([t], dist.AllreduceOptions()).wait()
        with pytest.raises(coll.CollectiveError, match="unusable"):
            pg.allreduce([torch.ones(1)]).wait()


def test_torch_coalesced_is_bounded_and_a_timed_out_group_stays_failed(comm):
    pytest.importorskip("torch")
    import torch
    from datetime import timedelta

    import collectives.torch_backend as ctb

    with communicator() as c:
        pg = ctb.ProcessGroupCollectives(c, timeout=timedelta(seconds=0.5))
        a, b = torch.ones(3), torch.ones(2, dtype=torch.float64)
        if comm.rank == 0:  # alone: the others join only after rank 0 gave up
            t0 = time.monotonic()
            with pytest.raises(coll.CollectiveTimeoutError):
                pg.allreduce_coalesced([a, b]).wait()
            assert time.monotonic() - t0 < 5
            gather_objects(None)
            with pytest.raises(coll.CollectiveError, match="unusable"):  # the group stays failed
                pg.allreduce([torch.ones(1)]).wait()
            gather_objects(None)
            assert a.tolist() == [1.0] * 3 and b.tolist() == [1.0] * 2  # not written after the error
        else:
            gather_objects(None)
            work = pg.allreduce_coalesced([a, b])  # matches rank 0's abandoned one; never completes there
            gather_objects(None)
            with contextlib.suppress(coll.CollectiveError):
                work.wait(timedelta(seconds=0.2))
        gather_objects(None)

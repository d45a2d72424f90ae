"""Refusals agreed through ``_agree`` (issue 33), at any world size, through public names: the last rank is
the odd one; every rank raises the same typed error, whose text names that rank and its value, and the
communicator (or init) works afterwards."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as coll
from support.comms import communicator, gather_objects


def same_everywhere(err: BaseException) -> str:
    """The text of ``err``, asserted to be the same type and text on every rank."""
    seen = gather_objects((type(err).__name__, str(err)))
    assert len(set(seen)) == 1, f"the ranks raised different errors: {seen}"
    return str(err)


def test_a_malformed_setting_on_the_last_rank_is_refused_alike(comm, monkeypatch):
    """_config.problems gathered at init (``_agree.refuse_together``): every rank raises one ValueError."""
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend (init on a communicator of its own)")
    from mpi4py import MPI

    last = comm.size - 1
    if comm.rank == last:
        monkeypatch.setenv("COLLECTIVES_MAX_COUNT", "lots")
    base = MPI.COMM_WORLD.Dup()
    try:
        with pytest.raises(ValueError) as info:
            coll.init(comm=base)
    finally:
        base.Free()
    text = same_everywhere(info.value)
    assert f"(rank {last}: COLLECTIVES_MAX_COUNT" in text and "'lots'" in text, text
    assert "rank 0:" not in text or last == 0, text
    monkeypatch.delenv("COLLECTIVES_MAX_COUNT", raising=False)
    again = coll.init(comm=MPI.COMM_WORLD.Dup())
    x = np.ones(1)
    again.allreduce(x)
    assert x[0] == comm.size
    again.close()


def test_a_nan_on_the_last_rank_is_refused_alike(comm):
    """The NaN check (``_agree.gather_rows`` of each rank's first non-finite element, ``_agree.refuse``):
    every rank raises one NonFiniteError naming the last rank, the element and its value."""
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend (communicators made with the setting)")
    with communicator(COLLECTIVES_CHECK_NAN=1) as c:
        x = np.arange(6, dtype=np.float64) + c.rank
        if c.rank == c.size - 1:
            x[4] = np.nan
        with pytest.raises(coll.NonFiniteError) as info:
            c.allreduce(x)
        text = same_everywhere(info.value)
        assert sorted(info.value.found) == [c.size - 1] and info.value.found[c.size - 1][1:] == (4, "nan"), text
        assert f"rank {c.size - 1}" in text, text
        y = np.ones(2)
        c.allreduce(y)  # usable
        assert (y == c.size).all()


def test_a_gradient_missing_on_the_last_rank_is_refused_alike(comm):
    """DistributedOptimizer (``_agree.gather`` of who lacks which gradient, ``_agree.holding``): every rank
    raises one MismatchError, ``ranks 0,... have float32 (3,), rank N has None``; at one rank nothing is
    missing on some ranks only, and the step runs."""
    torch = pytest.importorskip("torch")
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = coll.DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0), comm=comm)
    last = comm.size - 1
    (a.sum() + (b.sum() if comm.rank != last or comm.size == 1 else 0)).backward()
    if comm.size == 1:
        opt.step()
        assert b.detach().tolist() == [-1.0] * 3
        return
    with pytest.raises(coll.MismatchError) as info:
        opt.step()
    text = same_everywhere(info.value)
    others = "rank 0 has" if last == 1 else "ranks " + ",".join(map(str, range(last))) + " have"
    assert f"[1]: {others} float32 (3,), rank {last} has None" in text, text
    assert b.detach().tolist() == [0.0] * 3, "nothing was updated"

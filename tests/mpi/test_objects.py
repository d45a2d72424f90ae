"""broadcast_object and allgather_object at any world size, on the plain and the deadline transport."""

import numpy as np
import pytest

import collectives as coll
from support.comms import communicator


class Local:
    """Picklable: defined at module level."""

    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Local) and other.v == self.v

    __hash__ = None  # mutable, compared by value


def unpicklable():
    return lambda: None  # a lambda cannot be pickled




def test_broadcast_object_every_root(c):
    for root in range(c.size):
        obj = {"rank": c.rank, "arr": np.arange(c.rank + 2), "local": Local(c.rank), "big": "x" * (c.rank * 1000)}
        got = coll.broadcast_object(obj, root=root, comm=c)
        if c.rank == root:
            assert got is obj
        else:
            assert got["rank"] == root and got["arr"].tolist() == list(range(root + 2))
            assert got["local"] == Local(root) and got["big"] == "x" * (root * 1000)


def test_broadcast_object_none_and_empty(c):
    assert c.broadcast_object(None if c.rank == 0 else 5) is None
    assert c.broadcast_object(b"" if c.rank == 0 else b"x") == b""


def test_unpicklable_on_root_raises_on_every_rank(c):
    for root in range(c.size):
        obj = unpicklable() if c.rank == root else 1  # the others' objects do not matter
        with pytest.raises(TypeError, match=r"broadcast_object: root's obj of type .*function cannot be pickled"):
            c.broadcast_object(obj, root)
        assert c.broadcast_object(c.rank, root) == root  # still in step


def test_bad_root(c):
    with pytest.raises(ValueError, match="out of range"):
        c.broadcast_object(1, root=c.size)
    with pytest.raises(TypeError, match="root must be an integer"):
        c.broadcast_object(1, root="0")
    assert c.broadcast_object("ok", 0) == "ok"


def test_allgather_object(c):
    got = coll.allgather_object({"r": c.rank, "pad": [0] * c.rank}, comm=c)
    assert got == [{"r": r, "pad": [0] * r} for r in range(c.size)]
    mine = Local(c.rank)
    assert c.allgather_object(mine)[c.rank] is mine


def test_allgather_object_unpicklable_on_one_rank_raises_everywhere(c):
    bad = c.size - 1
    obj = unpicklable() if c.rank == bad else c.rank
    with pytest.raises(TypeError, match=f"allgather_object: rank {bad}'s obj .* cannot be pickled"):
        c.allgather_object(obj)
    assert c.allgather_object(c.rank) == list(range(c.size))


def test_checked_mode_mismatch_and_refusal(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    with communicator() as c:
        c.check = True
        with pytest.raises(coll.MismatchError, match="broadcast_object|allgather_object"):
            if c.rank == 0:
                c.broadcast_object(1)
            else:
                c.allgather_object(1)
        with pytest.raises(coll.MismatchError, match="root"):
            c.broadcast_object(1, root=c.rank)  # different roots
        if c.rank == 0:
            with pytest.raises(ValueError, match="out of range"):
                c.broadcast_object(1, root=c.size)
        else:
            with pytest.raises(coll.MismatchError, match="refused"):
                c.broadcast_object(1, root=0)
        assert c.broadcast_object(c.rank) == 0

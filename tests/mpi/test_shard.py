"""shard() at any world size: equal lengths everywhere, coverage, padding, drop_remainder, libraries."""

import numpy as np
import pytest

import collectives as coll
from support.comms import gather_objects


def gather(comm, obj):
    return gather_objects(obj)


def check_partition(comm, n, part_items, drop_remainder):
    """Every rank got the same number of items; together they cover what they must."""
    parts = gather(comm, list(part_items))
    lengths = {len(p) for p in parts}
    assert len(lengths) == 1, f"unequal shard lengths {parts}"
    per = lengths.pop()
    union = [i for p in parts for i in p]
    if drop_remainder:
        assert per == n // comm.size
        assert union == list(range(per * comm.size)), "contiguous blocks, in rank order, tail dropped"
    else:
        assert per == -(-n // comm.size)
        assert set(union) == set(range(n)), "every item is used"
        assert union[:n] == list(range(n)) and all(i < n for i in union)
    return parts


@pytest.mark.parametrize("n", [1, 2, 3, 4, 9, 10, 11, 97])
@pytest.mark.parametrize("drop_remainder", [False, True])
def test_shard_list_every_length(comm, n, drop_remainder):
    data = list(range(n))
    if drop_remainder and n < comm.size:
        with pytest.raises(ValueError, match=f"cannot shard {n} items over {comm.size} ranks"):
            coll.shard(data, drop_remainder=True, comm=comm)
        return
    part = coll.shard(data, drop_remainder=drop_remainder, comm=comm)
    assert type(part) is list
    check_partition(comm, n, part, drop_remainder)


def test_shard_ten_items(comm):
    """Lux's container gives 3,3,3,1 on 4 ranks and fails for 9; every rank gets the same here."""
    part = coll.shard(list(range(10)), comm=comm)
    per = -(-10 // comm.size)
    assert len(part) == per
    assert part == [(comm.rank * per + i) % 10 for i in range(per)]


@pytest.mark.parametrize("lib", ["numpy", "torch", "strict"])
@pytest.mark.parametrize("n", [9, 10])
def test_shard_arrays(comm, lib, n):
    full = np.arange(n * 2, dtype=np.float64).reshape(n, 2)
    if lib == "numpy":
        data = full
    elif lib == "torch":
        import torch

        data = torch.from_numpy(full)
    else:
        import array_api_strict as xs

        data = xs.asarray(full)
    part = coll.shard(data, comm=comm)
    assert type(part) is type(data)
    rows = np.asarray(np.from_dlpack(part) if lib == "strict" else part)
    assert rows.shape[1:] == (2,)
    parts = check_partition(comm, n, (rows[:, 0] // 2).astype(int).tolist(), False)
    assert len(parts[comm.rank]) == -(-n // comm.size)
    dropped = coll.shard(data, drop_remainder=True, comm=comm)
    assert len(np.asarray(np.from_dlpack(dropped) if lib == "strict" else dropped)) == n // comm.size


def test_shard_array_is_a_view_when_it_does_not_wrap(comm):
    x = np.arange(12 * comm.size)
    part = coll.shard(x, comm=comm)
    assert np.shares_memory(part, x)
    part[:] = -1
    assert (x[comm.rank * 12:(comm.rank + 1) * 12] == -1).all()


def test_shard_sequences(comm):
    import torch

    n = 7
    rng = coll.shard(range(n), comm=comm)
    check_partition(comm, n, list(rng), False)
    tup = coll.shard(tuple("abcdefg"), comm=comm)
    assert type(tup) is tuple and len(tup) == -(-n // comm.size)
    ds = torch.utils.data.TensorDataset(torch.arange(n), torch.arange(n) * 10)
    view = coll.shard(ds, comm=comm)
    assert len(view) == -(-n // comm.size)
    check_partition(comm, n, [int(a) for a, _ in view], False)
    assert view.indices == [int(a) for a, _ in view]
    loader = torch.utils.data.DataLoader(view, batch_size=2)
    assert sum(len(a) for a, _ in loader) == len(view)
    assert view[-1] == view[len(view) - 1] and view[0:2] == [view[0], view[1]]
    with pytest.raises(IndexError):
        view[len(view)]


def test_shard_fewer_items_than_ranks(comm):
    part = coll.shard(["only"], comm=comm)
    assert part == ["only"]
    if comm.size > 1:
        with pytest.raises(ValueError, match="drop_remainder=True"):
            coll.shard(["only"], drop_remainder=True, comm=comm)


def test_shard_errors(comm):
    with pytest.raises(ValueError, match="empty"):
        coll.shard([], comm=comm)
    with pytest.raises(ValueError, match="empty"):
        coll.shard(np.zeros((0, 3)), comm=comm)
    with pytest.raises(TypeError, match="0-d"):
        coll.shard(np.ones(()), comm=comm)
    with pytest.raises(TypeError, match="mapping"):
        coll.shard({"a": 1}, comm=comm)
    with pytest.raises(TypeError, match="cannot shard a int"):
        coll.shard(5, comm=comm)


def test_shard_checked_mode_compares_lengths(comm, monkeypatch):
    monkeypatch.setattr(comm, "check", True)
    assert len(coll.shard(list(range(6)), comm=comm)) == -(-6 // comm.size)
    if comm.size > 1:
        with pytest.raises(coll.MismatchError, match=r"ranks disagree about shard \(checked mode\): length: ranks? 0[,0-9]* ha(?:s|ve) 6, ranks? [0-9,]*1[0-9,]* ha(?:s|ve) 7"):
            coll.shard(list(range(6 if comm.rank == 0 else 7)), comm=comm)

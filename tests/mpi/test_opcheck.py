"""The MPI's reduction ops are checked, not trusted (issue 13): a pair it gets wrong is routed right.

Open MPI 5.0's AVX op component saturates int8/uint8/int16/uint16 sums past a vector width. To test the
guard on any MPI (MPICH included), a communicator is made whose MPI ``sum`` is a user-defined op that
saturates the same way: its probe must catch the fault, and every collective must still give NumPy's
wrapped sums, on every path (the direct call, the general path, reduce, buckets of a tree, the
shared-memory allreduce with simulated nodes whose leaders reduce over MPI, and the deadline transport).
Without the routing these results would saturate, so the tests fail on a broken guard whatever the MPI.

    timeout 300 mpiexec -n 3 python tests/mpi_pytest.py tests/mpi/test_opcheck.py -q -x
"""

import contextlib
import os
import warnings

import numpy as np
import pytest

import collectives as coll

MPI = pytest.importorskip("mpi4py.MPI")
# Private on purpose: the op table and the probe are what an MPI's fault is injected into; no public
# name can make MPICH's MPI_SUM saturate.
from collectives._backends import mpi as mpi_backend  # noqa: E402 - after the importorskip above
from collectives._backends.mpi import library as mpi_library  # noqa: E402 - where the transport reads its tables

SMALL = ["int8", "uint8", "int16", "uint16"]


def _saturating_sum(inbuf, inoutbuf, datatype):
    """MPI_SUM as Open MPI's AVX component computes it for 8- and 16-bit integers: saturating."""
    dtype = np.dtype(datatype.tocode())
    a, b = np.frombuffer(inbuf, dtype), np.frombuffer(inoutbuf, dtype)
    if dtype.kind in "iu" and dtype.itemsize <= 2:
        info = np.iinfo(dtype)
        b[...] = np.clip(a.astype(np.int64) + b, info.min, info.max)
    else:
        b += a


SATURATING = MPI.Op.Create(_saturating_sum, commute=True)


@contextlib.contextmanager
def faulty_communicator(**env):
    """A communicator of every rank whose MPI ``sum`` saturates, made with ``env`` set (collective)."""
    real = mpi_library._tables

    def tables(MPI):
        ops, types = real(MPI)
        return {**ops, "sum": SATURATING}, types

    user = MPI.COMM_WORLD.Dup()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    mpi_library._tables = tables
    warned, mpi_library._warned = mpi_library._warned, set()  # so this communicator warns afresh
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = coll.init(comm=user)
    finally:
        mpi_library._tables, mpi_library._warned = real, warned
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield c, [str(w.message) for w in caught]
    finally:
        c.close()
        user.Free()


def near_max(dtype: str, count: int, rank: int) -> np.ndarray:
    """Values whose sum over two or more ranks overflows ``dtype``, different on every rank."""
    info = np.iinfo(dtype)
    k = np.arange(count, dtype=np.int64)
    return (info.max - 3 - (k + rank) % 5).astype(dtype)


def wrapped_sum(dtype: str, count: int, size: int) -> np.ndarray:
    total = sum(near_max(dtype, count, r).astype(np.int64) for r in range(size))
    return np.asarray(total).astype(dtype)  # NumPy's wrapping: the sum modulo 2**bits


def test_the_probe_catches_a_saturating_sum_and_nothing_else():
    ops, types = mpi_backend._tables(MPI)
    bad = mpi_backend.faulty_ops(MPI, {**ops, "sum": SATURATING}, types)
    assert sorted((d.name, op) for d, op in bad) == sorted((d, "sum") for d in SMALL)


def test_the_fault_is_named_once_with_the_workaround(comm):
    with faulty_communicator() as (c, messages):
        mine = [m for m in messages if m.startswith("collectives: this MPI")]
        if c.rank == 0:
            assert len(mine) == 1, messages
            assert all(f"sum of {d}" in mine[0] for d in SMALL), mine[0]
            assert "64-bit" in mine[0]
        else:
            assert mine == []  # one warning per job, not one per rank


@pytest.mark.parametrize("dtype", SMALL)
@pytest.mark.parametrize("count", [1, 100, 1031])
def test_allreduce_wraps_on_every_host_path(dtype, count):
    with faulty_communicator() as (c, _):
        want = wrapped_sum(dtype, count, c.size)
        for _ in range(2):  # the second call takes the cached direct call, if one was cached
            x = near_max(dtype, count, c.rank)
            assert c.allreduce(x, op="sum") is x
            np.testing.assert_array_equal(x, want)
        strided = np.repeat(near_max(dtype, count, c.rank), 2)[::2]  # not contiguous: the general path
        np.testing.assert_array_equal(c.allreduce(strided, op="sum"), want)
        ro = near_max(dtype, count, c.rank)
        ro.flags.writeable = False
        np.testing.assert_array_equal(c.allreduce(ro, op="sum"), want)
        y = near_max(dtype, count, c.rank)
        c.reduce(y, op="sum", root=c.size - 1)
        if c.rank == c.size - 1:
            np.testing.assert_array_equal(y, want)
        else:
            np.testing.assert_array_equal(y, near_max(dtype, count, c.rank))  # untouched


def test_trees_wrap_in_buckets_and_alone():
    with faulty_communicator() as (c, _):
        tree = {d: near_max(d, 257, c.rank) for d in SMALL}
        tree["big"] = near_max("int8", 5000, c.rank)
        tree["f"] = np.full(3, float(c.rank))
        for bucket_bytes in (1 << 20, 1):  # fused per dtype; then every leaf alone
            out = coll.allreduce_tree({k: v.copy() for k, v in tree.items()}, op="sum", comm=c,
                                      bucket_bytes=bucket_bytes)
            for d in SMALL:
                np.testing.assert_array_equal(out[d], wrapped_sum(d, 257, c.size))
            np.testing.assert_array_equal(out["big"], wrapped_sum("int8", 5000, c.size))
            np.testing.assert_array_equal(out["f"], np.full(3, float(sum(range(c.size)))))


def test_torch_tensors_wrap():
    torch = pytest.importorskip("torch")
    with faulty_communicator() as (c, _):
        for dtype in ("int8", "uint8", "int16"):
            t = torch.from_numpy(near_max(dtype, 100, c.rank))
            for _ in range(2):
                t.copy_(torch.from_numpy(near_max(dtype, 100, c.rank)))
                c.allreduce(t, op="sum")
                np.testing.assert_array_equal(t.numpy(), wrapped_sum(dtype, 100, c.size))


@pytest.mark.parametrize("per_node", [1, 2])
def test_shared_memory_and_its_leaders_wrap(per_node):
    """The shared-memory allreduce from the first byte, with simulated nodes of ``per_node`` ranks: at 3
    ranks and 2 per node the node leaders reduce across "nodes" with the (saturating) MPI op."""
    with faulty_communicator(COLLECTIVES_SHM_THRESHOLD=1, COLLECTIVES_SIMULATE_NODES=per_node) as (c, _):
        for dtype in SMALL:
            for count in (100, 70_001):
                x = near_max(dtype, count, c.rank)
                c.allreduce(x, op="sum")
                np.testing.assert_array_equal(x, wrapped_sum(dtype, count, c.size), f"{dtype} x{count}")


def test_the_deadline_transport_wraps():
    with faulty_communicator(COLLECTIVES_TIMEOUT=300) as (c, _):
        assert type(c._host).__name__ == "DeadlineMPITransport"  # private: which transport was made
        for dtype in SMALL:
            x = near_max(dtype, 1031, c.rank)
            c.allreduce(x, op="sum")
            np.testing.assert_array_equal(x, wrapped_sum(dtype, 1031, c.size))
            y = near_max(dtype, 1031, c.rank)
            c.reduce(y, op="sum", root=0)
            if c.rank == 0:
                np.testing.assert_array_equal(y, wrapped_sum(dtype, 1031, c.size))


def test_the_real_mpi_wraps_through_the_default_communicator(comm):
    """Whatever this MPI is (Open MPI with its AVX ops saturates): collectives wraps like NumPy."""
    for dtype in SMALL:
        x = near_max(dtype, 100, comm.rank)
        coll.allreduce(x, op="sum")
        np.testing.assert_array_equal(x, wrapped_sum(dtype, 100, comm.size))

"""reduce_scatter and alltoall at any world size: every library, dtype and op, every host transport.

    timeout 600 mpiexec -n 3 python tests/mpi_pytest.py tests/mpi/test_scatter.py -q -x
"""

import numpy as np
import pytest

import collectives as coll
from support.arrays import DTYPES, LIBS, has, legal, make, rank_values, reduce_reference, to_numpy
from support.comms import communicator, gather_objects

OPS = ["sum", "prod", "min", "max", "mean"]


def cases(with_op=True):
    return [pytest.param(lib, dtype, op, id=f"{lib}-{dtype}" + (f"-{op}" if op else ""))
            for lib in LIBS for dtype in DTYPES if has(lib, dtype) for op in (OPS if with_op else [None])]


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def assert_reduced(got, want, dtype, op):
    """Against the reference (the bits are checked against allreduce's block): exact, except where a
    mean's rounding, or float16/bfloat16 rounding of a product, makes the reference's order matter."""
    if dtype in ("float16", "bfloat16") and op in ("mean", "prod"):
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-2)
    elif op == "mean":
        np.testing.assert_allclose(got, want, rtol=1e-6)
    else:
        np.testing.assert_array_equal(got.astype(want.dtype), want)


@pytest.mark.parametrize("lib,dtype,op", cases())
def test_reduce_scatter_is_allreduce_block(comm, lib, dtype, op):
    shape = (2 * comm.size, 3)
    x = make(lib, rank_values(comm.rank, shape, dtype, op), dtype)
    before = to_numpy(x).copy()
    if not legal(op, dtype):
        with pytest.raises(TypeError, match="op="):
            coll.reduce_scatter(x, op=op, comm=comm)
        assert same_bits(before, to_numpy(x))
        return
    y = coll.reduce_scatter(x, op=op, comm=comm)
    assert type(y) is type(x) and tuple(y.shape) == (2, 3) and y.dtype == x.dtype
    assert same_bits(before, to_numpy(x)), "reduce_scatter must leave x unchanged"
    full = coll.allreduce(make(lib, before, dtype), op=op, comm=comm)
    block = to_numpy(full)[2 * comm.rank:2 * comm.rank + 2]
    assert same_bits(to_numpy(y), block), "reduce_scatter must give allreduce's block, bit for bit"
    again = coll.reduce_scatter(make(lib, before, dtype), op=op, comm=comm)  # the hot path, where it has one
    assert same_bits(to_numpy(again), block), "a second call (the hot path) must give the same bits"
    want = reduce_reference([rank_values(r, shape, dtype, op) for r in range(comm.size)], op, dtype)
    assert_reduced(to_numpy(y), np.asarray(want)[2 * comm.rank:2 * comm.rank + 2], dtype, op)


@pytest.mark.parametrize("lib,dtype,op", cases(with_op=False))
def test_alltoall_every_dtype_bit_for_bit(comm, lib, dtype, op):
    n = comm.size

    def block_values(src, dst):  # what rank src sends rank dst: distinct everywhere
        return rank_values(src * n + dst, (2, 2), dtype)

    mine = np.concatenate([block_values(comm.rank, j) for j in range(n)])
    x = make(lib, mine, dtype)
    before = to_numpy(x).copy()
    y = coll.alltoall(x, comm=comm)
    assert type(y) is type(x) and tuple(y.shape) == (2 * n, 2)
    assert same_bits(before, to_numpy(x)), "alltoall must leave x unchanged"
    want = np.concatenate([block_values(i, comm.rank) for i in range(n)])
    want_lib = to_numpy(make(lib, want, dtype))
    assert same_bits(to_numpy(y), want_lib)
    again = coll.alltoall(x, comm=comm)  # the hot path, where it has one
    assert same_bits(to_numpy(again), want_lib) and same_bits(before, to_numpy(x))


def test_alltoall_not_a_transpose_of_the_whole(comm):
    """Block i of the result is rank i's block for this rank; rows inside a block keep their order."""
    n = comm.size
    x = np.array([[100 * comm.rank + 10 * j + k for k in range(3)] for j in range(n)], dtype=np.int32)
    y = comm.alltoall(x)
    assert y.tolist() == [[100 * i + 10 * comm.rank + k for k in range(3)] for i in range(n)]


def test_reduce_scatter_strided_and_read_only_inputs(comm):
    n = comm.size
    base = np.arange(4 * n * 2, dtype=np.float64).reshape(4 * n, 2) + comm.rank
    view = base[::2]  # strided: (2n, 2)
    ro = np.ascontiguousarray(view)
    ro.flags.writeable = False
    want = coll.allreduce(np.ascontiguousarray(view), op="sum", comm=comm)[2 * comm.rank:2 * comm.rank + 2]
    for x in (view, ro):
        before = np.array(x)
        y = coll.reduce_scatter(x, "sum", comm=comm)
        assert same_bits(y, want) and same_bits(np.array(x), before)
    z = comm.alltoall(view)
    assert z.flags.c_contiguous and z.shape == view.shape


@pytest.mark.parametrize("collective", ["reduce_scatter", "alltoall"])
@pytest.mark.parametrize("shape", [(), (1,), (7,)])
def test_leading_dimension_must_divide(comm, collective, shape):
    n = comm.size
    if shape and shape[0] % n == 0:
        pytest.skip(f"{shape} divides into {n} blocks")
    x = np.ones(shape)
    with pytest.raises(ValueError, match="at least one dimension" if not shape else "divisible"):
        getattr(coll, collective)(x, comm=comm)
    assert (x == 1).all()
    comm.barrier()  # still in step: nothing was sent


def test_empty_blocks(comm):
    x = np.empty((0, 4))
    assert coll.reduce_scatter(x, comm=comm).shape == (0, 4)
    assert coll.alltoall(x, comm=comm).shape == (0, 4)


@pytest.mark.parametrize("dtype,op", [("float32", "max"), ("float64", "min"), ("longdouble", "max"),
                                      ("longdouble", "min"), ("float16", "mean"), ("int8", "sum"),
                                      ("bool", "max"), ("complex64", "mean")])
def test_every_host_transport_gives_the_same_bits(comm, dtype, op):
    """The deadline transport (non-blocking MPI calls), the count limit (blocks in pieces) and the plain
    transport agree with allreduce's block, NaN and signed zeros included."""
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend")
    n = comm.size
    rng = np.random.default_rng(comm.rank)
    if dtype == "bool":
        x = rng.random((3 * n, 5)) < 0.3
    elif np.dtype(dtype).kind in "iu":
        x = rng.integers(-100, 100, (3 * n, 5)).astype(dtype)
    else:
        x = rng.choice([-2.0, -0.0, 0.0, 1.0, np.inf, np.nan], (3 * n, 5)).astype(dtype)
        if np.dtype(dtype).kind == "c":
            x = np.where(np.isfinite(x), x, 1.0) + 1j
    want = comm.allreduce(x.copy(), op)[3 * comm.rank:3 * comm.rank + 3]
    with communicator(COLLECTIVES_TIMEOUT=300) as deadline, communicator(COLLECTIVES_MAX_COUNT=4) as pieces:
        for c in (comm, deadline, pieces):
            got = c.reduce_scatter(x, op)
            assert got.dtype == x.dtype
            if got.dtype.kind == "c":  # compare the parts
                got, want = got.view(got.real.dtype), want.view(want.real.dtype)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            fin = ~np.isnan(want)
            assert (got[fin] == want[fin]).all() and (np.signbit(got[fin]) == np.signbit(want[fin])).all()
            a = c.alltoall(x)
            expect = np.concatenate([gather_objects(x)[i][3 * comm.rank:3 * comm.rank + 3] for i in range(n)])
            assert same_bits(a, expect)


def test_checked_mode_mismatch_between_collectives(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    x = np.ones((comm.size, 2))
    with communicator() as c:
        c.check = True
        with pytest.raises(coll.MismatchError, match="alltoall|reduce_scatter"):
            if comm.rank == 0:
                c.alltoall(x)
            else:
                c.reduce_scatter(x)
        bad = np.ones((comm.size + (1 if comm.rank == 0 else 0), 2))  # only rank 0's does not divide
        if comm.rank == 0:
            with pytest.raises(ValueError, match="divisible"):
                c.reduce_scatter(bad)
        else:
            with pytest.raises(coll.MismatchError, match="refused"):
                c.reduce_scatter(bad)
        assert c.reduce_scatter(x).tolist() == [[comm.size] * 2]  # still usable


def test_alltoall_through_the_device_stand_ins(comm):
    """Host staging and CUDA-aware MPI's alltoall (CPU tensors standing in, as in test_paths.py)."""
    torch = pytest.importorskip("torch")
    from test_paths import device_stand_ins

    n = comm.size
    x = torch.tensor([[100 * comm.rank + 10 * j + k for k in range(2)] for j in range(n)], dtype=torch.int16)
    want = [[100 * i + 10 * comm.rank + k for k in range(2)] for i in range(n)]
    for transport in device_stand_ins(comm):
        before = x.clone()
        y = transport.alltoall(x, None)
        assert y.tolist() == want, transport.name
        assert torch.equal(x, before) and y.dtype == x.dtype

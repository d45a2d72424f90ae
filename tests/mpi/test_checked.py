"""Checked mode (``init(check=True)``) and hostile or odd inputs, at any world size.

Checked mode: a disagreement between ranks raises MismatchError on every rank, naming every side's
values, with every input untouched and the communicator still usable; a rank whose own arguments are
invalid raises its own TypeError/ValueError while the others raise MismatchError naming it (no rank is
left waiting). Hostile inputs are refused with clear errors before any communication (on every rank, so
nothing hangs even unchecked), and NaN/infinity travel through reductions as IEEE 754 says.
"""

import contextlib
import threading

import numpy as np
import pytest

import collectives as coll
from collectives._comm import engine_of  # the device transports' interface to a Communicator
from support.comms import gather_objects
from collectives import BackendUnavailableError, MismatchError


@pytest.fixture
def checked(comm):
    """The default communicator with the agreement check on, for one test."""
    before = comm.check
    comm.check = True
    try:
        yield comm
    finally:
        comm.check = before


def every_rank_raises(comm, call, own=None, match=None):
    """Run ``call`` on every rank; the ranks in ``own`` (a dict rank -> (type, regex)) must raise that,
    the others MismatchError matching ``match``. Returns this rank's exception."""
    own = own or {}
    want, pattern = own.get(comm.rank, (MismatchError, match))
    with pytest.raises(want, match=pattern) as info:
        call()
    return info.value


class FakeDeviceArray:
    """An array-like on a device this build cannot reach (DLPack device type ``kind``)."""

    def __init__(self, kind=2, index=0):
        self.kind, self.index = kind, index
        self.shape, self.dtype = (4,), np.dtype(np.float32)

    def __dlpack_device__(self):
        return (self.kind, self.index)

    def __dlpack__(self, **kwargs):
        raise BufferError("no access to device memory from the host")


# ---------------------------------------------------------------------------------------------------------
# checked mode: disagreements


def test_checked_calls_that_agree_work(checked):
    c = checked
    x = np.arange(6.0).reshape(2, 3) + c.rank
    c.allreduce(x, op="sum")
    np.testing.assert_array_equal(x, c.size * np.arange(6.0).reshape(2, 3) + sum(range(c.size)))
    y = np.full(3, float(c.rank))
    c.broadcast(y, root=c.size - 1)
    assert (y == c.size - 1).all()
    z = c.reduce(np.ones(2, dtype=np.int32), op="max", root=0)
    assert z.tolist() == [1, 1]
    g = c.allgather(np.array([c.rank]))
    assert g[:, 0].tolist() == list(range(c.size))
    c.barrier()


@pytest.mark.parametrize("what", ["shape", "dtype", "op", "root", "collective", "barrier", "order"])
def test_mismatch_raises_on_every_rank_naming_every_side(checked, what):
    c = checked
    if c.size == 1:
        pytest.skip("one rank always agrees with itself")
    last = c.size - 1
    odd = c.rank == last  # the last rank makes a different call
    x = np.arange(4.0) + c.rank
    before = x.copy()
    if what == "shape":
        arg = np.arange(4.0 + odd) + c.rank
        before = arg.copy()
        call, match = (lambda: c.allreduce(arg)), rf"shape: ranks? 0.* \(4,\), rank {last} has \(5,\)"
    elif what == "dtype":
        arg = x.astype(np.float32) if odd else x
        before = arg.copy()
        call, match = (lambda: c.allreduce(arg)), rf"dtype: ranks? 0.*'float64', rank {last} has 'float32'"
    elif what == "op":
        call = lambda: c.allreduce(x, op="max" if odd else "sum")
        match = rf"op: ranks? 0.*'sum', rank {last} has 'max'"
    elif what == "root":
        call, match = (lambda: c.broadcast(x, root=1 if odd else 0)), rf"root: ranks? 0.* 0, rank {last} has 1"
    elif what == "collective":
        call = (lambda: c.broadcast(x)) if odd else (lambda: c.allreduce(x))
        match = rf"different collectives \(checked mode\): ranks? 0.* called allreduce, rank {last} called broadcast"
    elif what == "barrier":
        call = (c.barrier) if odd else (lambda: c.allgather(x))
        match = rf"different collectives \(checked mode\): ranks? 0.* called allgather, rank {last} called barrier"
    else:  # reduce vs allreduce: same data, different semantics
        call = (lambda: c.reduce(x, root=0)) if odd else (lambda: c.allreduce(x))
        match = rf"different collectives \(checked mode\): ranks? 0.* called allreduce, rank {last} called reduce"
    err = every_rank_raises(c, call, match=match)
    assert "checked mode" in str(err)
    np.testing.assert_array_equal(x, np.arange(4.0) + c.rank)  # inputs untouched
    if what in ("shape", "dtype"):
        np.testing.assert_array_equal(arg, before)
    # the communicator is still usable, on every rank
    y = np.ones(3)
    c.allreduce(y)
    assert (y == c.size).all()


def test_mismatch_names_three_groups(checked):
    c = checked
    if c.size < 3:
        pytest.skip("needs three ranks for three different shapes")
    x = np.zeros(c.rank + 1)
    err = every_rank_raises(c, lambda: c.allgather(x), match="shape")
    for r in range(c.size):
        assert f"rank {r} has ({r + 1},)" in str(err)


# ---------------------------------------------------------------------------------------------------------
# checked mode: one rank's own arguments are invalid


INVALID = {
    "int-mean": (lambda c, x: c.allreduce(np.arange(4), op="mean"), TypeError, "would truncate"),
    "root-out-of-range": (lambda c, x: c.broadcast(x, root=c.size), ValueError, "out of range"),
    "root-numpy-out-of-range": (lambda c, x: c.reduce(x, root=np.int64(-1)), ValueError, "out of range"),
    "root-float": (lambda c, x: c.reduce(x, root=0.0), TypeError, "root must be an integer"),
    "list": (lambda c, x: c.allreduce([1.0, 2.0, 3.0, 4.0]), TypeError, "expected an array, got list"),
    "scalar": (lambda c, x: c.broadcast(1.5), TypeError, "expected an array, got float"),
    "object-array": (lambda c, x: c.allgather(np.array([None] * 4, dtype=object)), TypeError, "object arrays"),
    "structured-sum": (lambda c, x: c.allreduce(np.zeros(4, dtype=[("a", "i4")])), TypeError, "numeric dtype"),
    "unknown-op": (lambda c, x: c.reduce(x, op="avg"), ValueError, "unknown op"),
    "out-shape": (lambda c, x: c.allgather(x, out=np.empty((c.size + 1, 4))), ValueError, "out must have shape"),
    "out-dtype": (lambda c, x: c.allgather(x, out=np.empty((c.size, 4), np.float32)), TypeError, "out must have x's dtype"),
    "scatter-out-shape": (lambda c, x: c.reduce_scatter(np.tile(x, (c.size, 1)), out=np.empty((1, 5))), ValueError,
                          "out must have shape"),
}
VALID = {  # what the other ranks call meanwhile (the same collective, with valid arguments)
    "int-mean": lambda c, x: c.allreduce(x, op="mean"),
    "root-out-of-range": lambda c, x: c.broadcast(x, root=0),
    "root-numpy-out-of-range": lambda c, x: c.reduce(x, root=0),
    "root-float": lambda c, x: c.reduce(x, root=0),
    "list": lambda c, x: c.allreduce(x),
    "scalar": lambda c, x: c.broadcast(x),
    "object-array": lambda c, x: c.allgather(x),
    "structured-sum": lambda c, x: c.allreduce(x),
    "unknown-op": lambda c, x: c.reduce(x, op="sum"),
    "out-shape": lambda c, x: c.allgather(x, out=np.empty((c.size, 4))),
    "out-dtype": lambda c, x: c.allgather(x, out=np.empty((c.size, 4))),
    "scatter-out-shape": lambda c, x: c.reduce_scatter(np.tile(x, (c.size, 1)), out=np.empty((1, 4))),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_arguments_on_one_rank_raise_everywhere(checked, case):
    c = checked
    bad_call, err_type, err_text = INVALID[case]
    bad = c.size - 1  # the last rank's arguments are invalid; at size 1 that is the only rank
    x = np.arange(4.0) + c.rank
    call = (lambda: bad_call(c, x)) if c.rank == bad else (lambda: VALID[case](c, x))
    collective = {"int-mean": "allreduce", "list": "allreduce", "structured-sum": "allreduce",
                  "object-array": "allgather", "out-shape": "allgather", "out-dtype": "allgather",
                  "scatter-out-shape": "reduce_scatter", "scalar": "broadcast",
                  "root-out-of-range": "broadcast"}.get(case, "reduce")
    err = every_rank_raises(c, call, own={bad: (err_type, err_text)},
                            match=rf"{collective} refused by rank {bad} .*{err_type.__name__}: .*{err_text}")
    if c.rank == bad and c.size > 1:
        assert any("the other ranks were told" in n for n in getattr(err, "__notes__", [])) or not hasattr(
            err, "add_note")
    np.testing.assert_array_equal(x, np.arange(4.0) + c.rank)  # nothing moved
    y = np.full(2, 1.0)
    c.allreduce(y)  # every rank is back in step
    assert (y == c.size).all()


@pytest.mark.parametrize("kind,name", [(2, "cuda"), (13, "cuda_managed"), (8, "metal")])
def test_checked_device_arrays_agree_before_a_transport_is_chosen(checked, kind, name):
    """Choosing a device transport is collective: in checked mode a rank with a device array among ranks
    with host arrays is a mismatch found before it starts, on every rank."""
    c = checked
    x = np.zeros(4, dtype=np.float32)
    odd = c.rank == c.size - 1
    if c.size > 1:
        arg = FakeDeviceArray(kind) if odd else x
        every_rank_raises(c, lambda: c.allreduce(arg), match=rf"device: ranks? 0.*'host', rank {c.size - 1} "
                                                              rf"has '{name}'")
    # every rank with the same device array: agreed, then refused (no such transport here) on every rank
    with pytest.raises(BackendUnavailableError, match="cuda" if kind in (2, 13) else "metal:0"):
        c.broadcast(FakeDeviceArray(kind))
    # a device array of another shape on one rank: a mismatch, not a transport set-up on some ranks
    if c.size > 1:
        dev = FakeDeviceArray(kind)
        dev.shape = (5,) if odd else (4,)
        every_rank_raises(c, lambda: c.allgather(dev), match=rf"shape: ranks? 0.*\(4,\), rank {c.size - 1} "
                                                            rf"has \(5,\)")
    c.barrier()


def test_invalid_arguments_on_every_rank_raise_each_ranks_own_error(checked):
    c = checked
    with pytest.raises(ValueError, match="out of range"):
        c.broadcast(np.zeros(2), root=c.size + c.rank)
    with pytest.raises(TypeError, match="would truncate"):
        c.allreduce(np.zeros(2, dtype=np.int16), op="mean")
    c.barrier()


def test_two_ranks_refuse_both_are_named(checked):
    c = checked
    if c.size < 3:
        pytest.skip("needs a valid rank besides two refusing ones")
    x = np.ones(2)
    if c.rank in (1, 2):
        with pytest.raises(ValueError, match="out of range"):
            c.reduce(x, root=-c.rank)
    else:
        with pytest.raises(MismatchError, match=r"refused by ranks 1,2 .*rank 1 raised ValueError: root=-1 .*"
                                                r"rank 2 raised ValueError: root=-2"):
            c.reduce(x, root=0)
    c.barrier()


def test_unchecked_invalid_arguments_still_raise_locally(comm):
    """Without checking, a call that is invalid on every rank raises everywhere, nothing communicated."""
    assert not comm.check
    with pytest.raises(TypeError, match="would truncate"):
        comm.allreduce(np.arange(3), op="mean")
    with pytest.raises(BackendUnavailableError, match="cuda"):
        comm.allreduce(FakeDeviceArray(2))


# ---------------------------------------------------------------------------------------------------------
# hostile and odd inputs (every rank passes the same bad input, so nothing may hang even unchecked)


@pytest.mark.parametrize("mode", ["unchecked", "checked"])
def test_hostile_inputs_are_refused_clearly(comm, mode):
    before = comm.check
    comm.check = mode == "checked"
    try:
        x = np.arange(4.0)
        obj = np.array([1, "a", None], dtype=object)
        rec = np.zeros(3, dtype=[("a", "i4"), ("b", "f8")])
        for call in (lambda: comm.allreduce(obj), lambda: comm.broadcast(obj), lambda: comm.allgather(obj),
                     lambda: comm.reduce(obj)):
            with pytest.raises(TypeError, match="object arrays .* convert to a numeric dtype"):
                call()
        for op in ("sum", "prod", "min", "max", "mean"):
            with pytest.raises(TypeError, match=rf"op='{op}' needs a numeric dtype; got .*broadcast or"):
                comm.allreduce(rec, op=op)
        with pytest.raises(BackendUnavailableError, match="cuda:0.*copy the array to host memory"):
            comm.broadcast(FakeDeviceArray(2))
        with pytest.raises(BackendUnavailableError, match="cuda"):
            comm.reduce(FakeDeviceArray(13, 3))
        with pytest.raises(BackendUnavailableError, match="dlpack-device-99:0: no transport"):
            comm.allgather(FakeDeviceArray(99))
        with pytest.raises(TypeError, match="root must be an integer rank, got float 1.0"):
            comm.broadcast(x, root=1.0)
        with pytest.raises(TypeError, match="root must be an integer rank, got float64"):
            comm.reduce(x, root=np.float64(0))
        with pytest.raises(ValueError, match=rf"root={comm.size + 7} is out of range"):
            comm.broadcast(x, root=np.int32(comm.size + 7))
        with pytest.raises(ValueError, match="root=-1 is out of range"):
            comm.reduce(x, root=np.int8(-1))
        with pytest.raises(TypeError, match="expected an array, got list"):
            comm.broadcast([1, 2, 3])
        with pytest.raises(TypeError, match="expected an array, got tuple"):
            comm.allgather((1.0,))
        with pytest.raises(TypeError, match="expected an array, got int; wrap it in a 0-d array"):
            comm.allreduce(3)
        with pytest.raises(TypeError, match="expected an array, got float64"):
            comm.allreduce(np.float64(3.0))
        with pytest.raises(TypeError, match="expected an array, got NoneType"):
            comm.allreduce(None)
        np.testing.assert_array_equal(x, np.arange(4.0))
        comm.barrier()  # nobody is left behind
    finally:
        comm.check = before


def test_structured_dtype_still_moves_bit_for_bit(comm):
    rec = np.zeros(2, dtype=[("a", "i4"), ("b", "f8")])
    rec["a"], rec["b"] = comm.rank, comm.rank + 0.5
    comm.broadcast(rec, root=comm.size - 1)
    assert rec["a"].tolist() == [comm.size - 1] * 2 and rec["b"].tolist() == [comm.size - 0.5] * 2
    g = comm.allgather(rec)
    assert g.dtype == rec.dtype and g.shape == (comm.size, 2)


def test_numpy_integer_root_in_range_is_accepted(comm):
    for kind in (np.int8, np.uint16, np.int64):
        x = np.full(2, float(comm.rank))
        comm.broadcast(x, root=kind(comm.size - 1))
        assert (x == comm.size - 1).all()


# ---- trees (the tree API refuses on every rank too) ----


def test_tree_with_mixed_devices_is_refused_on_every_rank(comm):
    if not hasattr(coll, "allreduce_tree"):
        pytest.skip("no tree API in this build")
    w = np.ones(3)
    tree = {"w": w, "g": FakeDeviceArray(2)}
    with pytest.raises((BackendUnavailableError, TypeError, ValueError), match="cuda"):
        coll.allreduce_tree(tree, op="sum", comm=comm)
    if comm.size > 1:  # with one rank synchronize moves nothing and does not look at devices
        with pytest.raises((BackendUnavailableError, TypeError, ValueError), match="cuda"):
            coll.synchronize(tree, comm=comm)
    assert (w == 1).all()
    comm.barrier()


def test_tree_with_unpicklable_leaf_is_refused_on_every_rank(comm):
    if not hasattr(coll, "synchronize"):
        pytest.skip("no tree API in this build")
    if comm.size == 1:
        pytest.skip("with one rank synchronize sends nothing, so nothing is pickled")
    w = np.full(2, float(comm.rank))
    tree = {"w": w, "lock": threading.Lock(), "f": (lambda: None) if comm.rank == 0 else None}
    with pytest.raises(Exception, match="(?i)pickl|lock") as info:
        coll.synchronize(tree, root=0, comm=comm)
    assert not isinstance(info.value, (AssertionError, SystemError))
    assert (w == comm.rank).all()  # nothing moved
    comm.barrier()


# ---- NaN and infinity ----


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "complex128"])
@pytest.mark.parametrize("op", ["sum", "prod", "mean"])
def test_nan_and_inf_propagate_through_arithmetic_ops(comm, op, dtype):
    nan_rank, inf_rank = comm.size - 1, 0
    x = np.array([np.nan if comm.rank == nan_rank else 1.0, np.inf if comm.rank == inf_rank else 1.0,
                  -np.inf if comm.rank == inf_rank else 1.0, 2.0], dtype=dtype)
    y = comm.allreduce(x, op=op)
    assert np.isnan(y[0]), f"{op} lost a NaN: {y}"
    if op in ("sum", "mean", "prod") and not dtype.startswith("complex"):
        assert y[1] == np.inf and y[2] == -np.inf
    assert np.isfinite(y[3])
    g = comm.allgather(y)
    assert all(np.array_equal(g[0], g[r], equal_nan=True) for r in range(comm.size)), "ranks disagree"


def test_inf_minus_inf_is_nan(comm):
    x = np.array([np.inf if comm.rank == 0 else -np.inf])
    comm.allreduce(x, op="sum")
    assert np.isnan(x[0]) if comm.size > 1 else x[0] == np.inf


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_inf_through_max_and_min(comm, dtype):
    x = np.array([np.inf if comm.rank == comm.size - 1 else 0.0,
                  -np.inf if comm.rank == 0 else 0.0], dtype=dtype)
    y = comm.allreduce(x.copy(), op="max")
    z = comm.allreduce(x.copy(), op="min")
    assert y[0] == np.inf and z[1] == -np.inf


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("nan_rank", ["first", "last"])
@pytest.mark.parametrize("n", [1, 4, 2**16, 2**18])
def test_nan_through_max_and_min(comm, op, dtype, nan_rank, n):
    """IEEE 754-2019 maximum/minimum propagate NaN. MPI's MPI_MAX/MPI_MIN do not promise it, and MPICH's
    do not (a NaN was dropped depending on dtype, length and which rank held it, sometimes on some ranks
    only). We reduce floats through an order-preserving integer mapping instead: NaN must reach every rank
    at every length, whichever rank holds it."""
    holder = 0 if nan_rank == "first" else comm.size - 1
    x = np.full(n, 2.0, dtype=dtype)
    x[0] = np.nan if comm.rank == holder else 1.0
    y = comm.allreduce(x, op=op)
    got = comm.allgather(y[:2])
    assert (got[:, 1:] == 2.0).all()
    assert np.isnan(got[:, 0]).all(), f"{op} dropped a NaN held by rank {holder}: {got[:, 0].tolist()}"


def test_nccl_eager_must_be_set_alike_on_every_rank(comm, monkeypatch):
    """COLLECTIVES_NCCL_EAGER is agreed before any rank sets up a device: set on some ranks only, every
    rank raises MismatchError (instead of one rank starting a collective set-up alone); set on every
    rank of a machine without a GPU, every rank raises BackendUnavailableError. The communicator stays
    usable either way."""
    pytest.importorskip("torch")
    from collectives import _config
    from collectives._backends import cuda

    if comm.size > 1:
        monkeypatch.setattr(_config, "nccl_eager", lambda: comm.rank == 0)
        with pytest.raises(MismatchError, match=r"COLLECTIVES_NCCL_EAGER=1 on some ranks only: rank 0 has COLLECTIVES_NCCL_EAGER=1, "
                                               r"ranks? 1[,0-9]* ha(s|ve) it off"):
            cuda.initialize_eagerly(engine_of(comm))
    monkeypatch.setattr(_config, "nccl_eager", lambda: True)
    try:
        gpus = cuda.device_api().device_count()
    except BackendUnavailableError:
        gpus = 0
    if gpus == 0:
        with pytest.raises(BackendUnavailableError) as info:
            cuda.initialize_eagerly(engine_of(comm))
        assert comm._devices == {}
        assert len(set(gather_objects(str(info.value)))) == 1, "ranks raised different errors"
    x = np.full(3, float(comm.rank))
    comm.allreduce(x, op="max")
    assert (x == comm.size - 1).all()


@pytest.mark.parametrize("where", ["array", "tree leaf"])
def test_structured_dtypes_of_the_same_size_are_told_apart(checked, where):
    """Two structured dtypes of 8 bytes each (issue 12): the description is the whole layout (fields,
    offsets, byte order), not "void64", so a broadcast cannot reinterpret one as the other."""
    c = checked
    if c.size == 1:
        pytest.skip("one rank always agrees with itself")
    odd = c.rank == c.size - 1
    dtype = np.dtype([("x", "<f8")]) if odd else np.dtype([("a", "<i4"), ("b", "<f4")])
    x = np.zeros(3, dtype)
    before = x.copy()
    if where == "array":
        call = lambda: c.broadcast(x, root=0)  # the call every rank makes
    else:
        call = lambda: coll.synchronize({"s": x}, root=0, comm=c)
    every_rank_raises(c, call, match=r"\('a', '<i4'\), \('b', '<f4'\).*\('x', '<f8'\)")
    assert x.tobytes() == before.tobytes()


@pytest.mark.parametrize("mine", ["barrier", "allreduce", "synchronize"])
def test_a_tree_collective_against_another_collective(checked, mine):
    """One rank calls allreduce_tree while the others call something else (issue 12): the tree check and
    checked mode are one protocol, so every rank raises a MismatchError naming both calls."""
    c = checked
    if c.size == 1:
        pytest.skip("one rank always agrees with itself")
    x = np.ones(3)
    if c.rank == c.size - 1:
        call = lambda: coll.allreduce_tree({"w": x}, comm=c)
    elif mine == "barrier":
        call = c.barrier
    elif mine == "allreduce":
        call = lambda: c.allreduce(x)
    else:
        call = lambda: coll.synchronize({"w": x}, comm=c)
    err = every_rank_raises(c, call, match=rf"ranks called different collectives.* called {mine}, "
                                           rf"rank {c.size - 1} called allreduce_tree")
    assert isinstance(err, coll.MismatchError) and (x == 1).all()
    c.allreduce(x)  # still usable
    assert (x == c.size).all()


def test_lazily_negated_and_sparse_tensors_behave_the_same_warm_and_cold(comm):
    """A lazily negated tensor (z.conj().imag) and a sparse one take the general path even once the torch
    hot path has a cached call for their dtype (issue 12): same result, or same error, warm and cold."""
    torch = pytest.importorskip("torch")
    for warm in (False, True):
        if warm:
            comm.allreduce(torch.ones(2))  # fills the hot path for float32
            comm.broadcast(torch.ones(2), root=0)
        z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (comm.rank + 1)
        neg = z.conj().imag
        assert neg.is_neg()
        got = comm.allreduce(neg)
        want = -torch.tensor([2.0, -1.0]) * sum(range(1, comm.size + 1))
        assert torch.equal(got, want), (warm, got)
        z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (comm.rank + 1)
        b = z.conj().imag  # a view of z: the broadcast writes root's values into z's imaginary parts
        assert torch.equal(comm.broadcast(b, root=0), torch.tensor([-2.0, 1.0])), warm
        assert torch.equal(z.imag, torch.tensor([2.0, -1.0])), warm
        sparse = torch.ones(2, 2).to_sparse_csr()
        with pytest.raises(TypeError):
            comm.allreduce(sparse)


# ---- a CUDA call through host staging (issue 33: calls run downward), with stand-ins for the device ----

# each collective as (its name, the call on c of an array y with op)
STAGED_CALLS = [
    ("allreduce", lambda c, y, op: c.allreduce(y, op)),
    ("allreduce", lambda c, y, op: c.allreduce(y, op, async_op=True).wait()),
    ("reduce", lambda c, y, op: c.reduce(y, op, c.size - 1)),
    ("reduce_scatter", lambda c, y, op: c.reduce_scatter(y, op)),
    ("broadcast", lambda c, y, op: c.broadcast(y, c.size - 1)),
    ("allgather", lambda c, y, op: c.allgather(y)),
    ("alltoall", lambda c, y, op: c.alltoall(y)),
    ("gather", lambda c, y, op: c.gather(y, 0)),
]


def staged_inputs(rank: int, size: int) -> dict:
    """dtype name -> (this rank's input, the op): rounding (float16 mean), NaN and signed zeros (float32
    max: ordered integers), wrapping (int8 sum), complex products."""
    n = 3 * size
    return {"float16": (np.linspace(-1, 1, n, dtype=np.float16) * np.float16((rank + 1) / 3), "mean"),
            "float32": (np.array([np.nan if rank == size - 1 else 1.0, -0.0, 0.0] * size, np.float32) * (rank + 1),
                        "max"),
            "int8": (np.full(n, 100 + rank, np.int8), "sum"),
            "complex64": ((np.arange(n) + 1j * rank).astype(np.complex64), "prod")}


@pytest.mark.parametrize("deadline", [False, True], ids=["plain", "deadline"])
def test_a_staged_device_call_agrees_once_and_gives_the_host_bits(comm, monkeypatch, deadline):
    """A CUDA call through host staging in checked mode is one call: agreed once (on the device array, by
    the engine), one record; its host copy runs the host collective's steps (``Engine.staged``), so every
    result has the bits of the same call on host memory, and point-to-point keeps its header (a message
    that does not fit raises the host path's error, word for word) on the plain and the deadline transport."""
    from collectives import _agree
    from support.comms import communicator
    from support.device import OnDevice, staging

    if deadline and comm.backend != "mpi":
        pytest.skip("needs the MPI backend")
    agreed = []
    real = _agree.agree
    monkeypatch.setattr(_agree, "agree",
                        lambda transport, what, *a, **k: (agreed.append(what), real(transport, what, *a, **k)))
    with communicator(COLLECTIVES_TIMEOUT=300) if deadline else contextlib.nullcontext(comm) as c:
        before, c.check = c.check, True
        try:
            staging(c, monkeypatch)
            engine = engine_of(c)
            for name, (x, op) in staged_inputs(c.rank, c.size).items():
                for what, call in STAGED_CALLS:
                    agreed.clear()
                    seq = engine.trace_seq()
                    got = call(c, OnDevice(x.copy()), op)
                    assert agreed == [what] and engine.trace_seq() == seq + 1, (what, agreed)
                    want = call(c, x.copy(), op)
                    if want is None:  # gather, off root
                        assert got is None, what
                    else:
                        assert got.values.dtype == want.dtype and got.values.tobytes() == want.tobytes(), (name, what)
            if c.size == 1:
                return
            right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
            x = np.arange(4, dtype=np.float64) + c.rank
            words = None
            for on_device in (True, False):  # a message, then one that does not fit: the same words on both
                wrap = OnDevice if on_device else np.asarray
                agreed.clear()
                seq = engine.trace_p2p_seq()
                send = c.send(wrap(x), right, 5, async_op=True)
                y = wrap(np.zeros(4))
                assert c.recv(y, left, 5) == left and not agreed and engine.trace_p2p_seq() == seq + 2
                send.wait()
                assert (y.values if on_device else y).tolist() == (np.arange(4) + left).tolist()
                send = c.send(wrap(x), right, 6, async_op=True)
                with pytest.raises(ValueError, match="but the receive buffer holds 3 x float64") as info:
                    c.recv(wrap(np.zeros(3)), left, 6)
                send.wait()
                words = words or str(info.value)
                assert str(info.value) == words
        finally:
            c.check = before

"""Property-based tests of the array collectives against a NumPy reference, at any world size.

Random collectives, shapes (0-d and empty included), memory layouts (C, Fortran, strided, reversed,
read-only), dtypes, ops, roots, array libraries, checked or not, with the plain MPI transport or the one
with a deadline (``COLLECTIVES_TIMEOUT``: non-blocking calls, polled). Every rank must run the very same
examples in the same order, or the ranks would wait in different collectives:

- hypothesis is derandomized (its seed depends only on the test), has no example database, and every
  health check (some depend on timing, which differs between ranks) is off;
- the parameters of each example are still drawn on every rank but *taken from rank 0* (an mpi4py
  ``bcast`` on ``COMM_WORLD``, outside the library), so a divergence could only change how many
  examples run, never which collective a rank calls;
- a failure is agreed: every rank gathers every rank's verdict and all fail together, so all ranks
  then shrink the same failing example in step.

Each rank's data is generated from (seed, rank), so every rank can compute the reference itself.
"""

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import collectives as coll  # noqa: E402
from collectives import MismatchError  # noqa: E402
from support.arrays import reduce_reference, to_numpy  # noqa: E402
from support.comms import communicator, deadline_communicator  # noqa: E402

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), report_multiple_bugs=False, print_blob=False)

NUMPY_DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
                "float32", "float64", "complex64", "complex128"]
TORCH_DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
                "float64", "complex64", "complex128"]
LEGAL = {"sum": "iufc", "prod": "iufc", "min": "biuf", "max": "biuf", "mean": "fc"}
SENTINEL = 7


def kind(dtype: str) -> str:
    return "f" if dtype == "bfloat16" else np.dtype(dtype).kind


@st.composite
def calls(draw, size):
    lib = draw(st.sampled_from(["numpy", "numpy", "torch"]))
    dtype = draw(st.sampled_from(NUMPY_DTYPES if lib == "numpy" else TORCH_DTYPES))
    collective = draw(st.sampled_from(["allreduce", "reduce", "broadcast", "allgather"]))
    op = None
    if collective in ("allreduce", "reduce"):
        op = draw(st.sampled_from([o for o, kinds in LEGAL.items() if kind(dtype) in kinds]))
    layouts = ["C", "F", "step"] + (["reversed", "readonly"] if lib == "numpy" else [])
    return {
        "lib": lib, "dtype": dtype, "collective": collective, "op": op,
        "root": draw(st.integers(0, size - 1)),
        # (hypothesis favours the simplest values; listing the interesting ones first spreads the draws)
        "shape": tuple(draw(st.sampled_from([3, 2, 4, 1, 0][:5 if d == 0 else 4]))
                       for d in range(draw(st.sampled_from([2, 1, 3, 0])))),
        "layout": draw(st.sampled_from(layouts[::-1])),
        "checked": draw(st.booleans()),
        "deadline": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def values(p, rank) -> np.ndarray:
    """Rank's logical values for the call ``p``: small integers, so every sum and product is exact."""
    rng = np.random.default_rng([p["seed"], rank])
    shape, k = p["shape"], kind(p["dtype"])
    if k == "b":
        v = rng.integers(0, 2, shape).astype(bool)
    elif p["op"] == "prod":
        v = rng.choice([1, 2] if k == "u" else [-1, 1, 2], shape)
    elif k == "u":
        v = rng.integers(0, 5, shape)
    else:
        v = rng.integers(-4, 5, shape)
    if k == "c":
        v = v + 1j * rng.integers(-2, 3, shape)
    return np.asarray(v)


def build(p, logical: np.ndarray):
    """(x, base, view_mask): x holds ``logical`` in the drawn layout; base is the memory it lives in."""
    layout, shape = p["layout"], p["shape"]
    if layout == "step" and not shape:
        layout = "C"
    if p["lib"] == "torch":
        import torch

        src = torch.from_numpy(np.array(logical, dtype="float32" if p["dtype"] == "bfloat16" else p["dtype"],
                                        order="C"))  # (np.ascontiguousarray would make 0-d 1-d)
        src = src.to(getattr(torch, p["dtype"]))
        if layout == "F" and src.dim() >= 2:
            axes = tuple(reversed(range(src.dim())))
            return src.permute(axes).contiguous().permute(axes), None
        if layout == "step":
            base = torch.full((2 * shape[0],) + shape[1:], SENTINEL, dtype=src.dtype)
            base[::2] = src
            return base[::2], base
        return src.clone(), None
    a = logical.astype(p["dtype"])
    if layout == "F" and a.ndim >= 2:  # (np.asfortranarray makes a 0-d array 1-d)
        return np.asfortranarray(a), None
    if layout == "step":
        base = np.full((2 * shape[0],) + shape[1:], SENTINEL, dtype=a.dtype)
        base[::2] = a
        return base[::2], base
    if layout == "reversed" and shape:
        base = np.ascontiguousarray(a[::-1])
        return base[::-1], None
    if layout == "readonly":
        a.flags.writeable = False
    return a, None


def reference(p, size) -> np.ndarray:
    arrays = [values(p, r) for r in range(size)]
    if p["op"] != "mean":
        return reduce_reference(arrays, p["op"], p["dtype"])
    stack = np.stack([a.astype(p["dtype"] if p["dtype"] != "bfloat16" else "float32") for a in arrays])
    return stack.astype(np.complex128 if kind(p["dtype"]) == "c" else np.float64).sum(0) / size  # exact


def same(got: np.ndarray, want: np.ndarray, p) -> bool:
    if p["op"] == "mean":
        rtol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "complex64": 1e-6}.get(p["dtype"], 1e-12)
        return got.shape == want.shape and np.allclose(got.astype(want.dtype), want, rtol=rtol, atol=0)
    return got.shape == want.shape and np.array_equal(got.astype(want.dtype), want)


def check_call(comm, p) -> None:
    """Run the call ``p`` on every rank and assert its outcome on this rank."""
    rank, size = comm.rank, comm.size
    mine = values(p, rank)
    x, base = build(p, mine)
    base_before = None if base is None else to_numpy(base).copy()
    writable = p["lib"] == "torch" or x.flags.writeable
    name = p["collective"]
    if name == "allreduce":
        y = comm.allreduce(x, op=p["op"])
        assert same(to_numpy(y), reference(p, size), p), (to_numpy(y), reference(p, size))
    elif name == "reduce":
        y = comm.reduce(x, op=p["op"], root=p["root"])
        if rank == p["root"]:
            assert same(to_numpy(y), reference(p, size), p), (to_numpy(y), reference(p, size))
        else:
            assert y is x and np.array_equal(to_numpy(x), mine.astype(to_numpy(x).dtype)), "non-root x changed"
    elif name == "broadcast":
        y = comm.broadcast(x, root=p["root"])
        want = build(p, values(p, p["root"]))[0]
        assert to_numpy(y).tobytes() == np.ascontiguousarray(to_numpy(want)).tobytes()
    else:
        y = comm.allgather(x)
        g = to_numpy(y)
        assert g.shape == (size,) + p["shape"]
        for r in range(size):
            want = np.ascontiguousarray(to_numpy(build(p, values(p, r))[0]))
            assert np.ascontiguousarray(g[r]).tobytes() == want.tobytes(), (r, g[r], want)
    if name != "allgather" and not (name == "reduce" and rank != p["root"]):
        if writable:
            assert y is x, "a writable array is updated in place"
        else:
            assert y is not x and np.array_equal(x, mine.astype(x.dtype)), "a read-only input changed"
    if base is not None:  # the elements between the strided view's ones are never touched
        after = to_numpy(base)
        assert np.array_equal(after[1::2], base_before[1::2]), "memory outside the view changed"


def agreed(comm, run) -> None:
    """Run ``run()`` on every rank; fail on every rank if it failed on any (so all ranks shrink in step)."""
    from mpi4py import MPI

    try:
        run()
        verdict = None
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        verdict = f"{type(exc).__name__}: {exc}"
    verdicts = MPI.COMM_WORLD.allgather(verdict) if comm.size > 1 else [verdict]
    failed = {r: v for r, v in enumerate(verdicts) if v is not None}
    assert not failed, f"failed on ranks {sorted(failed)}: {failed}"


def from_rank0(comm, obj):
    if comm.size == 1:
        return obj
    from mpi4py import MPI

    return MPI.COMM_WORLD.bcast(obj, root=0)


@pytest.fixture(scope="module")
def deadline_comm(comm):
    """A second communicator whose transport has a deadline (``COLLECTIVES_TIMEOUT`` set at its init);
    the default one where there is no MPI."""
    if comm.backend != "mpi":
        yield comm
        return
    with deadline_communicator() as c:
        yield c


def test_collectives_match_numpy(comm, deadline_comm):
    @SETTINGS
    @given(data=st.data())
    def prop(data):
        p = from_rank0(comm, data.draw(calls(comm.size), label="call"))
        c = deadline_comm if p["deadline"] else comm
        before = c.check
        c.check = p["checked"]
        try:
            agreed(comm, lambda: check_call(c, p))
        finally:
            c.check = before

    prop()


@pytest.fixture
def small_deadline_comm(comm):
    """A communicator with a deadline and a per-call count limit of 7 (both set at its init)."""
    if comm.backend != "mpi":
        pytest.skip("needs the MPI backend")
    with communicator(COLLECTIVES_TIMEOUT=300, COLLECTIVES_MAX_COUNT=7) as c:
        yield c


def test_deadline_transport_chunked_and_object_paths(small_deadline_comm):
    """The polled operations past the per-call count limit, and the object collectives."""
    c = small_deadline_comm
    x = np.arange(50, dtype=np.int64) * (c.rank + 1)
    c.allreduce(x)
    np.testing.assert_array_equal(x, np.arange(50) * c.size * (c.size + 1) // 2)
    b = np.arange(23, dtype=np.float32) + c.rank
    c.broadcast(b, root=c.size - 1)
    np.testing.assert_array_equal(b, np.arange(23, dtype=np.float32) + c.size - 1)
    r = c.reduce(np.arange(30.0) + c.rank, op="max", root=0)
    if c.rank == 0:
        np.testing.assert_array_equal(r, np.arange(30.0) + c.size - 1)
    g = c.allgather(np.arange(9, dtype=np.int16) + c.rank)  # 18 bytes > 7: one broadcast per row
    for i in range(c.size):
        np.testing.assert_array_equal(g[i], np.arange(9) + i)
    mine = {"rank": c.rank, "blob": "x" * (100 * c.rank)}
    assert coll.allgather_object(mine, comm=c) == [{"rank": r, "blob": "x" * (100 * r)} for r in range(c.size)]
    last = c.size - 1
    assert coll.broadcast_object(mine, last, comm=c) == {"rank": last, "blob": "x" * (100 * last)}
    c.barrier()


def test_checked_mode_finds_every_difference(comm):
    """Rank ``size - 1`` makes a different random call: checked mode raises MismatchError on every rank
    exactly when the calls differ in something that matters, and leaves every input untouched."""

    @settings(SETTINGS, max_examples=30)
    @given(data=st.data())
    def prop(data):
        drawn = (data.draw(calls(comm.size), label="p"), data.draw(calls(comm.size), label="q"),
                 data.draw(st.booleans(), label="same"))
        p, q, alike = from_rank0(comm, drawn)
        if alike:
            q = dict(p, seed=q["seed"], layout=q["layout"], lib=p["lib"])  # only the data and layout differ
        mine = q if comm.rank == comm.size - 1 else p
        x, _ = build(mine, values(mine, comm.rank))
        before_x = np.ascontiguousarray(to_numpy(x)).copy()
        keys = {"allreduce": ("op",), "reduce": ("op", "root"), "broadcast": ("root",), "allgather": ()}

        def signature(c):
            dtype = c["dtype"]
            return (c["collective"], c["shape"], dtype) + tuple(c[k] for k in keys[c["collective"]])

        differ = comm.size > 1 and signature(p) != signature(q)
        saved = comm.check
        comm.check = True

        def run():
            name = mine["collective"]
            args = {k: mine[k] for k in keys[name]}
            if differ:
                with pytest.raises(MismatchError, match="ranks disagree|ranks called different collectives"):
                    getattr(comm, name)(x, **args)
                assert np.ascontiguousarray(to_numpy(x)).tobytes() == before_x.tobytes(), "input changed"
            else:
                getattr(comm, name)(x, **args)

        try:
            agreed(comm, run)
        finally:
            comm.check = saved

    prop()

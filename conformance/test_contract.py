"""The parts of the contract that are not one dtype x one layout (docs/semantics.md, "In place, or a new
array", and "Who calls what, and what must match").

- torch tensors that require grad (parameters) are written in place, outside autograd;
- lazily conjugated torch views are written in place too;
- the array library, the layout and writability need not match across ranks;
- repeated calls (the documented NumPy fast path) keep every rule: read-only inputs, views, bad roots;
- every collective is also a method of the communicator; barrier returns None.
"""

from __future__ import annotations

import numpy as np
import pytest

from . import _checks, _dtypes, _libs, _matrix

TORCHES = ("torch", "torch-cuda")


def _torch_cases(aspect, collectives):
    return [pytest.param(n, c, id=f"{n}-{c}", marks=_matrix.meta(collective=c, lib=n, aspect=aspect))
            for n in _matrix.usable_libs() if n in TORCHES for c in collectives]


def _expected(collective, op, root, rank, size, mine_fn):
    if collective == "broadcast":
        return mine_fn(root)
    if collective == "reduce" and rank != root:
        return mine_fn(rank)
    stack = np.stack([mine_fn(r) for r in range(size)])
    return stack.sum(axis=0) / (size if op == "mean" else 1)


def _run(sut, collective, x, op, root):
    if collective == "broadcast":
        return sut.broadcast(x, root=root)
    if collective == "allreduce":
        return sut.allreduce(x, op=op)
    return sut.reduce(x, op=op, root=root)


@pytest.mark.parametrize("lib_name,collective", _torch_cases("requires grad", _matrix.COLLECTIVES))
def test_torch_requires_grad_in_place(sut, comm, lib_name, collective):
    """A parameter (requires_grad=True) is updated in place and stays a trainable leaf; an allgather of one
    is a new tensor that does not require grad."""
    torch = pytest.importorskip("torch")
    lib = _libs.get(lib_name)
    root = comm.size - 1

    def mine(r):
        return np.arange(6, dtype=np.float32).reshape(2, 3) + 4 * r

    p = torch.nn.Parameter(lib.from_bits(mine(comm.rank), _dtypes.ALL["float32"]))
    if collective == "allgather":
        g = sut.allgather(p)
        assert g is not p and not g.requires_grad, "a torch allgather result does not require grad"
        assert np.array_equal(g.detach().cpu().numpy(), np.stack([mine(r) for r in range(comm.size)]))
        assert np.array_equal(p.detach().cpu().numpy(), mine(comm.rank)), "allgather leaves its input alone"
        return
    y = _run(sut, collective, p, "mean", root)
    assert y is p, f"{collective} on a parameter: the docs say it is updated in place and p itself returned"
    assert p.requires_grad and p.is_leaf, f"{collective}: p must still be a leaf that requires grad"
    assert p.grad_fn is None
    want = _expected(collective, "mean", root, comm.rank, comm.size, mine).astype(np.float32)
    got = p.detach().cpu().numpy()
    assert np.allclose(got, want, rtol=1e-6, atol=0), f"{collective}: got {got.tolist()}, expected {want.tolist()}"
    (p * 2).sum().backward()  # autograd still works afterwards
    assert p.grad is not None and bool((p.grad == 2).all())


@pytest.mark.parametrize("lib_name,collective", _torch_cases("conjugate view", ("broadcast", "allreduce", "reduce")))
def test_torch_conjugate_view_in_place(sut, comm, lib_name, collective):
    """A lazily conjugated view (x.conj()) is updated in place: x.conj() holds the result afterwards."""
    pytest.importorskip("torch")
    lib = _libs.get(lib_name)
    root = 0

    def mine(r):
        return (np.array([1 + 2j, -3 + 0.5j, 4 - 1j], dtype=np.complex64) * (r + 1)).astype(np.complex64)

    base = lib.from_bits(np.conj(mine(comm.rank)).astype(np.complex64), _dtypes.ALL["complex64"])
    c = base.conj()
    assert c.is_conj()
    y = _run(sut, collective, c, "sum", root)
    assert y is c, f"{collective} on x.conj(): the docs say it is updated in place and returned"
    want = _expected(collective, "sum", root, comm.rank, comm.size, mine)
    got = c.resolve_conj().detach().cpu().numpy()
    assert np.array_equal(got, want.astype(np.complex64)), f"{collective}: got {got}, expected {want}"
    assert np.array_equal(base.detach().cpu().numpy(), np.conj(want).astype(np.complex64)), (
        f"{collective}: the conjugated view's base must hold the conjugate of the result")


def _mixed_cases():
    libs = _matrix.usable_libs()
    if not libs:
        return []
    return [pytest.param(c, id=c, marks=_matrix.meta(collective=c, aspect="mixed libraries"))
            for c in _matrix.COLLECTIVES]


@pytest.mark.parametrize("collective", _mixed_cases())
def test_libraries_and_layouts_may_differ_across_ranks(sut, comm, rec, collective):
    """One rank may pass NumPy, another torch; one a view, another a read-only array (the docs: these need
    not match). Each rank gets the right values, by its own library's rules."""
    libs = _matrix.usable_libs()
    lib = _libs.get(libs[comm.rank % len(libs)])
    spec = _dtypes.ALL["float64"]  # every library here has it; the dtype must match across ranks
    options = [lay for lay in ("strided", "fortran", "readonly") if lay in lib.layouts] + ["contiguous"]
    layout = options[comm.rank % len(options)]
    shape = (4, 3)
    seed = _dtypes.seed_of("mixed", collective)

    def mine(r):
        return _dtypes.exact_values(_dtypes.ALL["float64"], shape, "sum", _dtypes.seed_of(seed, r)).astype(spec.value)

    made = lib.make(spec, layout, mine(comm.rank), _checks.filler(spec, seed, comm.rank))
    before = _checks.Before(lib, spec, made)
    root = comm.size - 1
    what = f"{collective} on rank {comm.rank} ({lib.name}, {layout})"
    if collective == "allgather":
        y = sut.allgather(made.x)
        got = lib.to_bits(y, spec)
        want = np.stack([mine(r) for r in range(comm.size)])
        assert np.array_equal(got, want), f"{what}: wrong rows"
        rec.same_on_every_rank("result", got.tobytes())
        return
    y = _run(sut, collective, made.x, "sum", root)
    want = _expected(collective, "sum", root, comm.rank, comm.size, mine).astype(spec.value)
    if collective == "reduce" and comm.rank != root:
        assert y is made.x
        _checks.check_untouched(lib, spec, made, before, what)
        return
    _checks.check_in_place(lib, spec, made, y, before, layout, what)
    got = lib.to_bits(y, spec)
    assert np.array_equal(got, want), f"{what}: {_checks.first_difference(got, want)}"


@pytest.mark.parametrize("collective", [pytest.param(c, marks=_matrix.meta(collective=c, lib="numpy",
                                                                            aspect="repeated calls"))
                                        for c in ("broadcast", "allreduce", "reduce")])
def test_repeated_calls_keep_the_rules(sut, comm, collective):
    """After calls that may take a fast path (contiguous writable NumPy arrays of one op and dtype), a
    read-only array, a view, a bad root and another dtype still follow the rules."""
    size, rank, last = comm.size, comm.rank, comm.size - 1

    def want_for(values_of):
        if collective == "broadcast":
            return values_of(last)
        if collective == "reduce" and rank != last:
            return values_of(rank)
        return sum(values_of(r) for r in range(size))

    def fresh(r):
        return np.arange(5.0) * (r + 1)

    for i in range(3):  # warm up: the same (op, dtype) on contiguous writable arrays
        x = fresh(rank)
        y = _run(sut, collective, x, "sum", last)
        assert y is x and np.array_equal(x, want_for(fresh)), (
            f"{collective} call {i + 1}: {x}, expected {want_for(fresh)}")
    ro = fresh(rank)
    ro.flags.writeable = False
    y = _run(sut, collective, ro, "sum", last)
    assert np.array_equal(ro, fresh(rank)), f"{collective} after warm-up: a read-only input was modified"
    if collective == "reduce" and rank != last:
        assert y is ro
    else:
        assert y is not ro and np.array_equal(y, want_for(fresh)), f"{collective}: read-only input gave {y}"
    base = np.stack([fresh(rank), -np.ones(5)], axis=1)  # (5, 2); the view is column 0, strided
    view = base[:, 0]
    y = _run(sut, collective, view, "sum", last)
    assert y is view and np.array_equal(view, want_for(fresh)), f"{collective}: strided view gave {view}"
    assert np.array_equal(base[:, 1], -np.ones(5)), f"{collective}: elements outside the view changed"
    if collective != "allreduce":
        x = fresh(rank)
        for root in (size, -1, 1.0):
            with pytest.raises((ValueError, TypeError)):
                _run(sut, collective, x, "sum", root)
        assert np.array_equal(x, fresh(rank))
    if collective != "broadcast":
        with pytest.raises(TypeError):
            _run(sut, collective, np.arange(5, dtype=np.int64), "mean", last)
    xi = np.arange(5, dtype=np.int32) + rank
    y = _run(sut, collective, xi, "sum", last)
    want = want_for(lambda r: np.arange(5, dtype=np.int32) + r)
    assert y is xi and np.array_equal(xi, want) and xi.dtype == np.int32, f"{collective}: int32 after float64 gave {xi}"


def _method_cases():
    return [pytest.param(c, marks=_matrix.meta(collective=c, lib="numpy", aspect="method form"))
            for c in (*_matrix.COLLECTIVES, "barrier")]


@pytest.mark.parametrize("collective", _method_cases())
def test_method_and_function_forms(sut, comm, collective):
    """Every collective is both a function and a method of the communicator (collectives' API)."""
    if not callable(getattr(comm, collective, None)):
        pytest.skip(f"the system under test's communicator has no {collective} method")
    rank, size = comm.rank, comm.size
    if collective == "barrier":
        assert sut.barrier() is None and comm.barrier() is None, "barrier returns None"
        return
    x = np.full(2, float(rank + 1))
    if collective == "broadcast":
        y, want = comm.broadcast(x, root=0), np.full(2, 1.0)
    elif collective == "allreduce":
        y, want = comm.allreduce(x, op="max"), np.full(2, float(size))
    elif collective == "reduce":
        y = comm.reduce(x, op="sum", root=0)
        want = np.full(2, size * (size + 1) / 2) if rank == 0 else np.full(2, rank + 1.0)
    else:
        y = comm.allgather(x)
        want = np.repeat(np.arange(1.0, size + 1)[:, None], 2, axis=1)
        assert y is not x
    assert np.array_equal(np.asarray(y), want), f"comm.{collective} gave {y}, expected {want}"

"""Trees: ``synchronize`` and ``allreduce_tree`` (their docstrings in collectives are the contract).

Every container kind (dict, OrderedDict, list, tuple, namedtuple, dataclass, nested, torch nn.Module, torch
Optimizer), array leaves of every library, object leaves; the returned structure; in place or new leaves;
and mismatch detection: ranks whose trees, roots or ops differ all raise ``MismatchError`` before anything
changed, and the communicator stays usable. Skipped, with the reason, when the system under test does not
expose these functions.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from . import _checks, _dtypes, _libs, _matrix, _options
from ._dtypes import seed_of

Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Box:
    weight: object
    bias: object
    name: str = "box"


CONTAINERS = ("dict", "ordereddict", "list", "tuple", "namedtuple", "dataclass", "nested")
TORCH_CONTAINERS = ("module", "optimizer")


def _need(sut, *names):
    missing = [n for n in names if not callable(getattr(sut, n, None))]
    if missing:
        pytest.skip(f"the system under test does not expose {', '.join(missing)}")


def _mismatch_error(sut):
    return getattr(sut, "MismatchError", Exception)


def _leaf(lib, rank, seed, dtype="float32", shape=(2, 3)):
    spec = _dtypes.ALL[dtype]
    values = _dtypes.exact_values(spec, shape, "sum", seed_of(seed, rank))
    return lib.from_bits(spec.from_values(values), spec), spec


def _build(container, lib, rank, seed):
    """A tree of this kind, with array leaves of ``lib`` and a few object leaves, different per rank."""
    a, _ = _leaf(lib, rank, seed_of(seed, "a"))
    b, _ = _leaf(lib, rank, seed_of(seed, "b"), "int64", (4,))
    c, _ = _leaf(lib, rank, seed_of(seed, "c"), "float64", ())
    if container == "dict":
        return {"a": a, "b": b, "c": c, "step": rank, "name": f"rank{rank}", "none": None}
    if container == "ordereddict":
        return collections.OrderedDict([("z", a), ("y", b), ("x", c)])
    if container == "list":
        return [a, b, c, rank]
    if container == "tuple":
        return (a, b, c)
    if container == "namedtuple":
        return Pair(a, Pair(b, c))
    if container == "dataclass":
        return Box(a, b, name=f"box{rank}")
    if container == "nested":
        return {"layers": [{"w": a, "b": b}, (c, None)], "meta": {"epoch": rank, "tag": ("x", rank)}}
    raise ValueError(container)


def _leaves(tree):
    """(path, value) pairs in a fixed order, for comparing trees (a reference flattening, not the SUT's)."""
    if isinstance(tree, dict):
        return [(f"[{k!r}]{p}", v) for k in sorted(tree, key=repr) for p, v in _leaves(tree[k])]
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return [(f".{f.name}{p}", v) for f in dataclasses.fields(tree) for p, v in _leaves(getattr(tree, f.name))]
    if isinstance(tree, (list, tuple)):
        return [(f"[{i}]{p}", v) for i, item in enumerate(tree) for p, v in _leaves(item)]
    return [("", tree)]


def _structure(tree):
    if isinstance(tree, dict):
        return (type(tree).__name__, tuple((k, _structure(tree[k])) for k in tree))
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return (type(tree).__name__, tuple((f.name, _structure(getattr(tree, f.name)))
                                           for f in dataclasses.fields(tree)))
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, tuple(_structure(t) for t in tree))
    return "leaf"


def _is_array(v):
    return hasattr(v, "__dlpack__") or isinstance(v, np.ndarray)


def _bits(v):
    a = _libs.host_copy(v)
    return np.ascontiguousarray(a).tobytes(), str(a.dtype)


def _tree_cases(function):
    cases = []
    for name in _matrix.usable_libs():
        kinds = CONTAINERS + (TORCH_CONTAINERS if name in ("torch", "torch-cuda") else ())
        for kind in kinds:
            cases.append(pytest.param(name, kind, id=f"{name}-{kind}", marks=_matrix.meta(
                collective=function, lib=name, aspect=f"containers: {kind}")))
    return cases


def _roots(size, seed):
    if _options.get().full:
        return list(range(size))
    return sorted({0, (seed + _options.get().seed) % size})


def _torch_model(lib, rank, seed, batchnorm=True):
    """A small model, different per rank; BatchNorm adds buffers (one of them an integer count)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed + rank)
    layers = [torch.nn.Linear(3, 2)] + ([torch.nn.BatchNorm1d(2)] if batchnorm else [])
    return torch.nn.Sequential(*layers).to(lib._device())


@pytest.mark.parametrize("lib_name,container", _tree_cases("synchronize"))
def test_synchronize(sut, comm, rec, lib_name, container):
    _need(sut, "synchronize")
    lib = _libs.get(lib_name)
    seed = seed_of("synchronize", lib_name, container)
    steps = _checks.Steps()
    for root in _roots(comm.size, seed):
        with steps.step():
            what = f"synchronize({container} of {lib_name} leaves, root={root}) on rank {comm.rank}"
            if container == "module":
                _sync_module(sut, comm, rec, lib, root, seed, what)
                continue
            if container == "optimizer":
                _sync_optimizer(sut, comm, rec, lib, root, seed, what)
                continue
            tree = _build(container, lib, comm.rank, seed)
            originals = _leaves(tree)
            want = _leaves(_build(container, lib, root, seed))
            out = sut.synchronize(tree, root=root)
            assert _structure(out) == _structure(tree), f"{what}: the returned tree has another structure"
            got = _leaves(out)
            has_objects = any(not _is_array(v) for _, v in originals)
            for (path, g), (_, w), (_, orig) in zip(got, want, originals):
                if _is_array(w):
                    assert _is_array(g) and _bits(g) == _bits(w), f"{what}: leaf {path} is not root's, bit for bit"
                    if lib.writable("nd-odd"):
                        assert g is orig, f"{what}: leaf {path} ({lib_name}) must be updated in place"
                    elif comm.rank != root:
                        assert g is not orig, f"{what}: leaf {path} cannot be written: a new array is expected"
                else:
                    assert g == w and type(g) is type(w), f"{what}: leaf {path} is {g!r}, root has {w!r}"
            if comm.rank == root:
                assert out is tree, f"{what}: on root the docs say tree itself is returned"
            elif lib.writable("nd-odd") and not has_objects:
                assert out is tree, f"{what}: every leaf was updated in place: tree itself is returned"
            rec.same_on_every_rank(f"root {root}", repr([_bits(v) if _is_array(v) else v for _, v in got]).encode())
    steps.done()


def _sync_module(sut, comm, rec, lib, root, seed, what):
    torch = pytest.importorskip("torch")
    model = _torch_model(lib, comm.rank, seed)
    model.train()(torch.ones(4, 3, device=next(model.parameters()).device))  # BatchNorm buffers differ per rank
    params = list(model.parameters())
    ref = _torch_model(lib, root, seed)
    ref.train()(torch.ones(4, 3, device=next(ref.parameters()).device))
    out = sut.synchronize(model, root=root)
    assert out is model, f"{what}: a module is synchronized in place and returned"
    for (name, t), (_, w) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(t.cpu(), w.cpu()), f"{what}: {name} is not root's"
    assert list(model.parameters()) == params and all(p.requires_grad for p in params)
    rec.same_on_every_rank(f"root {root}", b"".join(t.cpu().numpy().tobytes() for t in model.state_dict().values()))


def _sync_optimizer(sut, comm, rec, lib, root, seed, what):
    torch = pytest.importorskip("torch")
    model = _torch_model(lib, 0, seed)  # same parameters everywhere
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (comm.rank + 1))
    for _ in range(comm.rank % 2 + 1):  # different state (and step counts) per rank
        model.zero_grad()
        model.train()(torch.ones(4, 3, device=next(model.parameters()).device) * (comm.rank + 1)).sum().backward()
        opt.step()
    sut.synchronize(opt, root=root)
    state = opt.state_dict()
    want_lr = 0.01 * (root + 1)
    assert state["param_groups"][0]["lr"] == pytest.approx(want_lr), f"{what}: lr is not root's"
    steps = {float(s["step"]) for s in state["state"].values()}
    assert steps == {float(root % 2 + 1)}, f"{what}: step counts {steps}, root has {root % 2 + 1}"
    blob = b"".join(v.cpu().numpy().tobytes() for s in state["state"].values() for k, v in sorted(s.items())
                    if torch.is_tensor(v))
    rec.same_on_every_rank(f"root {root}", blob)


def _reduce_cases():
    cases = []
    for name in _matrix.usable_libs():
        kinds = CONTAINERS + (("module",) if name in ("torch", "torch-cuda") else ())
        for kind in kinds:
            for op in ("sum", "mean", "max"):
                cases.append(pytest.param(name, kind, op, id=f"{name}-{kind}-{op}", marks=_matrix.meta(
                    collective="allreduce_tree", lib=name, op=op, aspect=f"containers: {kind}")))
    if not _options.get().full:  # sampled: every container, every op, rotating
        cases = [c for i, c in enumerate(cases) if (i // 3 + i + _options.get().seed) % 3 == 0 or c.values[2] == "mean"]
    return cases


def _float_tree(container, lib, rank, seed):
    """Like _build, with only float leaves and scalars (mean is legal everywhere)."""
    a, _ = _leaf(lib, rank, seed_of(seed, "a"))
    b, _ = _leaf(lib, rank, seed_of(seed, "b"), "float64", (4,))
    c, _ = _leaf(lib, rank, seed_of(seed, "c"), "float64", ())
    if container == "dict":
        return {"a": a, "b": b, "c": c, "loss": float(rank + 1), "none": None}
    if container == "ordereddict":
        return collections.OrderedDict([("z", a), ("y", b), ("x", c)])
    if container == "list":
        return [a, b, c, np.float32(rank)]
    if container == "tuple":
        return (a, b, c)
    if container == "namedtuple":
        return Pair(a, Pair(b, c))
    if container == "dataclass":
        return Box(a, b, name=None)
    if container == "nested":
        return {"layers": [{"w": a, "b": b}, (c, None)], "count": float(rank)}
    raise ValueError(container)


def _to_np(v):
    return _libs.host_copy(v) if _is_array(v) else v


@pytest.mark.parametrize("lib_name,container,op", _reduce_cases())
def test_allreduce_tree(sut, comm, rec, lib_name, container, op):
    _need(sut, "allreduce_tree")
    lib = _libs.get(lib_name)
    seed = seed_of("allreduce_tree", lib_name, container)
    what = f"allreduce_tree({container} of {lib_name} leaves, op={op!r}) on rank {comm.rank}"
    if container == "module":
        pytest.importorskip("torch")
        model = _torch_model(lib, comm.rank, seed, batchnorm=False)
        trees = [_torch_model(lib, r, seed, batchnorm=False).state_dict() for r in range(comm.size)]
        out = sut.allreduce_tree(model, op=op)
        assert out is model, f"{what}: a module is reduced in place and returned"
        for name, t in model.state_dict().items():
            stack = np.stack([tr[name].cpu().numpy() for tr in trees])
            want = {"sum": stack.sum(0), "mean": stack.sum(0) / comm.size, "max": stack.max(0)}[op]
            assert np.allclose(t.cpu().numpy(), want, rtol=1e-6, atol=0), f"{what}: {name} wrong"
        rec.same_on_every_rank("result", b"".join(t.cpu().numpy().tobytes() for t in model.state_dict().values()))
        return
    tree = _float_tree(container, lib, comm.rank, seed)
    originals = _leaves(tree)
    per_rank = [_leaves(_float_tree(container, lib, r, seed)) for r in range(comm.size)]
    out = sut.allreduce_tree(tree, op=op)
    assert _structure(out) == _structure(tree), f"{what}: the returned tree has another structure"
    got = _leaves(out)
    for i, ((path, g), (_, orig)) in enumerate(zip(got, originals)):
        if orig is None:
            assert g is None, f"{what}: a None leaf stays None"
            continue
        column = [_to_np(pr[i][1]) for pr in per_rank]
        stack = np.stack([np.asarray(c) for c in column])
        want = {"sum": stack.sum(0), "mean": stack.sum(0) / comm.size, "max": stack.max(0)}[op]
        if not _is_array(orig):  # Python and NumPy scalars are reduced too, returned as the same type
            assert type(g) is type(orig), f"{what}: scalar leaf {path} came back as {type(g).__name__}"
            assert np.isclose(float(g), float(want), rtol=1e-6), f"{what}: scalar leaf {path} = {g}, want {want}"
            continue
        assert np.allclose(_to_np(g), want, rtol=1e-6, atol=0), f"{what}: leaf {path} = {_to_np(g)}, want {want}"
        if lib.writable("nd-odd"):
            assert g is orig, f"{what}: leaf {path} ({lib_name}) must be reduced in place"
        else:
            assert g is not orig and np.array_equal(_to_np(orig), np.asarray(column[comm.rank])), (
                f"{what}: leaf {path} cannot be written: a new array, and the input untouched")
    if lib.writable("nd-odd") and all(_is_array(v) for _, v in originals):
        assert out is tree, f"{what}: every leaf was reduced in place: tree itself is returned"
    rec.same_on_every_rank("result", repr([_to_np(v).tobytes() if _is_array(v) else v for _, v in got]).encode())


def _simple_cases(collective, aspect):
    return [pytest.param(n, id=n, marks=_matrix.meta(collective=collective, lib=n, aspect=aspect))
            for n in _matrix.usable_libs()]


@pytest.mark.parametrize("lib_name", _simple_cases("allreduce_tree", "mixed leaves"))
def test_allreduce_tree_mixed_and_shared_leaves(sut, comm, lib_name):
    """Leaves of several dtypes and libraries in one tree; a leaf present twice is reduced once; a mean on an
    integer leaf is a TypeError on every rank, nothing changed."""
    _need(sut, "allreduce_tree")
    lib = _libs.get(lib_name)
    shared = np.full(3, float(comm.rank + 1))
    other, _ = _leaf(lib, comm.rank, 5, "float32", (2,))
    tree = {"np64": shared, "again": shared, "lib32": other, "i": np.full(2, comm.rank, dtype=np.int32)}
    out = sut.allreduce_tree(tree, op="sum")
    s = comm.size * (comm.size + 1) / 2
    assert np.array_equal(out["np64"], np.full(3, s)), f"a leaf present twice must be reduced once: {out['np64']}"
    assert out["again"] is out["np64"]
    assert np.array_equal(out["i"], np.full(2, sum(range(comm.size)), dtype=np.int32)) and out["i"].dtype == np.int32
    bad = {"f": np.ones(2), "i": np.ones(2, dtype=np.int64)}
    with pytest.raises(TypeError):
        sut.allreduce_tree(bad, op="mean")
    assert np.array_equal(bad["f"], np.ones(2)), "nothing changes when the call is refused"


def _mismatch_cases():
    kinds = ("extra-key", "shape", "dtype", "container", "root", "op")
    return [pytest.param(k, id=k, marks=_matrix.meta(collective="synchronize" if k != "op" else "allreduce_tree",
                                                      aspect="mismatch detection")) for k in kinds]


@pytest.mark.parametrize("kind", _mismatch_cases())
def test_tree_mismatch_detected(sut, comm, kind):
    """The last rank's tree (or root, or op) differs: MismatchError on every rank, nothing changed anywhere,
    and the communicator is usable afterwards."""
    _need(sut, "synchronize", "allreduce_tree")
    if comm.size < 2:
        pytest.skip("a mismatch needs two ranks")
    odd = comm.rank == comm.size - 1
    tree = {"w": np.full((2, 3), float(comm.rank)), "b": np.full(3, float(comm.rank))}
    root = 0
    if odd and kind == "extra-key":
        tree["extra"] = np.zeros(1)
    if odd and kind == "shape":
        tree["b"] = np.full(4, float(comm.rank))
    if odd and kind == "dtype":
        tree["b"] = np.full(3, float(comm.rank), dtype=np.float32)
    if odd and kind == "container":
        tree = [tree["b"], tree["w"]]
    if odd and kind == "root":
        root = 1
    before = [(p, np.array(v, copy=True)) for p, v in _leaves(tree)]
    with pytest.raises(_mismatch_error(sut)):
        if kind == "op":
            sut.allreduce_tree(tree, op="max" if odd else "sum")
        else:
            sut.synchronize(tree, root=root)
    for (p, v), (_, b) in zip(_leaves(tree), before):
        assert np.array_equal(v, b), f"leaf {p} changed although the call was refused"
    y = sut.allreduce(np.full(2, 1.0), op="sum")
    assert np.array_equal(np.asarray(y), np.full(2, float(comm.size))), "the communicator must stay usable"


@pytest.mark.parametrize("function", [pytest.param(f, marks=_matrix.meta(collective=f, aspect="canonical order"))
                                      for f in ("synchronize", "allreduce_tree")])
def test_dict_order_does_not_matter(sut, comm, function):
    """Ranks that built the same dict in a different insertion order agree (canonical order)."""
    _need(sut, function)
    keys = ["alpha", "beta", "gamma", "delta"]
    order = keys[comm.rank % 4:] + keys[:comm.rank % 4]
    tree = {k: np.full(2, float(keys.index(k) + 10 * comm.rank)) for k in order}
    if function == "synchronize":
        out = sut.synchronize(tree, root=0)
        for k in keys:
            assert np.array_equal(out[k], np.full(2, float(keys.index(k)))), f"leaf {k}: {out[k]}"
    else:
        out = sut.allreduce_tree(tree, op="sum")
        for k in keys:
            want = comm.size * keys.index(k) + 10 * sum(range(comm.size))
            assert np.array_equal(out[k], np.full(2, float(want))), f"leaf {k}: {out[k]}"
    assert list(out) == order, "the result keeps the caller's own order"

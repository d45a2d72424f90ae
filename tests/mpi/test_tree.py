"""synchronize() and allreduce_tree() at any world size: containers, roots, dtypes, libraries, mismatches."""

import collections
import dataclasses
import typing

import numpy as np
import pytest

import collectives as coll
from support.comms import gather_objects
import itertools


class Point(typing.NamedTuple):
    x: object
    y: object


@dataclasses.dataclass
class Params:
    w: object
    b: object
    note: str = "hello"


@dataclasses.dataclass(frozen=True)
class Frozen:
    w: object


def bits(x) -> bytes:
    """The exact bytes of any array (torch bfloat16 included)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).tobytes()
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        t = x.detach().contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        return t.numpy().tobytes()
    return np.from_dlpack(x).tobytes()


def same_everywhere(comm, *xs) -> bool:
    """Every rank holds the same bytes in every array of ``xs`` (one gather, compared bit for bit)."""
    return len(set(gather_objects(b"|".join(bits(x) for x in xs)))) == 1


# A small bucket bound makes leaves of bucket/4 bytes or more "solo" (own collective, no copy): tests use
# it to exercise that path without megabytes (slow when ranks share few cores).
SMALL_BUCKET = 4096


def values(rank, n=5, dtype=np.float64):
    return (np.arange(n) + 10 * rank).astype(dtype)


# ---------------------------------------------------------------------------------------------------------
# synchronize

# Every synchronize test runs on each of the host transport's ways of broadcasting a tree: the pipelined
# point-to-point broadcast_many (ranks of one node), also with tiny messages so that a tree spans many
# of them and the root's ring of pack buffers wraps around, and the fused buckets (across nodes, or
# with COLLECTIVES_TIMEOUT).
BROADCAST_PATHS = ["pipeline", "pipeline-tiny-messages", "buckets"]


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__.startswith("test_synchronize"):
        metafunc.parametrize("broadcast_path", BROADCAST_PATHS, indirect=True)


# Which broadcast path synchronize takes (the pipeline, its message size, the buckets) is an internal
# choice with no public switch per call: the fixture below and the pipeline tests reach into the host
# transport's class for it, so every synchronize test runs on each path.
@pytest.fixture(autouse=True)
def broadcast_path(request, comm, monkeypatch):
    path = getattr(request, "param", None)
    host = type(comm._host)
    if path == "buckets":
        monkeypatch.setattr(host, "can_broadcast_many", False, raising=False)
    elif path == "pipeline-tiny-messages" and hasattr(host, "PIPE_CHUNK"):
        monkeypatch.setattr(host, "PIPE_CHUNK", 192)  # plans and datatypes are cached per message size
    return path


def test_broadcast_many_pieces_ring_and_cached_datatypes(comm, monkeypatch):
    """The transport's pipeline directly: buffers split across messages, a ring that wraps while messages
    are in flight, datatypes cached per set of addresses (and evicted), zero-length buffers, every root."""
    host = comm._host
    if not getattr(host, "can_broadcast_many", False):
        pytest.skip("broadcast_many needs 2 or more ranks on one node")
    monkeypatch.setattr(type(host), "PIPE_CHUNK", 100)
    lengths = [0, 7, 100, 250, 1, 0, 999, 64]
    for trial in range(2 * host.MAX_TYPE_SETS + 1):  # new buffers every time: new datatypes, evictions
        for root in range(comm.size):
            bufs = [np.full(n, comm.rank * 16 + trial % 7, dtype=np.uint8) for n in lengths]
            if comm.rank == root:
                for i, b in enumerate(bufs):
                    b[:] = (np.arange(b.size) * (i + 3) + root) % 251
            host.broadcast_many(bufs, root, 300)  # ring of 3 messages for 15 messages
            for i, b in enumerate(bufs):
                np.testing.assert_array_equal(b, (np.arange(b.size) * (i + 3) + root) % 251)
        assert len(host._pipe_typesets) <= host.MAX_TYPE_SETS
    kept = [np.zeros(n, dtype=np.uint8) for n in lengths]  # the same buffers again: cached datatypes
    for root in range(comm.size):
        if comm.rank == root:
            for b in kept:
                b[:] = root + 1
        host.broadcast_many(kept, root, 1 << 20)
        assert all((b == root + 1).all() for b in kept)


def test_synchronize_every_container_kind_and_root(comm):
    import torch

    for root in range(comm.size):
        r = comm.rank
        tree = {
            "dict": {"b": values(r), "a": values(r, 3, np.float32)},
            "ordered": collections.OrderedDict([("z", values(r)), ("y", values(r, 2))]),
            "list": [values(r, 1), values(r, 2)],
            "tuple": (values(r, 4), torch.from_numpy(values(r, 3))),
            "named": Point(values(r, 2), r),
            "data": Params(values(r, 3), values(r, 1), note=f"rank{r}"),
            "frozen": Frozen(values(r, 2)),
            "scalars": [r, float(r), np.float32(r), np.int64(r), f"s{r}", None, b"x" * r, {r}],
        }
        arrays_before = [tree["dict"]["b"], tree["tuple"][1], tree["data"].w]
        out = coll.synchronize(tree, root=root, comm=comm)
        want = values(root)
        np.testing.assert_array_equal(out["dict"]["b"], want)
        np.testing.assert_array_equal(out["ordered"]["z"], want)
        np.testing.assert_array_equal(out["tuple"][1].numpy(), values(root, 3))
        assert type(out["ordered"]) is collections.OrderedDict and list(out["ordered"]) == ["z", "y"]
        assert type(out["tuple"]) is tuple and type(out["named"]) is Point and type(out["data"]) is Params
        assert out["named"].y == root and out["data"].note == f"rank{root}"
        np.testing.assert_array_equal(out["frozen"].w, values(root, 2))
        assert out["scalars"] == [root, float(root), np.float32(root), np.int64(root), f"s{root}", None,
                                  b"x" * root, {root}]
        assert type(out["scalars"][2]) is np.float32
        # writable arrays are updated in place
        assert out["dict"]["b"] is arrays_before[0] and out["tuple"][1] is arrays_before[1]
        assert out["data"].w is arrays_before[2]
        if comm.rank == root:
            assert out is tree, "root's tree is returned as it is"


def test_synchronize_in_place_returns_same_tree(comm):
    tree = {"w": values(comm.rank), "b": [values(comm.rank, 2)]}
    assert coll.synchronize(tree, comm=comm) is tree
    assert tree["w"].tolist() == values(0).tolist()


def test_synchronize_read_only_and_array_api_strict(comm):
    import array_api_strict as xs

    ro = values(comm.rank)
    ro.flags.writeable = False
    st = xs.asarray(values(comm.rank, 4))
    tree = {"ro": ro, "strict": st, "rw": values(comm.rank)}
    out = coll.synchronize(tree, root=0, comm=comm)
    np.testing.assert_array_equal(out["ro"], values(0))
    np.testing.assert_array_equal(np.from_dlpack(out["strict"]), values(0, 4))
    assert type(out["strict"]) is type(st)
    if comm.rank != 0:
        assert out["ro"] is not ro and ro.tolist() == values(comm.rank).tolist(), "read-only input untouched"
        assert out["strict"] is not st
        assert out is not tree
    assert out["rw"] is tree["rw"]


def test_synchronize_module_in_place(comm):
    import torch

    torch.manual_seed(comm.rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    model(torch.randn(5, 3))  # updates BatchNorm's running stats (buffers)
    params = list(model.parameters())
    assert coll.synchronize(model, comm=comm) is model
    assert [p is q for p, q in zip(params, model.parameters())] == [True] * len(params)
    assert same_everywhere(comm, *model.state_dict().values())
    assert all(p.requires_grad for p in model.parameters())


def test_synchronize_many_leaves_mixed_dtypes(comm):
    import torch

    r = comm.rank
    shapes = np.random.default_rng(0)  # same shapes on every rank, other values
    rng = np.random.default_rng(r)
    tree = {}
    kinds = ["float32", "float64", "float16", "bfloat16", "int64", "bool"]
    for i in range(240):
        kind = kinds[i % len(kinds)]
        shape = (int(shapes.integers(0, 7)), 3) if i % 5 else ()
        v = np.asarray(rng.integers(-50, 50, size=shape))
        if kind == "bfloat16":
            leaf = torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16)
        elif kind == "bool":
            leaf = np.asarray(v > 0)
        else:
            leaf = v.astype(kind)
        tree[f"leaf{i:03d}"] = leaf
    tree["big"] = np.full(3000, float(r))  # solo with SMALL_BUCKET
    tree["big_bf16"] = torch.full((7000,), float(r + 1), dtype=torch.bfloat16)
    for bucket in (None, SMALL_BUCKET):
        out = coll.synchronize(tree, root=comm.size - 1, comm=comm, bucket_bytes=bucket)
        assert out is tree
        assert same_everywhere(comm, *tree.values())
    assert tree["big"][0] == comm.size - 1 and float(tree["big_bf16"][-1]) == comm.size


def test_synchronize_non_contiguous_views(comm):
    base = np.arange(40.0).reshape(5, 8) * (comm.rank + 1)
    big = np.arange(6000.0).reshape(100, 60) * (comm.rank + 1)
    tree = {"strided": base[:, ::2], "transposed": base.T, "big_strided": big[:, ::3]}
    coll.synchronize(tree, root=0, comm=comm, bucket_bytes=SMALL_BUCKET)
    np.testing.assert_array_equal(base, np.arange(40.0).reshape(5, 8))
    np.testing.assert_array_equal(big[:, ::3], np.arange(6000.0).reshape(100, 60)[:, ::3])
    np.testing.assert_array_equal(big[:, 1::3], np.arange(6000.0).reshape(100, 60)[:, 1::3] * (comm.rank + 1))


def test_synchronize_dict_insertion_order_does_not_matter(comm):
    keys = ["w", "b", "a", "z"]
    if comm.rank % 2:
        keys = keys[::-1]
    tree = {k: np.full(3, float(comm.rank) + i) for i, k in enumerate(sorted(keys))}
    tree = {k: tree[k] for k in keys}
    out = coll.synchronize(tree, comm=comm)
    assert list(out) == keys, "every rank keeps its own key order"
    for i, k in enumerate(sorted(keys)):
        assert out[k].tolist() == [float(i)] * 3


def test_synchronize_mixed_key_types(comm):
    tree = {1: values(comm.rank, 2), "a": values(comm.rank, 3), (2, "x"): comm.rank}
    out = coll.synchronize(tree, comm=comm)
    assert out[1].tolist() == values(0, 2).tolist() and out[(2, "x")] == 0


def test_synchronize_single_array_and_empty(comm):
    x = values(comm.rank)
    assert coll.synchronize(x, comm=comm) is x and x.tolist() == values(0).tolist()
    assert coll.synchronize({}, comm=comm) == {}
    assert coll.synchronize([], comm=comm) == []
    assert coll.synchronize(None, comm=comm) is None
    assert coll.synchronize(f"rank{comm.rank}", comm=comm) == "rank0"
    z = np.zeros((0, 3))
    assert coll.synchronize({"empty": z}, comm=comm)["empty"] is z


def test_synchronize_method_and_mpi4py_comm(comm):
    x = {"a": values(comm.rank)}
    assert comm.synchronize(x) is x
    assert x["a"].tolist() == values(0).tolist()
    from mpi4py import MPI

    y = {"a": values(comm.rank)}
    coll.synchronize(y, root=comm.size - 1, comm=MPI.COMM_WORLD)
    assert y["a"].tolist() == values(comm.size - 1).tolist()


def _trained(rank):
    """A model and an Adam whose lr and state depend on the rank (rank 0: empty state)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.001 * (rank + 1), betas=(0.9, 0.99 - 0.01 * rank))
    torch.manual_seed(100 + rank)
    for _ in range(rank):
        model(torch.randn(8, 3)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_synchronize_torch_optimizer_root_state_wins(comm):
    import torch

    for root in range(comm.size):
        model, opt = _trained(comm.rank)
        coll.synchronize(model, root=root, comm=comm)
        assert coll.synchronize(opt, root=root, comm=comm) is opt
        assert opt.param_groups[0]["lr"] == pytest.approx(0.001 * (root + 1))
        assert opt.param_groups[0]["betas"] == pytest.approx((0.9, 0.99 - 0.01 * root))
        sd = opt.state_dict()
        if root == 0:
            assert sd["state"] == {} and opt.state == {}
        else:
            assert sorted(sd["state"]) == list(range(4))
            for s in sd["state"].values():
                assert float(s["step"]) == root
                assert same_everywhere(comm, s["exp_avg"], s["exp_avg_sq"])
            assert all(opt.state[p]["exp_avg"].shape == p.shape for p in model.parameters())
        # the state is the optimizer's own and usable: one more step keeps the ranks identical
        model(torch.ones(2, 3)).pow(2).mean().backward()
        opt.step()
        assert same_everywhere(comm, *model.parameters())
        for s in opt.state_dict()["state"].values():
            assert same_everywhere(comm, s["exp_avg"]) and float(s["step"]) == root + 1


def test_synchronize_optimizer_and_model_in_one_tree(comm):
    import torch

    torch.manual_seed(comm.rank)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (comm.rank + 1), momentum=0.9)
    model(torch.randn(3, 2)).sum().backward()
    opt.step()
    out = coll.synchronize({"model": model, "opt": opt, "epoch": comm.rank + 5}, comm=comm)
    assert out["model"] is model and out["opt"] is opt and out["epoch"] == 5
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert same_everywhere(comm, *model.parameters())
    assert same_everywhere(comm, *(opt.state[p]["momentum_buffer"] for p in model.parameters()))


# ---------------------------------------------------------------------------------------------------------
# allreduce_tree


def test_allreduce_tree_mean_in_place(comm):
    import torch

    r = comm.rank
    tree = {"w": values(r, 6).reshape(2, 3), "t": torch.from_numpy(values(r, 4, np.float32)).requires_grad_(),
            "n": [values(r, 1), Point(values(r, 2), None)], "loss": float(r), "np": np.float32(r)}
    arrays = [tree["w"], tree["t"], tree["n"][0]]
    out = coll.allreduce_tree(tree, op="mean", comm=comm)
    mean = sum(values(q) for q in range(comm.size)) / comm.size
    np.testing.assert_allclose(out["w"].ravel(), mean[:5].tolist() + [mean[4] + 1])
    np.testing.assert_allclose(out["t"].detach().numpy(), mean[:4])
    assert out["w"] is arrays[0] and out["t"] is arrays[1] and out["n"][0] is arrays[2]
    assert out["n"][1].y is None
    assert type(out["loss"]) is float and out["loss"] == pytest.approx((comm.size - 1) / 2)
    assert type(out["np"]) is np.float32 and out["np"] == pytest.approx((comm.size - 1) / 2)
    assert out["t"].requires_grad


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_allreduce_tree_ops_many_dtypes(comm, op):
    import torch

    r = comm.rank
    tree = {
        "f32": np.full(4, r + 1.0, np.float32), "f64": np.full((2, 2), r + 1.0), "i64": np.full(3, r + 1),
        "f16": np.full(5, r + 1.0, np.float16),
        "bf16": torch.full((3,), r + 1.0, dtype=torch.bfloat16),
        "i32": torch.full((2,), r + 1, dtype=torch.int32),
    }
    if op in ("max", "min"):
        tree["bool"] = np.array([r == 0, True, False])
    ranks = np.arange(1, comm.size + 1, dtype=np.float64)
    want = {"sum": ranks.sum(), "max": ranks.max(), "min": ranks.min(), "prod": ranks.prod()}[op]
    out = coll.allreduce_tree(tree, op=op, comm=comm)
    for k in ("f32", "f64", "i64", "f16"):
        assert (out[k] == want).all(), k
    assert (out["bf16"].float() == want).all() and (out["i32"] == want).all()
    assert out["f16"].dtype == np.float16 and out["bf16"].dtype == torch.bfloat16
    if op == "max":
        assert out["bool"].tolist() == [True, True, False]
    if op == "min":
        assert out["bool"].tolist() == [comm.size == 1, True, False]


def test_allreduce_tree_hundreds_of_leaves_and_buckets(comm):
    import torch

    rng = np.random.default_rng(7)  # same shapes on every rank
    shapes = [tuple(rng.integers(1, 9, size=rng.integers(0, 3))) for _ in range(300)]
    dtypes = [np.float32, np.float64, np.float16, "bf16"]

    def make(rank):
        tree = {}
        for i, shape in enumerate(shapes):
            dt = dtypes[i % 4]
            v = np.full(shape, float(rank + i % 7))
            tree[f"p{i}"] = (torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16) if dt == "bf16"
                             else v.astype(dt))
        tree["big"] = np.full((70, 50), float(rank), np.float32)  # solo with SMALL_BUCKET
        tree["big_f16"] = np.full(8000, float(rank), np.float16)
        return tree

    for bucket in (None, 200, SMALL_BUCKET):
        tree = make(comm.rank)
        out = coll.allreduce_tree(tree, op="sum", comm=comm, bucket_bytes=bucket)
        assert out is tree
        for i in range(len(shapes)):
            got = tree[f"p{i}"]
            got = got.float().numpy() if isinstance(got, torch.Tensor) else got
            assert (got == sum(q + i % 7 for q in range(comm.size))).all(), (bucket, i)
        assert (tree["big"] == sum(range(comm.size))).all()
        assert (tree["big_f16"] == sum(range(comm.size))).all()


def test_allreduce_tree_large_leaf_in_place_default_bucket(comm):
    """A leaf of 1 MiB or more is reduced in its own memory, next to packed small leaves."""
    big = np.full(1 << 17, float(comm.rank), np.float64)  # exactly 1 MiB
    small = np.full(3, float(comm.rank), np.float32)
    out = coll.allreduce_tree({"big": big, "small": small}, op="sum", comm=comm)
    total = sum(range(comm.size))
    assert out["big"] is big and (big == total).all() and out["small"] is small and (small == total).all()


def test_allreduce_tree_matches_allreduce_bit_for_bit(comm):
    import torch

    rng = np.random.default_rng(comm.rank)
    leaves = [rng.standard_normal(n).astype(dt) for n in (3, 50, 1000) for dt in (np.float32, np.float16)]
    leaves.append(torch.from_numpy(rng.standard_normal(77).astype(np.float32)).to(torch.bfloat16))
    singles = [x.clone() if isinstance(x, torch.Tensor) else x.copy() for x in leaves]
    coll.allreduce_tree(leaves, op="mean", comm=comm, bucket_bytes=256)
    for a, b in zip(leaves, singles):
        coll.allreduce(b, op="mean", comm=comm)
        assert bits(a) == bits(b)


def test_allreduce_tree_read_only_strict_and_views(comm):
    import array_api_strict as xs

    ro = np.full(3, float(comm.rank))
    ro.flags.writeable = False
    st = xs.asarray(np.full(4, float(comm.rank)))
    base = np.arange(12.0).reshape(3, 4) * comm.rank
    big_ro = np.full(3000, float(comm.rank))
    big_ro.flags.writeable = False
    tree = {"ro": ro, "strict": st, "view": base[:, 1::2], "big_ro": big_ro}
    out = coll.allreduce_tree(tree, op="sum", comm=comm, bucket_bytes=SMALL_BUCKET)
    total = sum(range(comm.size))
    assert out["ro"] is not ro and ro.tolist() == [comm.rank] * 3 and out["ro"].tolist() == [total] * 3
    assert type(out["strict"]) is type(st) and np.from_dlpack(out["strict"]).tolist() == [total] * 4
    assert out["big_ro"] is not big_ro and (out["big_ro"] == total).all() and (big_ro == comm.rank).all()
    np.testing.assert_array_equal(base[:, 1::2], np.arange(12.0).reshape(3, 4)[:, 1::2] * total)
    np.testing.assert_array_equal(base[:, ::2], np.arange(12.0).reshape(3, 4)[:, ::2] * comm.rank)
    # a result for an immutable leaf is its own memory, not a reused bucket
    again = coll.allreduce_tree({"ro": ro, "strict": st}, op="sum", comm=comm)
    assert out["ro"].tolist() == [total] * 3 and again["ro"] is not out["ro"]


def test_allreduce_tree_same_object_twice_reduced_once(comm):
    x = np.full(3, 1.0)
    big = np.full(3000, 1.0)
    out = coll.allreduce_tree({"a": x, "b": x, "c": [big, big]}, op="sum", comm=comm, bucket_bytes=SMALL_BUCKET)
    assert out["a"] is x and out["b"] is x and x.tolist() == [comm.size] * 3
    assert (big == comm.size).all()


def test_allreduce_tree_module(comm):
    import torch

    torch.manual_seed(comm.rank)
    model = torch.nn.Linear(3, 2)
    w = [p.detach().clone() for p in model.parameters()]
    gathered = gather_objects([t.numpy() for t in w])
    assert coll.allreduce_tree(model, comm=comm) is model
    for i, p in enumerate(model.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), np.mean([g[i] for g in gathered], axis=0), rtol=1e-6)


def test_allreduce_tree_errors_on_every_rank_before_any_data(comm):
    tree = {"w": np.full(2, float(comm.rank)), "count": np.arange(3)}
    with pytest.raises(TypeError, match=r"leaf \['count'\]: op='mean' on integer"):
        coll.allreduce_tree(tree, op="mean", comm=comm)
    assert tree["w"].tolist() == [float(comm.rank)] * 2
    with pytest.raises(TypeError, match=r"leaf \['n'\]: Python int scalar: op='mean'"):
        coll.allreduce_tree({"n": 3}, op="mean", comm=comm)
    with pytest.raises(TypeError, match=r"leaf \['s'\]: cannot reduce a str"):
        coll.allreduce_tree({"s": "text", "w": np.ones(1)}, comm=comm)
    with pytest.raises(ValueError, match="unknown op"):
        coll.allreduce_tree(tree, op="average", comm=comm)
    with pytest.raises(ValueError, match="bucket_bytes"):
        coll.allreduce_tree(tree, op="sum", comm=comm, bucket_bytes=0)
    with pytest.raises(ValueError, match="root="):
        coll.synchronize(tree, root=comm.size, comm=comm)
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(TypeError, match="use synchronize"):
        coll.allreduce_tree({"opt": opt}, comm=comm)
    out = coll.allreduce_tree(tree, op="sum", comm=comm)  # still usable
    assert out["count"].tolist() == [q * comm.size for q in range(3)]


@pytest.mark.skipif("coll.world().size < 2", reason="one process pickles nothing")
def test_error_on_one_rank_only_raises_everywhere(comm):
    """A rank whose tree cannot even be described (or pickled by root) must not leave others waiting."""

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("not picklable")

    leaf = Unpicklable() if comm.rank == 0 else 1
    with pytest.raises((TypeError, coll.CollectiveError)):
        coll.synchronize({"x": leaf, "w": np.ones(2)}, root=0, comm=comm)
    assert coll.allreduce(np.ones(1), comm=comm).tolist() == [comm.size]


# ---------------------------------------------------------------------------------------------------------
# mismatches: every rank raises, nothing changes, the communicator stays usable

needs_two = pytest.mark.skipif("coll.world().size < 2", reason="a mismatch needs two ranks")


def _mismatch(comm, make, call, match):
    tree = make(comm.rank)
    before = {k: np.array(v, copy=True) for k, v in tree.items() if isinstance(v, np.ndarray)}
    with pytest.raises(coll.MismatchError, match=match) as info:
        call(tree)
    for k, v in before.items():
        np.testing.assert_array_equal(tree[k], v, err_msg="nothing may change")
    assert coll.allreduce(np.ones(2), op="sum", comm=comm).tolist() == [comm.size] * 2
    return str(info.value)


@needs_two
@pytest.mark.parametrize("fn", ["synchronize", "allreduce_tree"])
def test_mismatch_other_shape(comm, fn):
    last = comm.size - 1

    def make(r):
        return {"w": np.full((3, 5 if r == last else 4), float(r), np.float32), "b": np.ones(2) * r}

    call = (lambda t: coll.synchronize(t, comm=comm)) if fn == "synchronize" else (
        lambda t: coll.allreduce_tree(t, comm=comm))
    msg = _mismatch(comm, make, call,
                    rf"leaf \['w'\]: ranks? 0[,0-9]* ha(?:s|ve) float32 \(3, 4\), ranks? [0-9,]*{last}[0-9,]* ha(?:s|ve) float32 \(3, 5\)")
    assert f"ranks differing from rank 0: {last}" in msg
    # nested paths are named in full
    with pytest.raises(coll.MismatchError, match=r"leaf \['layer'\]\['w'\]: ranks? 0[,0-9]* ha(?:s|ve) float32 \(3, 4\)"):
        call({"layer": make(comm.rank)})


@needs_two
def test_mismatch_other_dtype(comm):
    def make(r):
        return {"w": np.zeros(3, np.float64 if r == 1 else np.float32)}

    _mismatch(comm, make, lambda t: coll.allreduce_tree(t, comm=comm),
              r"leaf \['w'\]: ranks? 0[,0-9]* ha(?:s|ve) float32 \(3,\), ranks? [0-9,]*1[0-9,]* ha(?:s|ve) float64 \(3,\)")


@needs_two
def test_mismatch_extra_and_missing_key(comm):
    def make(r):
        t = {"w": np.zeros(3)}
        if r == comm.size - 1:
            t["extra"] = np.ones(2)
        return t

    _mismatch(comm, make, lambda t: coll.synchronize(t, comm=comm),
              rf"leaf \['extra'\]: ranks? 0[,0-9]* ha(?:s|ve) no such leaf, ranks? [0-9,]*{comm.size - 1}[0-9,]* ha(?:s|ve) float64 \(2,\)")

    def missing(r):
        t = {"w": np.zeros(3), "gone": np.ones(1)}
        if r == 0:
            del t["gone"]
        return t

    msg = _mismatch(comm, missing, lambda t: coll.allreduce_tree(t, comm=comm),
                    r"leaf \['gone'\]: ranks? 0[,0-9]* ha(?:s|ve) no such leaf, ranks? [0-9,]*1[0-9,]* ha(?:s|ve) float64 \(1,\)")
    if comm.size > 2:
        assert "ranks differing from rank 0: 1, 2" in msg


@needs_two
def test_mismatch_array_vs_object_and_none(comm):
    _mismatch(comm, lambda r: {"w": np.zeros(2), "x": None if r else np.zeros(1)},
              lambda t: coll.allreduce_tree(t, comm=comm),
              r"leaf \['x'\]: ranks? 0[,0-9]* ha(?:s|ve) float64 \(1,\), ranks? [0-9,]*1[0-9,]* ha(?:s|ve) None")
    _mismatch(comm, lambda r: {"w": np.zeros(2), "x": 1 if r else np.zeros(1)},
              lambda t: coll.synchronize(t, comm=comm),
              r"leaf \['x'\]: ranks? 0[,0-9]* ha(?:s|ve) float64 \(1,\), ranks? [0-9,]*1[0-9,]* ha(?:s|ve) a non-array value")


@needs_two
def test_mismatch_of_arguments(comm):
    with pytest.raises(coll.MismatchError, match=r"root: ranks? 0[,0-9]* ha(?:s|ve) 0, ranks? [0-9,]*1[0-9,]* ha(?:s|ve) 1"):
        coll.synchronize({"w": np.zeros(2)}, root=min(comm.rank, 1), comm=comm)
    with pytest.raises(coll.MismatchError, match=r"op: ranks? 0[,0-9]* ha(?:s|ve) 'sum', ranks? [0-9,]*1[0-9,]* ha(?:s|ve) 'max'"):
        coll.allreduce_tree({"w": np.zeros(2)}, op="sum" if comm.rank == 0 else "max", comm=comm)
    with pytest.raises(coll.MismatchError, match=r"bucket_bytes: ranks? 0[,0-9]* ha(?:s|ve) 1000, ranks? [0-9,]*1[0-9,]* ha(?:s|ve) 2000"):
        coll.allreduce_tree({"w": np.zeros(2)}, bucket_bytes=1000 if comm.rank == 0 else 2000, comm=comm)
    # non-array values are not compared (they come from root), their paths are
    out = coll.synchronize({"lr": 0.1 * (comm.rank + 1), "name": "x" * comm.rank}, comm=comm)
    assert out == {"lr": 0.1, "name": ""}


@needs_two
def test_mismatch_dtype_with_illegal_op_on_one_rank(comm):
    """rank 0 holds an int leaf (illegal with mean), the others a float: a mismatch, everywhere."""
    t = {"w": np.zeros(2, np.int64 if comm.rank == 0 else np.float64)}
    with pytest.raises(coll.MismatchError, match=r"leaf \['w'\]: ranks? 0[,0-9]* ha(?:s|ve) int64"):
        coll.allreduce_tree(t, op="mean", comm=comm)
    assert coll.allreduce(np.ones(1), comm=comm).tolist() == [comm.size]


@needs_two
def test_mismatch_optimizer_params(comm):
    import torch

    n = 3 if comm.rank == 0 else 4
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(n))], lr=0.1)
    with pytest.raises(coll.MismatchError, match=r"param_groups\[0\]\['params'\]\[0\]: ranks? 0[,0-9]* ha(?:s|ve) parameter "
                                                 r"float32 \(3,\), ranks? [0-9,]*1[0-9,]* ha(?:s|ve) parameter float32 \(4,\)"):
        coll.synchronize(opt, comm=comm)
    kind = torch.optim.Adam if comm.rank == 0 else torch.optim.AdamW
    opt = kind([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(coll.MismatchError, match="ranks? 0[,0-9]* ha(?:s|ve) a Adam"):
        coll.synchronize(opt, comm=comm)


@needs_two
@pytest.mark.parametrize("fn", ["synchronize", "allreduce_tree"])
def test_mismatch_detected_after_the_structure_was_cached(comm, fn):
    """A repeated call takes its description from the cache; a rank whose tree changed is still caught."""
    call = (lambda t: coll.synchronize(t, comm=comm)) if fn == "synchronize" else (
        lambda t: coll.allreduce_tree(t, op="sum", comm=comm))
    for _ in range(3):  # cached on every rank
        tree = {"w": np.ones((2, 3), np.float32), "b": [np.ones(4)]}
        call(tree)
    last = comm.size - 1

    def make(r):
        return {"w": np.ones((2, 4 if r == last else 3), np.float32), "b": [np.ones(4)]}

    _mismatch(comm, make, call, rf"leaf \['w'\]: ranks? 0[,0-9]* ha(?:s|ve) float32 \(2, 3\), ranks? [0-9,]*{last}[0-9,]* ha(?:s|ve) float32 \(2, 4\)")
    call({"w": np.ones((2, 3), np.float32), "b": [np.ones(4)]})  # the cached structure still works


def test_repeated_calls_on_one_structure_stay_correct(comm):
    """Cached plans: new leaf objects each call, immutable ones among them, every call right."""
    import torch

    total = sum(range(comm.size))
    for step in range(4):
        ro = np.full(3000, float(comm.rank + step))
        ro.flags.writeable = False
        tree = {"big": np.full(5000, float(comm.rank + step)), "ro": ro,
                "t": torch.full((7,), float(comm.rank + step)), "bf": torch.full((3,), 1.0, dtype=torch.bfloat16),
                "s": float(step)}
        out = coll.allreduce_tree(tree, op="sum", comm=comm, bucket_bytes=SMALL_BUCKET)
        want = total + step * comm.size
        assert out["big"] is tree["big"] and (out["big"] == want).all() and (out["ro"] == want).all()
        assert out["ro"] is not ro and (ro == comm.rank + step).all()
        assert (out["t"] == want).all() and out["s"] == step * comm.size
        assert float(out["bf"][0]) == comm.size
        state = {"w": np.full(3000, float(comm.rank + step)), "n": comm.rank}
        out = coll.synchronize(state, root=step % comm.size, comm=comm, bucket_bytes=SMALL_BUCKET)
        assert (out["w"] == step % comm.size + step).all() and out["n"] == step % comm.size


def test_lazily_conjugated_tensors_are_updated_in_place(comm):
    """A conj() view cannot be written through NumPy; torch writes it (packed and solo leaves alike)."""
    import torch

    for n in (3, 3000):  # packed, solo with SMALL_BUCKET
        t = torch.full((n,), complex(comm.rank + 1, 1.0), dtype=torch.complex64).conj()
        out = coll.allreduce_tree({"t": t}, op="sum", comm=comm, bucket_bytes=SMALL_BUCKET)
        assert out["t"] is t and complex(t[-1]) == complex(comm.size * (comm.size + 1) / 2, -comm.size)
        u = torch.full((n,), complex(comm.rank, 1.0), dtype=torch.complex64).conj()
        assert coll.synchronize({"u": u}, root=0, comm=comm, bucket_bytes=SMALL_BUCKET)["u"] is u
        assert complex(u[0]) == complex(0, -1)


def test_synchronize_tied_and_overlapping_leaves(comm):
    """The same array twice (tied weights) and a view inside another leaf: every rank ends with root's
    bytes; receivers never hand MPI a receive datatype whose entries overlap (spare buffers instead)."""
    torch = pytest.importorskip("torch")
    root = comm.size - 1
    w = np.arange(3000.0).reshape(60, 50) + 1000 * comm.rank
    emb = torch.nn.Embedding(40, 8)
    with torch.no_grad():
        emb.weight.fill_(float(comm.rank))
    out = torch.nn.Linear(8, 40, bias=False)
    out.weight = emb.weight  # tied
    tree = {"a": w, "b": w, "inner": w[5:7], "model": torch.nn.ModuleDict({"emb": emb, "out": out})}
    coll.synchronize(tree, root=root, comm=comm)
    np.testing.assert_array_equal(w, np.arange(3000.0).reshape(60, 50) + 1000 * root)
    assert out.weight is emb.weight and bool((emb.weight == root).all())
    host = comm._host
    for types, _spares in getattr(host, "_pipe_typesets", {}).values():
        for t in types:
            blocks = sorted(zip(*(t.decode()[2][k] for k in ("displacements", "blocklengths"))))
            assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(blocks)), "overlapping receive"


def test_sync_pipeline_switch_is_agreed_by_every_rank(comm, monkeypatch):
    """COLLECTIVES_SYNC_PIPELINE=0 on one rank turns the pipeline off on every rank (read when the
    transport starts), so all ranks take the bucket path together."""
    if comm.backend != "mpi":
        pytest.skip("needs the MPI transport")
    from mpi4py import MPI

    if comm.rank == comm.size - 1:
        monkeypatch.setenv("COLLECTIVES_SYNC_PIPELINE", "0")
    mine = MPI.COMM_WORLD.Dup()
    fresh = coll.init(comm=mine)
    try:
        assert fresh._host.can_broadcast_many is False
        tree = {"w": np.full((40, 30), float(comm.rank)), "b": np.arange(5) + comm.rank}
        coll.synchronize(tree, root=0, comm=fresh)
        assert (tree["w"] == 0).all() and (tree["b"] == np.arange(5)).all()
        assert not fresh._host._pipe_plans  # the pipeline was not used
    finally:
        fresh.close()
        mine.Free()

"""The fingerprint beside every non-blocking call describes the caller's call (issue 32), not its wire buffer.

Ranks whose calls travel alike but mean different things raise MismatchError on every rank, on every path
that checks beside the call: asynchronous handles, the deadline transport (its general path and its hot
path, warmed first), the torch backend (its ``ReduceOp.AVG`` and ``PREMUL_SUM`` are ops of their own):

- mean against sum (the sum is what travels);
- dtypes that travel alike: float32 ``min`` against int32 ``min`` (floats' min/max travel as ordered
  int32), bool ``max`` against uint8 ``max``, bfloat16 against float32 ``sum`` (bfloat16 travels in
  float32);
- dtypes whose old code collided: ``<U17`` against ``V4``, ``<i4`` against ``>i4``,
  ``datetime64[s]`` against ``datetime64[ns]`` (broadcast: bytes on the wire); allgather's float32
  against int32, and ``<i4`` against ``>i4`` (bytes on the wire, its hot path included).

Checked mode refuses each of these pairs too (the same description: ``collectives._call``), and calls that
agree still pass on every path. Each scenario runs on a communicator of its own (a failed communicator
cannot be used again).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import collectives as coll
from support.comms import communicator

pytestmark = pytest.mark.skipif(coll.world().size < 2 or coll.world().backend != "mpi",
                                reason="needs two or more MPI ranks")

MODES = ["async", "deadline", "hot", "checked"]

# (name, collective, [(kwargs of the first ranks' call, dtype)], [(the last rank's)]): a pair of calls whose
# wire buffers agree (count, wire dtype, wire op, root) while the calls differ
PAIRS = {
    "mean-sum": ("allreduce", ("mean", "float64"), ("sum", "float64")),
    "f32-i32-min": ("allreduce", ("min", "float32"), ("min", "int32")),
    "bool-u8-max": ("allreduce", ("max", "bool"), ("max", "uint8")),
    "u17-v4": ("broadcast", (None, "<U17"), (None, "V4")),  # one code before issue 32
    "le-be-i4": ("broadcast", (None, "<i4"), (None, ">i4")),
    "s-ns": ("broadcast", (None, "datetime64[s]"), (None, "datetime64[ns]")),
    "reduce-mean-sum": ("reduce", ("mean", "float32"), ("sum", "float32")),
    "reduce-scatter-mean-sum": ("reduce_scatter", ("mean", "float32"), ("sum", "float32")),
    "allgather-f32-i32": ("allgather", (None, "float32"), (None, "int32")),  # bytes on the wire
    "allgather-le-be-i4": ("allgather", (None, "<i4"), (None, ">i4")),
}


def array(dtype: str, size: int, rank: int) -> np.ndarray:
    d = np.dtype(dtype)
    if d.kind in "US":
        return np.array([f"r{rank}-{i}" for i in range(size)], dtype=d)
    if d.kind == "V":
        return np.frombuffer(np.arange(size * d.itemsize, dtype=np.uint8).tobytes(), dtype=d).copy()
    if d.kind == "M":
        return np.arange(size).astype(d)
    return (np.arange(size) % 2 + rank + 1).astype(d)


@contextlib.contextmanager
def fresh(mode: str):
    env = {"COLLECTIVES_TIMEOUT": 60} if mode in ("deadline", "hot") else {}
    with communicator(**env) as c:
        if mode == "checked":
            c.check = True
        yield c


def run_call(c, collective: str, op, x, mode: str):
    kw = {} if op is None else {"op": op}
    fn = getattr(c, collective)
    if mode == "async":
        return fn(x, async_op=True, **kw).wait()
    return fn(x, **kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_calls_that_travel_alike_but_differ_raise_on_every_rank(comm, mode, pair):
    collective, first, last = PAIRS[pair]
    with fresh(mode) as c:
        size = 2 * c.size
        if mode == "hot":  # warm the hot path of both calls on every rank (agreeing calls)
            for op, dtype in (first, last):
                for _ in range(2):
                    run_call(c, collective, op, array(dtype, size, c.rank), mode)
        op, dtype = last if c.rank == c.size - 1 else first
        x = array(dtype, size, c.rank)
        before = x.copy()
        with pytest.raises(coll.MismatchError) as info:
            run_call(c, collective, op, x, mode)
        text = str(info.value)
        assert "disagree" in text
        if mode == "checked":  # refused before anything moved: the data as it was, the communicator usable
            assert x.tobytes() == before.tobytes()
            assert c.allreduce(np.ones(2), "sum").tolist() == [c.size] * 2
        else:  # detected beside the call: the communicator is failed for good
            want = ("op" if first[0] != last[0] else "dtype")
            assert f"{want}: " in text, text
            with pytest.raises(coll.CollectiveError, match="unusable"):
                c.allreduce(np.ones(2), "sum")


@pytest.mark.parametrize("mode", MODES)
def test_agreeing_calls_of_every_pair_pass(comm, mode):
    """The same pairs, made alike on every rank: no false mismatch, the blocking bits."""
    with fresh(mode) as c:
        size = 2 * c.size
        for collective, *calls in PAIRS.values():
            for op, dtype in calls:
                for _ in range(2 if mode == "hot" else 1):
                    x = array(dtype, size, c.rank)
                    got = run_call(c, collective, op, x, mode)
                    if collective == "broadcast":
                        assert got.tobytes() == array(dtype, size, 0).tobytes()


def test_mean_against_sum_names_both_ops(comm):
    with fresh("async") as c:
        x = np.full(4, float(c.rank + 1))
        with pytest.raises(coll.MismatchError, match="op: sum on some ranks, mean on others") as info:
            c.allreduce(x, op="sum" if c.rank else "mean", async_op=True).wait()
        assert "float64" in str(info.value)


torch_pairs = {
    "avg-sum": (("AVG", "float32"), ("SUM", "float32")),
    "int-avg-sum": (("AVG", "int64"), ("SUM", "int64")),
    "premul-sum": (("PREMUL_SUM", "float32"), ("SUM", "float32")),
    "bf16-f32": (("SUM", "bfloat16"), ("SUM", "float32")),
}


def torch_allreduce(pg, op: str, t):
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = (dist._make_nccl_premul_sum(2.0) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op))
    return pg.allreduce([t], opts).wait()


@pytest.mark.parametrize("pair", sorted(torch_pairs))
def test_torch_backend_ops_and_dtypes_of_their_own(comm, pair):
    torch = pytest.importorskip("torch")
    import collectives.torch_backend as ctb

    first, last = torch_pairs[pair]
    with communicator() as c:
        pg = ctb.ProcessGroupCollectives(c)
        op, dtype = last if c.rank == c.size - 1 else first
        # bfloat16 and float32 tensors of the same bytes on the wire: 2 float32 against 2 bfloat16 widened
        t = torch.ones(4, dtype=getattr(torch, dtype))
        with pytest.raises(coll.MismatchError):
            torch_allreduce(pg, op, t)
        with pytest.raises(coll.CollectiveError, match="unusable"):
            torch_allreduce(pg, "SUM", torch.ones(1))


def test_torch_backend_agreeing_ops_pass(comm):
    torch = pytest.importorskip("torch")
    import collectives.torch_backend as ctb

    with communicator() as c:
        pg = ctb.ProcessGroupCollectives(c)
        for op in ("AVG", "SUM", "PREMUL_SUM"):
            for dtype in ("float32", "int64", "bfloat16"):
                if op == "PREMUL_SUM" and dtype == "int64":
                    continue
                t = torch.full((4,), 2, dtype=getattr(torch, dtype))
                torch_allreduce(pg, op, t)
                want = {"AVG": 2, "SUM": 2 * c.size, "PREMUL_SUM": 4 * c.size}[op]
                assert t.tolist() == [want] * 4, (op, dtype, t)


# Gradient buckets and sharded state: every rank makes the same two optimizers (their layouts agreed at
# construction), then the last rank steps the other one. Both buckets carry the same count, dtype and op on
# the wire (a 4x4 layer's two parameters against one of 20 elements), so only the bucket's layout tells the
# calls apart: the fingerprint beside a non-blocking bucket (sharded state's reduce-scatter, compression's
# alltoall), the deadline transport's beside a blocking one (its general path and, warmed, its hot path),
# and checked mode's agreement all carry it (_call.naming(structure=)).
BUCKET_MODES = {
    "sharded": ({}, {"shard_state": True}),
    "compressed": ({}, {"compression": "bf16"}),
    "deadline": ({"COLLECTIVES_TIMEOUT": 60}, {}),
    "deadline-sharded": ({"COLLECTIVES_TIMEOUT": 60}, {"shard_state": True}),
    "hot": ({"COLLECTIVES_TIMEOUT": 60}, {}),
    "checked": ({}, {}),
}


def two_optimizers(c, options):
    import torch

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)  # 16 + 4 elements
    flat = torch.nn.Parameter(torch.ones(20))  # 20 elements

    def layer_loss():
        return layer(torch.ones(2, 4)).sum()

    def flat_loss():  # a new graph each step
        return (flat * (c.rank + 1)).sum()

    models = {"layer": (layer, layer_loss), "flat": (flat, flat_loss)}
    opts = {}
    for name, (m, _) in models.items():
        params = m.parameters() if isinstance(m, torch.nn.Module) else [m]
        opts[name] = coll.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), comm=c, **options)
    return opts, {name: loss for name, (_, loss) in models.items()}


def train_step(opt, loss):
    opt.zero_grad()
    loss().backward()
    opt.step()


@contextlib.contextmanager
def optimizers_in(mode: str, warm: int):
    """A fresh communicator of ``mode`` with the two optimizers on it, each stepped ``warm`` times alike."""
    pytest.importorskip("torch")
    env, options = BUCKET_MODES[mode]
    with communicator(**env) as c:
        if mode == "checked":
            c.check = True
        opts, losses = two_optimizers(c, options)
        for _ in range(warm):
            for name in opts:
                train_step(opts[name], losses[name])
        yield c, opts, losses


@pytest.mark.parametrize("mode", sorted(BUCKET_MODES))
def test_gradient_buckets_of_different_layouts_raise_on_every_rank(comm, mode):
    # "hot": agreeing steps first, so that the buckets' blocking calls take the warmed hot path
    with optimizers_in(mode, warm=2 if mode == "hot" else 0) as (c, opts, losses):
        name = "flat" if c.rank == c.size - 1 else "layer"
        with pytest.raises(coll.MismatchError) as info:
            train_step(opts[name], losses[name])
        assert "disagree" in str(info.value)
        assert "structure" in str(info.value) or "layout" in str(info.value), str(info.value)


@pytest.mark.parametrize("mode", sorted(BUCKET_MODES))
def test_gradient_buckets_of_the_same_layout_pass(comm, mode):
    """The same optimizers stepped alike: no false mismatch, and both averaged."""
    with optimizers_in(mode, warm=3) as (c, opts, _):
        flat = opts["flat"].inner.param_groups[0]["params"][0]
        mean = sum(r + 1 for r in range(c.size)) / c.size  # the flat loss's gradient, averaged
        assert flat.detach().tolist() == pytest.approx([1 - 3 * 0.1 * mean] * 20)

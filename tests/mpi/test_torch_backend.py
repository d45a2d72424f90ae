"""The torch.distributed backend "collectives" at any world size: init without launcher variables, every
operation against a local reference, Work's contract, dtype rules, groups, and DDP/FSDP2 trained to the
same parameters as one process on the whole batch."""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta

import math

import numpy as np
import pytest

import collectives as coll

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


@pytest.fixture(scope="module")
def pg(comm):
    """The default process group of the "collectives" backend, made with no launcher variables."""
    import collectives.torch_backend  # noqa: F401 - registers the backend

    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        assert var not in os.environ, f"{var} is set: this test proves init without it"
    _BEFORE["listening"] = _listening()
    dist.init_process_group("collectives")
    yield dist.distributed_c10d._get_default_group()
    dist.destroy_process_group()


_BEFORE: dict = {}


def _listening() -> set:
    """The local addresses of this process's TCP sockets in state LISTEN (Linux /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and fields[9] in inodes:
                        found.add(fields[1])
    return found


# ---------------------------------------------------------------------------------------------------------
# init and the rendezvous


def test_init_takes_rank_and_size_from_mpi(pg, comm):
    import collectives.torch_backend as ctb

    assert dist.is_initialized() and dist.get_backend() == "collectives"
    assert (dist.get_rank(), dist.get_world_size()) == (comm.rank, comm.size)
    assert isinstance(pg, ctb.ProcessGroupCollectives) and pg.communicator.size == comm.size
    assert pg.communicator is not coll.world()  # its own communicator


def test_register_is_idempotent(pg):
    import importlib

    import collectives.torch_backend as ctb

    env = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers["env"]
    ctb.register()
    ctb.register()
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    assert handlers["env"] is env and not hasattr(env._collectives_wraps, "_collectives_wraps")
    assert dist.Backend.backend_list.count("collectives") == 1


def test_no_listening_socket(pg, comm):
    """init_process_group opened no listening TCP socket (MPI's own, made by coll.init before, aside) and
    the store is no TCP server."""
    assert not isinstance(dist.distributed_c10d._get_default_store(), dist.TCPStore)
    dist.all_reduce(torch.ones(3))
    assert _listening() == _BEFORE["listening"], f"rank {comm.rank}: new listening sockets"


def test_store_is_shared_on_one_node(pg, comm):
    if comm.local_size != comm.size:
        pytest.skip("ranks on several nodes: the store is not shared (documented)")
    store = dist.distributed_c10d._get_default_store()
    store.set(f"k{comm.rank}", str(comm.rank * 7))
    assert [int(store.get(f"k{r}")) for r in range(comm.size)] == [r * 7 for r in range(comm.size)]
    dist.barrier()


def test_rank_given_that_mpi_contradicts_is_refused(pg, comm):
    import collectives.torch_backend as ctb

    with pytest.raises(ValueError, match="MPI says"):
        next(ctb._mpi_rendezvous(f"collectives://?rank={comm.rank + 1}&world_size={comm.size}"))


# ---------------------------------------------------------------------------------------------------------
# the operations


OPS = [("SUM", sum), ("PRODUCT", np.prod), ("MIN", min), ("MAX", max), ("AVG", lambda v: sum(v) / len(v))]


@pytest.mark.parametrize("name,ref", OPS)
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16", "int32"])
def test_all_reduce_ops(pg, comm, name, ref, dtype):
    dt = getattr(torch, dtype)
    vals = [float(r + 2) for r in range(comm.size)]
    t = torch.full((5,), vals[comm.rank], dtype=dt)
    op = getattr(dist.ReduceOp, name)
    if name == "AVG" and not dt.is_floating_point:  # torch's NCCL contract, not our API's refusal (below)
        dist.all_reduce(t, op=op)
        assert (t == math.trunc(sum(vals) / len(vals))).all(), t
        with pytest.raises(TypeError, match="truncate"):
            coll.allreduce(t.clone(), op="mean")
        return
    dist.all_reduce(t, op=op)
    expected = coll.allreduce(torch.full((5,), vals[comm.rank], dtype=dt),
                              op={"SUM": "sum", "PRODUCT": "prod", "MIN": "min", "MAX": "max", "AVG": "mean"}[name])
    assert torch.equal(t, expected)  # the library's bits
    assert np.allclose(t.double().numpy(), ref(vals), rtol=1e-2)


@pytest.mark.parametrize("op", ["SUM", "AVG", "MIN", "MAX", "PRODUCT"])
def test_large_all_reduce_same_bits_as_the_library(pg, comm, op):
    """A CPU all_reduce past the shared-memory threshold (on one node it runs through the node-shared
    window at the call, its Work complete when the call returns) gives the bits of the library's own
    blocking allreduce of the same data: NaN, signed zeros and infinities included, and for the
    coalesced form too."""
    n = 2**17  # 512 KiB of float32: above the default threshold (256 KiB)
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(n, generator=g) * 2.0 ** torch.randint(-8, 8, (n,), generator=g)
    x[:4] = torch.tensor([float("nan"), -0.0, 0.0, float("inf")]) if comm.rank == 0 else torch.tensor([1.0, 0.0, -0.0, 2.0])
    ref = x.clone()
    name = {"SUM": "sum", "AVG": "mean", "MIN": "min", "MAX": "max", "PRODUCT": "prod"}[op]
    comm.allreduce(ref.numpy(), name)
    w = dist.all_reduce(x, op=getattr(dist.ReduceOp, op), async_op=True)
    if comm.local_size == comm.size > 1:
        assert w.is_completed()  # ran at the call
    w.wait()
    assert x.numpy().tobytes() == ref.numpy().tobytes()
    y, z = torch.ones(n // 2) * (comm.rank + 1), torch.ones(n // 2) * (comm.rank + 2)
    dist.all_reduce_coalesced([y, z], op=getattr(dist.ReduceOp, op))
    for t, base in ((y, 1), (z, 2)):
        r = torch.ones(n // 2) * (comm.rank + base)
        comm.allreduce(r.numpy(), name)
        assert torch.equal(t, r)


def test_all_reduce_bool(pg, comm):
    t = torch.tensor([comm.rank == 0, True, False])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.tolist() == [True, True, False]
    t = torch.tensor([comm.rank == 0, True, False])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    assert t.tolist() == [comm.size == 1, True, False]
    with pytest.raises(TypeError):
        dist.all_reduce(torch.ones(2, dtype=torch.bool), op=dist.ReduceOp.SUM)


def test_premul_sum(pg, comm):
    t = torch.full((3,), float(comm.rank + 1), dtype=torch.float64)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    assert torch.equal(t, torch.full((3,), 0.5 * sum(range(1, comm.size + 1)), dtype=torch.float64))


def test_bitwise_ops_refused_before_communication(pg):
    t = torch.ones(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="BAND"):
        dist.all_reduce(t, op=dist.ReduceOp.BAND)
    assert (t == 1).all()


def test_broadcast_and_reduce(pg, comm):
    for root in range(comm.size):
        t = torch.arange(4, dtype=torch.float32) + comm.rank
        dist.broadcast(t, src=root)
        assert torch.equal(t, torch.arange(4, dtype=torch.float32) + root)
        t = torch.full((2,), comm.rank + 1.0)
        dist.reduce(t, dst=root, op=dist.ReduceOp.SUM)
        assert t.tolist() == ([comm.size * (comm.size + 1) / 2] * 2 if comm.rank == root else [comm.rank + 1.0] * 2)


def test_all_gather_forms(pg, comm):
    n = comm.size
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3) + 100 * comm.rank
    outs = [torch.empty(2, 3, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(outs, x)
    for r, o in enumerate(outs):
        assert torch.equal(o, torch.arange(6, dtype=torch.float64).reshape(2, 3) + 100 * r)
    flat = torch.empty(2 * n, 3, dtype=torch.float64)
    dist.all_gather_into_tensor(flat, x)
    assert torch.equal(flat, torch.cat(outs))
    # as FSDP gathers its parameters: the input is this rank's chunk of the output, asynchronous too
    for async_op in (False, True):
        flat = torch.zeros(2 * n * 3, dtype=torch.float64)
        mine = flat[6 * comm.rank:6 * (comm.rank + 1)]
        mine.copy_(x.reshape(-1))
        work = dist.all_gather_into_tensor(flat, mine, async_op=async_op)
        if async_op:
            work.wait()
        assert torch.equal(flat, torch.cat(outs).reshape(-1))
    # an output that is not contiguous: written through a copy, the same values
    cols = torch.zeros(3, 2 * n, dtype=torch.float64).T
    dist.all_gather_into_tensor(cols, x)
    assert torch.equal(cols, torch.cat(outs))
    with pytest.raises(ValueError, match="shape"):
        dist.all_gather([torch.empty(3)] * n, torch.empty(2))


def test_integer_avg_sums_and_truncates_toward_zero_as_torchs_nccl_backend(pg, comm):
    """Lightning's sync_dist averages an int64 batch count with ReduceOp.AVG on every backend but gloo;
    torch's NCCL backend sums and divides, truncating toward zero: so does ours, on every form."""
    n = comm.size
    mine = [-7 * (comm.rank + 1) + 3, 5 * comm.rank + 1]  # negative sums: truncation, not floor
    want = [math.trunc(sum(-7 * (r + 1) + 3 for r in range(n)) / n), math.trunc(sum(5 * r + 1 for r in range(n)) / n)]
    avg = dist.ReduceOp.AVG
    for dtype in (torch.int64, torch.int32, torch.int16):
        t = torch.tensor(mine, dtype=dtype)
        dist.all_reduce(t, op=avg)
        assert t.tolist() == want, (dtype, t)
    a, b = torch.tensor(mine[:1]), torch.tensor(mine[1:])
    dist.all_reduce_coalesced([a, b], op=avg)
    assert [a.item(), b.item()] == want
    r = torch.tensor(mine)
    dist.reduce(r, dst=n - 1, op=avg)
    assert r.tolist() == (want if comm.rank == n - 1 else mine)
    blocks = torch.tensor([mine] * n)
    out = torch.empty(2, dtype=torch.int64)
    dist.reduce_scatter_tensor(out, blocks.reshape(-1), op=avg)
    assert out.tolist() == want


def test_argument_checks_refuse_what_gloo_refuses(pg, comm):
    """Splits that do not add up to dim 0, and outputs of another dtype than the input: refused before any
    communication (gloo refuses all three), never a silent exchange of other blocks or a cast."""
    n = comm.size
    with pytest.raises(ValueError, match="add up to"):
        dist.all_to_all_single(torch.empty(2 * n), torch.empty(2 * n), [1] * n, [1] * n)
    with pytest.raises(TypeError, match="dtype"):
        dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.int64), torch.ones(2 * n))
    with pytest.raises(TypeError, match="dtype"):
        dist.all_gather_into_tensor(torch.empty(2 * n, dtype=torch.int32), torch.ones(2))
    t = torch.ones(3)
    dist.all_reduce(t)  # the group is still usable: nothing was sent
    assert (t == n).all()


def test_reduce_scatter_forms(pg, comm):
    n = comm.size
    x = torch.arange(4 * n, dtype=torch.float64).reshape(2 * n, 2) * (comm.rank + 1)
    total = torch.arange(4 * n, dtype=torch.float64).reshape(2 * n, 2) * (n * (n + 1) / 2)
    out = torch.empty(2, 2, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, x)
    assert torch.equal(out, total[2 * comm.rank: 2 * comm.rank + 2])
    out2 = torch.empty(2, 2, dtype=torch.float64)
    dist.reduce_scatter(out2, list(x.chunk(n)))
    assert torch.equal(out2, out)
    avg = torch.empty(2, 2, dtype=torch.float64)
    dist.reduce_scatter_tensor(avg, x, op=dist.ReduceOp.AVG)
    assert torch.allclose(avg, out / n, rtol=1e-15)
    assert torch.equal(x, torch.arange(4 * n, dtype=torch.float64).reshape(2 * n, 2) * (comm.rank + 1))


def test_all_to_all_forms(pg, comm):
    n = comm.size
    x = torch.tensor([10.0 * comm.rank + j for j in range(n)])
    out = torch.empty(n)
    dist.all_to_all_single(out, x)
    assert out.tolist() == [10.0 * i + comm.rank for i in range(n)]
    outs = [torch.empty(2) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((2,), 10.0 * comm.rank + j) for j in range(n)])
    assert [o[0].item() for o in outs] == [10.0 * i + comm.rank for i in range(n)]  # uneven: test_torch_clients


def test_gather_scatter(pg, comm):
    n = comm.size
    root = n - 1
    g = [torch.empty(2) for _ in range(n)] if comm.rank == root else None
    dist.gather(torch.full((2,), float(comm.rank)), g, dst=root)
    if comm.rank == root:
        assert [t[0].item() for t in g] == list(range(n))
    out = torch.empty(3)
    dist.scatter(out, [torch.full((3,), 5.0 + r) for r in range(n)] if comm.rank == root else None, src=root)
    assert out.tolist() == [5.0 + comm.rank] * 3


def test_coalesced_and_object_collectives(pg, comm):
    ts = [torch.full((3,), float(comm.rank)), torch.full((2, 2), 1.0)]
    dist.all_reduce_coalesced(ts)
    assert ts[0].tolist() == [float(sum(range(comm.size)))] * 3 and (ts[1] == comm.size).all()
    objs = [{"rank": comm.rank}, "x"] if comm.rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    assert objs == [{"rank": 0}, "x"]
    got = [None] * comm.size
    dist.all_gather_object(got, ("r", comm.rank))
    assert got == [("r", r) for r in range(comm.size)]
    gathered = [None] * comm.size if comm.rank == 0 else None
    dist.gather_object(comm.rank * 3, gathered, dst=0)
    if comm.rank == 0:
        assert gathered == [r * 3 for r in range(comm.size)]
    out = [None]
    dist.scatter_object_list(out, [f"o{r}" for r in range(comm.size)] if comm.rank == 0 else None, src=0)
    assert out == [f"o{comm.rank}"]


# (point-to-point, offered since issue 24: tests/mpi/test_torch_p2p.py)


# ---------------------------------------------------------------------------------------------------------
# Work


def test_work_contract(pg, comm):
    import collectives.torch_backend as ctb

    t = torch.full((1000,), float(comm.rank))
    w = dist.all_reduce(t, async_op=True)
    assert isinstance(w, ctb.Work)
    assert isinstance(w.is_completed(), bool)
    assert w.wait() is True and w.is_completed()
    assert (t == sum(range(comm.size))).all()
    fut = w.get_future()
    assert fut.done() and fut.wait()[0] is t
    assert w.wait() is True and w.exception() is None  # again: the same


def test_future_of_pending_work(pg, comm):
    t = torch.full((4,), 1.0)
    w = dist.all_reduce(t, async_op=True)
    fut = w.get_future()
    assert fut.done() and torch.equal(fut.value()[0], torch.full((4,), float(comm.size)))
    assert w.is_completed()


def test_works_waited_out_of_order(pg, comm):
    ts = [torch.full((8,), float(comm.rank + i)) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in reversed(works):
        w.wait()
    for i, t in enumerate(ts):
        assert (t == sum(r + i for r in range(comm.size))).all()


@pytest.mark.skipif("coll.world().size < 2", reason="a wait that times out needs a rank that does not call")
@pytest.mark.parametrize("bound", ["timeout=", "COLLECTIVES_TIMEOUT"])
@pytest.mark.parametrize("n", [2, 2**17], ids=["small", "shared-memory"])
def test_wait_timeout_bounds_wait(comm, bound, n, monkeypatch):
    """torch's timeout= and COLLECTIVES_TIMEOUT bound wait(): a collective rank 0 alone issues raises
    CollectiveTimeoutError there; the group is failed for good (the same error again, and every later
    operation raises at the call), and the tensor never receives another call's data. Also for a
    512 KiB allreduce, which on one node runs through the node-shared window at the call: its waits are
    bounded alike."""
    import collectives.torch_backend as ctb

    from support.comms import communicator

    with communicator() as d:  # a communicator of its own: the unmatched call must not disturb the others
        d.check = False  # checked mode agrees at the call, a blocking step the unmatched call would wait in
        if bound == "timeout=":
            group = ctb.ProcessGroupCollectives(d, timeout=timedelta(seconds=0.3))
        else:
            monkeypatch.setenv("COLLECTIVES_TIMEOUT", "0.3")
            group = ctb.ProcessGroupCollectives(d)  # no timeout of its own: the variable, read as it is made
        if d.rank == 0:
            t = torch.ones(n)
            w = group.allreduce([t], None)
            with pytest.raises(coll.CollectiveTimeoutError, match="0.3 s"):
                w.wait()
            with pytest.raises(coll.CollectiveTimeoutError):
                w.wait()  # the same error again
        comm.barrier()
        if d.rank != 0:  # the matching call, late: rank 0 has given up (it may or may not complete here)
            with contextlib.suppress(coll.CollectiveError):
                d.allreduce(torch.ones(n), async_op=True).wait(timeout=1.0)
        comm.barrier()
        if d.rank == 0:
            with pytest.raises(coll.CollectiveError, match="unusable"):
                group.allreduce([torch.ones(n)], None)
            # MPI cannot cancel a started collective: t holds its own value or that call's own result
            # (the late ranks' arrival completed it), never another call's data
            assert (t == 1).all() or (t == d.size).all()


@pytest.mark.parametrize("n", [2, 2**17], ids=["small", "shared-memory"])
def test_an_op_torch_waits_for_at_once_is_made_at_the_call_and_bounded(comm, n):
    """async_op=False (the options' asyncOp): on a group whose communicator bounds its calls (split with the
    group's timeout=, as init_process_group and new_group make it) the op runs at the call and its Work is
    complete; a rank whose peers never call raises CollectiveTimeoutError at the call, within the bound, and
    the group stays failed."""
    import collectives.torch_backend as ctb

    from support.comms import communicator

    with communicator() as d:
        d.check = False
        sub = d.split(0, d.rank, timeout=0.3)
        group = ctb.ProcessGroupCollectives(sub, timeout=timedelta(seconds=0.3))
        try:
            opts = dist.AllreduceOptions()
            opts.asyncOp = False
            t = torch.ones(n)
            w = group.allreduce([t], opts)
            assert w.is_completed() and (t == d.size).all()
            assert w.get_future().wait()[0] is t
            opts.asyncOp = True  # async_op=True: a pending Work, as before
            t = torch.ones(n)
            assert group.allreduce([t], opts).wait() and (t == d.size).all()
            if d.size > 1:
                opts.asyncOp = False
                if d.rank == 0:
                    t0 = time.monotonic()
                    with pytest.raises(coll.CollectiveTimeoutError, match="0.3 s"):
                        group.allreduce([torch.ones(n)], opts)  # the others never call it
                    assert time.monotonic() - t0 < 10
                    with pytest.raises(coll.CollectiveError):
                        group.allreduce([torch.ones(n)], opts)  # failed for good
                comm.barrier()
                if d.rank != 0:  # the matching call, late: completes what rank 0 left pending in MPI
                    with contextlib.suppress(coll.CollectiveError):
                        sub.allreduce(torch.ones(n), async_op=True).wait(timeout=1.0)
                comm.barrier()
        finally:
            group.shutdown()


# ---------------------------------------------------------------------------------------------------------
# groups


def test_new_group(pg, comm):
    members = list(range(0, comm.size, 2))  # the even ranks
    g = dist.new_group(members)
    if comm.rank in members:
        t = torch.full((2,), float(comm.rank))
        dist.all_reduce(t, group=g)
        assert t.tolist() == [float(sum(members))] * 2
        assert dist.get_world_size(g) == len(members) and dist.get_rank(g) == members.index(comm.rank)
    else:
        assert g == dist.GroupMember.NON_GROUP_MEMBER
    dist.barrier()
    if comm.rank in members:
        dist.destroy_process_group(g)


def test_gloo_group_on_the_same_store(pg, comm):
    """The job's store is a real store on one node: torch sets a gloo group up through it."""
    if comm.local_size != comm.size:
        pytest.skip("ranks on several nodes: the store is not shared (documented)")
    g = dist.new_group(backend="gloo")
    t = torch.full((3,), float(comm.rank))
    dist.all_reduce(t, group=g)
    assert (t == sum(range(comm.size))).all()
    dist.destroy_process_group(g)


def test_new_subgroups(pg, comm):
    g, _ = dist.new_subgroups(group_size=1)
    t = torch.full((1,), float(comm.rank))
    dist.all_reduce(t, group=g)
    assert t.item() == comm.rank


# ---------------------------------------------------------------------------------------------------------
# DDP: trained as one process on the whole batch, to float64 round-off


class _Net(torch.nn.Module):
    """An MLP whose middle layer a step may skip (``skip=True``): find_unused_parameters' case."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (torch.nn.Linear(7, 33), torch.nn.Linear(33, 17), torch.nn.Linear(17, 17),
                                          torch.nn.Linear(17, 3))

    def forward(self, x, skip=False):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        if not skip:
            h = torch.tanh(self.c(h))
        return self.d(h)


def _net(seed):
    torch.manual_seed(seed)
    return _Net().double()


def _batch(step, n, per_rank=4):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(n * per_rank, 7, generator=g, dtype=torch.float64),
            torch.randn(n * per_rank, 3, generator=g, dtype=torch.float64))


def _assert_same(model, reference, what):
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-12, atol=1e-13,
                                   err_msg=f"{what}: {name}")


def _train(model, opt, steps, n, rank, micro, skip, no_sync=None):
    """``steps`` optimizer steps on ``micro`` micro-batches each; this rank's rows of the global batch (all
    rows for the one-process reference, ``rank=None``)."""
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = _batch(step * micro + m, n)
            if rank is not None:
                x, y = x[4 * rank: 4 * rank + 4], y[4 * rank: 4 * rank + 4]
            if no_sync is not None and m < micro - 1:
                with no_sync():  # accumulate locally; the last micro-batch reduces the sum
                    torch.nn.functional.mse_loss(model(x, skip(step)), y).backward()
            else:
                torch.nn.functional.mse_loss(model(x, skip(step)), y).backward()
        opt.step()


@pytest.mark.parametrize("mode", ["plain", "gradient_as_bucket_view", "no_sync", "find_unused_parameters"])
def test_ddp_equals_one_process(pg, comm, mode):
    from torch.nn.parallel import DistributedDataParallel as DDP

    n, steps = comm.size, 4
    model = DDP(_net(seed=comm.rank),  # every rank starts elsewhere: DDP's broadcast makes them rank 0's
                bucket_cap_mb=1e-3, gradient_as_bucket_view=mode == "gradient_as_bucket_view",
                find_unused_parameters=mode == "find_unused_parameters")
    micro = 2 if mode == "no_sync" else 1
    skip = (lambda step: step % 2 == 1) if mode == "find_unused_parameters" else (lambda step: False)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), steps, n, comm.rank, micro, skip,
           model.no_sync if mode == "no_sync" else None)
    buckets = model.reducer._get_zeros_like_grad_buckets()  # rebuilt after the first step, by bucket_cap_mb
    assert len(buckets) >= 3, f"{len(buckets)} bucket(s): bucket_cap_mb should have made several"
    ref = _net(seed=0)  # rank 0's initial parameters, the whole batch in one process
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), steps, n, None, micro, skip)
    _assert_same(model.module, ref, f"DDP {mode} at {n} ranks")


# ---------------------------------------------------------------------------------------------------------
# FSDP2: fully_shard on CPU with Adam, trained as one process on the whole batch


def _seq(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 12), torch.nn.Tanh(), torch.nn.Linear(12, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 3)).double()


def test_fsdp2_adam_equals_one_process(pg, comm):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    n = comm.size
    model = _seq(seed=0)  # FSDP2 shards the parameters it is given: every rank starts from the same
    mesh = init_device_mesh("cpu", (n,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref = _seq(seed=0)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(4):
        x, y = _batch(step, n)
        mine = slice(4 * comm.rank, 4 * comm.rank + 4)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()  # reduce-scatter of the gradients
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert isinstance(p, DTensor)
        shard = q.detach().chunk(n)[comm.rank] if comm.rank < len(q.chunk(n)) else q.detach()[:0]
        np.testing.assert_allclose(p.to_local().detach().numpy(), shard.numpy(), rtol=1e-12, atol=1e-14, err_msg=name)
        np.testing.assert_allclose(p.full_tensor().detach().numpy(), q.detach().numpy(), rtol=1e-12, atol=1e-14,
                                   err_msg=name)

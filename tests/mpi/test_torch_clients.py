"""What the software built on torch.distributed needs of the backend "collectives" (issue 24), at any
world size: the rendezvous under an MPI launcher that exported MASTER_ADDR but no RANK (accelerate's
mpirun form), the group's device types (DCP), DCP's save/load/async_save/broadcast_from_rank0, uneven
all_gather and all_to_all checked as gloo checks them, and the node-shared-memory allreduce through
dist.all_reduce. The clients themselves (Lightning, accelerate) run in tests/clients."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

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
    dist.init_process_group("collectives")
    yield dist.distributed_c10d._get_default_group()
    dist.destroy_process_group()


@pytest.fixture
def shared_dir(comm):
    """A directory every rank sees (one node: the temporary directory), removed afterwards."""
    path = comm.broadcast_object(tempfile.mkdtemp(prefix="collectives-dcp-") if comm.rank == 0 else None)
    yield path
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# the rendezvous


def _free_port(comm) -> int:
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return comm.broadcast_object(port)


def test_master_addr_without_rank_takes_the_ranks_from_mpi(pg, comm, monkeypatch):
    """accelerate launch --mpirun_hostfile exports MASTER_ADDR/MASTER_PORT but not RANK: under an MPI
    launcher env:// then gives MPI's rank and size, with torch's TCPStore at MASTER_ADDR (shared by every
    rank). Without the backend, torch's env:// fails with "environment variable RANK expected"."""
    from collectives import _launcher

    if _launcher.started_by() is None:
        pytest.skip("not started by an MPI launcher (plain python): env:// is torch's own then")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port(comm)))
    store, rank, size = next(dist.rendezvous("env://", timeout=__import__("datetime").timedelta(seconds=60)))
    assert (rank, size) == (comm.rank, comm.size)
    assert isinstance(store, dist.TCPStore)
    store.set(f"r{rank}", str(rank + 40))
    assert [int(store.get(f"r{r}")) for r in range(size)] == [r + 40 for r in range(size)]
    comm.barrier()
    del store


def test_rendezvous_precedence(pg, comm, monkeypatch):
    """The documented order (docs/torch-distributed.md): torch's own env:// where torch knows the rank
    (RANK or rank=) and MASTER_ADDR/PORT are set; MPI's ranks with torch's TCPStore where only MASTER_ADDR/
    PORT are set under an MPI launcher; MPI's ranks and the serverless store where MASTER_ADDR is unset.
    (_rendezvous_kind is private: the env handler's choice is not observable without a second init.)"""
    from collectives import _launcher, torch_backend as ctb

    launched = _launcher.started_by() is not None
    assert ctb._rendezvous_kind("env://") == "mpi"
    assert ctb._rendezvous_kind(f"env://?rank={comm.rank}&world_size={comm.size}") == "mpi"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert ctb._rendezvous_kind("env://") == ("mpi+tcp" if launched else "torch")
    assert ctb._rendezvous_kind("env://?rank=0&world_size=1") == "torch"
    monkeypatch.setenv("RANK", str(comm.rank))
    assert ctb._rendezvous_kind("env://") == "torch"
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("WORLD_SIZE", str(comm.size + 1))  # a size MPI contradicts: refused, before any store
    with pytest.raises(ValueError, match="MPI says"):
        ctb._with_mpi_ranks("env://")


def test_store_file_has_no_name(pg, comm, shared_dir, monkeypatch):
    """On one node the FileStore's file is reached through rank 0's descriptor: no name is left in the
    temporary directory for a crash to leave behind (tests/crash kills rank 0 to prove it)."""
    from collectives import torch_backend as ctb

    if comm.size == 1 or comm.local_size != comm.size:
        pytest.skip("one process (HashStore) or several nodes (no FileStore)")
    monkeypatch.setattr(tempfile, "tempdir", shared_dir)  # a temporary directory of this test's own
    path = ctb._store_file(coll.world())  # private: the path is not visible through torch's PrefixStore
    assert path.startswith("/proc/") and os.access(path, os.R_OK | os.W_OK)
    store = dist.FileStore(path, comm.size)
    store.set(f"k{comm.rank}", "x")
    assert [store.get(f"k{r}") for r in range(comm.size)] == [b"x"] * comm.size
    comm.barrier()
    assert os.listdir(shared_dir) == []
    del store


# ---------------------------------------------------------------------------------------------------------
# DCP


def test_device_types(pg):
    assert torch.device("cpu") in pg._device_types and pg._device_types[0] == torch.device("cpu")
    assert dist.distributed_c10d._get_pg_default_device(pg) == torch.device("cpu")


def _linear(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def test_set_model_state_dict_broadcast_from_rank0(pg, comm):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = _linear(seed=comm.rank)
    full = _linear(seed=0).state_dict() if comm.rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for (name, p), q in zip(model.state_dict().items(), _linear(seed=0).state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_dcp_save_load_and_async_save(pg, comm, shared_dir):
    import torch.distributed.checkpoint as dcp

    model = _linear(seed=0)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(shared_dir, "sync"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the same on every rank: DCP writes a replicated tensor once
    future = dcp.async_save({"model": model.state_dict()}, checkpoint_id=os.path.join(shared_dir, "async"))
    future.result()  # the save's collectives run in DCP's thread: none of our own meanwhile (docs)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(shared_dir, "sync"))
    model.load_state_dict(sd["model"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(shared_dir, "async"))
    for k, v in sd["model"].items():
        assert torch.equal(v, want[k] + 1.0), k


# ---------------------------------------------------------------------------------------------------------
# uneven all_gather and all_to_all (torch's NCCL backend takes them; gloo only all_to_all_single's splits)


def _rows(src, dst):
    """How many rows rank src sends rank dst in the uneven tests (zero included)."""
    return (src + 2 * dst) % 3


def _block(src, dst, width=2):
    k = _rows(src, dst)
    return (100.0 * src + 10.0 * dst + torch.arange(k * width, dtype=torch.float64)).reshape(k, width)


def test_all_gather_uneven(pg, comm):
    n, me = comm.size, comm.rank
    x = torch.full((me, 3), float(me), dtype=torch.float64)  # rank 0 gives nothing
    outs = [torch.empty(r, 3, dtype=torch.float64) for r in range(n)]
    dist.all_gather(outs, x)
    for r, o in enumerate(outs):
        assert torch.equal(o, torch.full((r, 3), float(r), dtype=torch.float64)), r
    assert torch.equal(x, torch.full((me, 3), float(me), dtype=torch.float64))  # the input untouched


def test_all_to_all_single_uneven(pg, comm):
    n, me = comm.size, comm.rank
    x = torch.cat([_block(me, j) for j in range(n)])
    out = torch.full((sum(_rows(i, me) for i in range(n)), 2), -1.0, dtype=torch.float64)
    dist.all_to_all_single(out, x, [_rows(i, me) for i in range(n)], [_rows(me, j) for j in range(n)])
    assert torch.equal(out, torch.cat([_block(i, me) for i in range(n)]))
    # splits on one side only: the other side's equal blocks
    got = torch.empty(n, 2)
    dist.all_to_all_single(got, torch.full((n, 2), float(me)), [1] * n, None)
    assert got[:, 0].tolist() == [float(i) for i in range(n)]


def test_all_to_all_list_uneven(pg, comm):
    n, me = comm.size, comm.rank
    outs = [torch.empty(_rows(i, me), 2, dtype=torch.float64) for i in range(n)]
    dist.all_to_all(outs, [_block(me, j) for j in range(n)])
    for i, o in enumerate(outs):
        assert torch.equal(o, _block(i, me)), i


def test_bad_splits_refused_as_gloo_refuses_them(pg, comm):
    """gloo's checks of all_to_all_single, before any communication: as many splits as ranks, none
    negative, adding up to dim 0; without splits dim 0 divides by the size."""
    n = comm.size
    x = torch.ones(2 * n)
    bad = [([2 * n] + [0] * n, "Number of tensor splits"),  # one split too many
           ([1] * n, "Split sizes doesn't match")]  # add up to n, not 2n
    if n > 1:
        bad.append(([-1] * (n - 1) + [2 * n + n - 1], "negative"))
    for splits, match in bad:
        with pytest.raises(ValueError, match=match):
            dist.all_to_all_single(torch.empty(2 * n), x, None, splits)
    if n > 1:
        with pytest.raises(ValueError, match="divisible"):
            dist.all_to_all_single(torch.empty(2 * n + 1), torch.ones(2 * n + 1))
    with pytest.raises(ValueError, match="shape"):
        dist.all_gather([torch.empty(3)] * n, torch.empty(2))  # this rank's own block must be its input's
    t = torch.ones(3)
    dist.all_reduce(t)  # nothing was sent: the group is usable
    assert (t == n).all()


@pytest.mark.skipif("coll.world().size < 2", reason="a disagreement needs two ranks")
def test_sizes_the_ranks_disagree_about_are_a_mismatch_on_every_rank(pg, comm):
    """Rank 0 expects one row more from rank 1 than rank 1 sends: a MismatchError on every rank (torch's
    NCCL backend would hang or write garbage), before the data moves; then the group still works."""
    n, me = comm.size, comm.rank
    recv = [2] * n
    if me == 0:
        recv[1] = 3
    out = torch.full((sum(recv),), 7.0)
    with pytest.raises(coll.MismatchError, match="rank 1 sends 2 elements to rank 0, which expects 3"):
        dist.all_to_all_single(out, torch.ones(2 * n), recv, [2] * n)
    assert (out == 7.0).all()
    outs = [torch.empty(2 + r + (me == 0 and r == 1)) for r in range(n)]  # uneven: every rank agrees sizes
    with pytest.raises(coll.MismatchError, match="rank 0's tensor_list expects 4 elements from rank 1"):
        dist.all_gather(outs, torch.ones(2 + me))
    t = torch.ones(3)
    dist.all_reduce(t)
    assert (t == n).all()
    # rank 0 alone expects uneven sizes, the others gather equal blocks at once: two different calls,
    # found beside them (the fingerprint) on every rank, which leaves that group unusable: a group of its own
    g = dist.new_group(list(range(n)))
    outs = [torch.empty(2 if (me, r) != (0, 1) else 3) for r in range(n)]
    with pytest.raises(coll.MismatchError):
        dist.all_gather(outs, torch.ones(2), group=g)
    dist.destroy_process_group(g)

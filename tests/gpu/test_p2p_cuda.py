"""Point-to-point of CUDA arrays (coll.send/coll.recv, and dist.send/recv through the torch backend) on the
device transports: NCCL (ncclSend/ncclRecv after a description by the host path) and host staging. Run by
scripts/gpu_check.sh at 1 rank (the refusals) and 2 ranks (NCCL; COLLECTIVES_DISABLE_NCCL=1: staging)."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as coll


def test_ring_of_cuda_arrays(comm, dev):
    if comm.size < 2:
        pytest.skip("a CUDA message needs another rank (NCCL sends nothing to itself alone)")
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for dtype in ("float32", "int64", "bfloat16") if dev.has("bfloat16") else ("float32", "int64"):
        x = dev.make(np.arange(1000) + 1000 * comm.rank, dtype)
        y = dev.make(np.zeros(1000), dtype)
        h = coll.send(x, right, tag=3, async_op=True)
        assert coll.recv(y, left, tag=3) == left
        h.wait()
        dev.synchronize()
        assert (dev.to_numpy(y) == np.arange(1000) + 1000 * left).all() if dtype != "bfloat16" else \
            np.allclose(dev.to_numpy(y), (np.arange(1000) + 1000 * left), rtol=1e-2)
    # asynchronous receives too, posted after the sends, waited in reverse order
    outs = [dev.make(np.zeros(64), "float32") for _ in range(3)]
    sends = [coll.send(dev.make(np.full(64, 10.0 * comm.rank + k), "float32"), right, 4, async_op=True)
             for k in range(3)]
    recvs = [coll.recv(o, left, 4, async_op=True) for o in outs]
    for k in reversed(range(3)):
        assert recvs[k].wait() == left
    for h in sends:
        h.wait()
    dev.synchronize()
    assert all((dev.to_numpy(o) == 10.0 * left + k).all() for k, o in enumerate(outs))


def test_a_cuda_message_that_does_not_fit_is_refused(comm, dev):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    h = coll.send(dev.make(np.ones(5), "float32"), right, 6, async_op=True)
    y = dev.make(np.full(4, -1.0), "float32")
    with pytest.raises(ValueError, match="5 x float32"):
        coll.recv(y, left, 6)
    h.wait()
    dev.synchronize()
    assert (dev.to_numpy(y) == -1).all()
    h = coll.send(dev.make(np.ones(4), "float32"), right, 6, async_op=True)  # still usable
    assert coll.recv(y, left, 6) == left
    h.wait()
    dev.synchronize()
    assert (dev.to_numpy(y) == 1).all()


def test_dist_send_recv_on_cuda(comm, dev):
    if dev.name != "torch" or comm.size < 2:
        pytest.skip("torch.distributed on two ranks")
    import torch
    import torch.distributed as dist

    import collectives.torch_backend  # noqa: F401

    if not dist.is_initialized():
        dist.init_process_group("collectives")
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    t = torch.full((100,), float(comm.rank), device=f"cuda:{dev.index}")
    got = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, right), dist.P2POp(dist.irecv, got, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    torch.cuda.synchronize()
    assert (got == left).all()
    dist.destroy_process_group()

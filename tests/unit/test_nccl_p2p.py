"""The NCCL transport's point-to-point (coll.send/coll.recv of CUDA arrays), with torch CPU tensors
standing in for CUDA tensors and a stand-in libnccl (test_cuda_unit's FakeNCCL): the description that
travels by the host path first, the ncclSend/ncclRecv it enqueues (each in a group), a message that does
not fit (received into scratch memory, then the host path's error, the array untouched), the refusals.
On a GPU, scripts/gpu_check.sh runs the real thing."""

from __future__ import annotations

import numpy as np
import pytest
from test_cuda_unit import FakeComm, FakeNCCL, FakeTorch, memory, needs_torch, torch

from collectives._backends import _libnccl
from collectives._p2p import p2p_fields, p2p_header

pytestmark = needs_torch


class _Sent:
    def done(self):
        return True


class P2PComm(FakeComm):
    """An Engine stand-in whose host path (``Engine.staged``) carries the descriptions (a list each way)."""

    def __init__(self, size=3, rank=0):
        super().__init__(size, rank)
        self.sent, self.incoming = [], []

    def staged(self, collective, x, *args, async_op=False):
        if collective == "send":
            dst, tag = args
            self.sent.append((x.clone() if isinstance(x, torch.Tensor) else x.copy(), dst, tag, async_op))
            return _Sent()
        assert collective == "recv" and not async_op, collective
        src, tag = args
        x[...] = self.incoming.pop(0)
        return src


class P2PNCCL(FakeNCCL):
    """A lone receive gets 0x5A bytes (what the sender sent)."""

    def group_end(self):
        self.calls.append(("group_end",))
        for ptr, count, _peer in self._recvs:
            memory(ptr, count, np.uint8)[...] = 0x5A
        self._recvs, self._sends = (), {}
        return self.status


def transport(rank=0):
    from collectives._backends.nccl import NCCLTransport

    lib = P2PNCCL(3, rank)
    comm = P2PComm(3, rank)
    t = NCCLTransport(comm, 0, lib, FakeTorch(), timeout=5.0)
    t._library_of = lambda x: FakeTorch()
    return t, lib, comm


def p2p_calls(lib):
    return [c[0] for c in lib.calls if c[0] in ("group_start", "send", "recv", "group_end")]


def test_send_describes_then_enqueues_one_grouped_ncclsend():
    t, lib, comm = transport()
    x = torch.arange(6, dtype=torch.float32)
    t.send(x, None, 2, 7)
    (header, dst, tag, async_op), = comm.sent
    assert (dst, tag, async_op) == (2, 7, True)  # the description never waits for the receiver
    assert p2p_fields(header)[0:2] == (24, 6) and p2p_fields(header)[4] == "float32"
    assert p2p_calls(lib) == ["group_start", "send", "group_end"]
    send = next(c for c in lib.calls if c[0] == "send")
    assert send[1:5] == (x.data_ptr(), 24, _libnccl.ncclUint8, 2) and send[6] == 0x5EA  # the caller's stream


def test_recv_checks_the_description_then_receives_from_its_sender():
    t, lib, comm = transport()
    x = torch.zeros(4, dtype=torch.int32)
    comm.incoming.append(p2p_header(4, 16, "int32", 0, 16))
    box = [None]
    t.recv(x, None, 1, 3, box)
    recv = next(c for c in lib.calls if c[0] == "recv")
    assert recv[1:5] == (x.data_ptr(), 16, _libnccl.ncclUint8, 1) and box == [1]
    assert (x.numpy().view(np.uint8) == 0x5A).all()
    # a non-contiguous receive view: into a temporary, copied back into the view's elements only
    base = torch.zeros(4, 2, dtype=torch.int32)
    comm.incoming.append(p2p_header(4, 16, "int32", 0, 16))
    t.recv(base[:, 0], None, 2, 3, box)
    assert (base[:, 1] == 0).all() and (base[:, 0] == 0x5A5A5A5A).all() and box == [2]


@pytest.mark.parametrize("sent, error", [((5, 20, "int32"), ValueError), ((4, 16, "float32"), TypeError)])
def test_a_message_that_does_not_fit_is_received_into_scratch_then_refused(sent, error):
    t, lib, comm = transport()
    x = torch.full((4,), -1, dtype=torch.int32)
    count, nbytes, name = sent
    comm.incoming.append(p2p_header(count, nbytes, name, 0, nbytes))
    with pytest.raises(error, match=f"rank 1 sent {count} x {name}"):
        t.recv(x, None, 1, 0, [None])
    recv = next(c for c in lib.calls if c[0] == "recv")
    assert recv[2] == nbytes and recv[1] != x.data_ptr()  # the sender's bytes, not into x: its stream completes
    assert (x == -1).all()


def test_any_source_and_itself_are_refused_before_anything():
    t, lib, comm = transport(rank=0)
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="any-source"):
        t.recv(x, None, None, 0, [None])
    with pytest.raises(ValueError, match="itself"):
        t.send(x, None, 0, 0)
    with pytest.raises(ValueError, match="itself"):
        t.recv(x, None, 0, 0, [None])
    assert p2p_calls(lib) == [] and comm.sent == []


def test_the_default_device_path_stages_through_the_host_path():
    """A device transport without point-to-point of its own (host staging, CUDA-aware MPI) sends a host copy
    by the host path's send and receives into one by its recv (``Engine.staged``: blocking, both)."""
    from collectives._backends.device import DeviceTransport

    class Staged(DeviceTransport):
        broadcast = allreduce = reduce = allgather = reduce_scatter = alltoall = None

    comm = P2PComm(3, 0)
    t = Staged(comm, 0)
    t._library_of = lambda x: FakeTorch()
    t.send(torch.ones(3), None, 1, 4)
    assert comm.sent[0][1:] == (1, 4, False) and (comm.sent[0][0] == 1).all()
    comm.incoming.append(torch.full((3,), 2.0))
    y = torch.zeros(3)
    box = [None]
    t.recv(y, None, 2, 4, box)
    assert box == [2] and (y == 2).all()

"""The single-process transport: size 1, no communication, same semantics."""

from __future__ import annotations

from .. import _config
from .base import HostTransport


class SelfTransport(HostTransport):
    name = "self"

    def __init__(self):
        _config.refuse_malformed()  # a malformed variable is refused at init, as with MPI (alone here)

    def allreduce(self, buf, op):
        pass

    def reduce(self, buf, op, root):
        pass

    def broadcast(self, buf, root):
        pass

    def allgather(self, send, recv):
        recv[0] = send.reshape(-1)

    def gather(self, send, recv, root):
        recv[0] = send.reshape(-1)

    def reduce_scatter(self, send, recv, op):
        recv.reshape(-1)[...] = send.reshape(-1)

    def alltoall(self, send, recv):
        recv[...] = send

    def allgather_object(self, obj):
        return [obj]

    def broadcast_object(self, obj, root):
        return obj

    def barrier(self):
        pass

    def split(self, color, key):
        return None if color is None else SelfTransport()

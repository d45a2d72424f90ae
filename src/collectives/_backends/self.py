"""The single-process transport: size 1, no communication, same semantics."""

from __future__ import annotations

from collections import deque

import numpy as np

from .. import _agree, _config
from .._errors import CollectiveError
from .._p2p import p2p_header, p2p_mismatch
from .base import HostTransport, Request


class SelfTransport(HostTransport):
    name = "self"

    def __init__(self):
        # a malformed variable is refused at init, as with MPI (alone here)
        _agree.refuse_together(None, _config.problems(), _config.malformed)
        self.check_nan = _config.check_nan()
        self._mail: dict = {}  # tag -> the messages this process sent itself, oldest first: (header, bytes)

    # ---- point-to-point: to itself, through a mailbox (the Communicator refuses a blocking send to itself)
    def send(self, buf, name, dst, tag):
        data = buf.reshape(-1).view(np.uint8).copy()
        self._mail.setdefault(tag, deque()).append((p2p_header(buf.size, buf.nbytes, name, 0, data.size), data))

    def recv(self, buf, name, src, tag, box):
        if not _Taken(self, buf, name, tag, box).test():
            raise CollectiveError(f"recv from rank 0 (this rank, the one process) with tag {tag}: no message with "
                                  f"that tag was sent; with one process, send(async_op=True) to itself first")

    def start(self, operation, *args):
        if operation == "recv":  # (buf, name, src, tag, box): completes once the message is in the mailbox
            buf, name, _, tag, box = args
            return _Taken(self, buf, name, tag, box)
        return super().start(operation, *args)

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

    def split(self, color, key, timeout=None):  # (one process: nothing to wait for)
        if color is None:
            return None
        child = SelfTransport()
        child.check_nan = child.check_nan or self.check_nan  # on if on for the parent or here
        return child


class _Taken(Request):
    """A receive from the mailbox: complete once a message with its tag is there (checked as MPI's are)."""

    def __init__(self, transport, buf, name, tag, box):
        self._t, self._buf, self._name, self._tag, self._box = transport, buf, name, tag, box
        self._done = False

    def test(self) -> bool:
        if self._done:
            return True
        queue = self._t._mail.get(self._tag)
        if not queue:
            return False
        header, data = queue.popleft()
        self._done = True
        self._box[0] = 0
        error = p2p_mismatch(header, self._buf.size, self._buf.nbytes, self._name, 0, self._tag, 0)
        if error is not None:
            raise error
        self._buf.reshape(-1).view(np.uint8)[...] = data
        return True

    def wait(self) -> None:
        if not self.test():
            raise CollectiveError(f"recv from rank 0 (this rank, the one process) with tag {self._tag}: no message "
                                  f"with that tag was sent (one process: nothing else can send it)")

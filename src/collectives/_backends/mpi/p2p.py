"""Point-to-point messages of the MPI transport (``send``, ``recv``, blocking and started), and the
progress of the receives a rank has started: a message is its header, then its data, on two lanes."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._errors import CollectiveError
from ..._p2p import HEADER_WORDS, p2p_fields, p2p_header, p2p_mismatch
from ..base import HostTransport, Request
from .ops import MESSAGES

SEND, RECV = MESSAGES["send"], MESSAGES["recv"]


class PointToPoint(HostTransport):
    """The part of :class:`~collectives._backends.mpi.transport.MPITransport` that sends and receives
    (the state is the transport's, set in its ``__init__``).

    A message is two: its header (p2p_header: bytes, elements, dtype name, the data's tag, the piece size)
    on the "p2p" lane under the user's tag, then its data on the "p2p_data" lane, from the sender
    only, under a tag of its own (the sender's count of messages to that rank, modulo max_tag + 1). The
    receiver takes the header first (from src, or from any rank), checks it against its buffer, then
    receives the data from the header's sender under the data's tag: a receive matched by any source
    can only meet the data of its own header, whatever other receives are pending, and a message that
    does not fit is received into scratch memory and dropped (p2p_mismatch), never truncated.
    """

    MPI: Any
    _lanes: dict
    _max_count: int
    _p2p_seq: dict
    _receives: Any
    _to_itself: dict
    _wait: Any

    def _header(self, buf: np.ndarray, name: str, dst: int, tag: int) -> np.ndarray:
        if dst == self.rank:
            self._to_itself[tag] = self._to_itself.get(tag, 0) + 1
        seq = self._p2p_seq.get(dst, 0)
        self._p2p_seq[dst] = seq + 1 if seq < self.max_tag else 0
        return p2p_header(buf.size, buf.nbytes, name, seq, self._max_count)

    @staticmethod
    def _pieces(raw: np.ndarray, piece: int):
        """``raw`` (1-d uint8) in the messages of at most ``piece`` bytes its data travels in (one for
        an empty buffer)."""
        if raw.size <= piece:
            return [raw]
        return [raw[lo:lo + piece] for lo in range(0, raw.size, piece)]

    def send(self, buf, name, dst, tag):
        """MPI_Send of the header, then of the data (in pieces past ``COLLECTIVES_MAX_COUNT`` bytes); while
        receives of this rank are pending, the non-blocking form, waited moving them on (:meth:`_progress`)."""
        if self._receives:
            return self._start_send(buf, name, dst, tag).wait()
        header = self._header(buf, name, dst, tag)
        SEND.call(self._lanes[SEND.lane], [header, self.MPI.INT64_T], dst, tag)
        data, byte, seq = self._lanes[SEND.data_lane], self.MPI.BYTE, int(header[2])
        for piece in self._pieces(buf.reshape(-1).view(np.uint8), self._max_count):
            SEND.call(data, [piece, byte], dst, seq)

    def recv(self, buf, name, src, tag, box):
        """MPI_Recv of a header (from ``src`` or any rank), checked, then of its data; while other receives
        are pending, the non-blocking form, waited moving them on (:meth:`_progress`)."""
        MPI = self.MPI
        header, status = np.empty(HEADER_WORDS, dtype=np.int64), MPI.Status()
        self._from_itself(src, tag)
        if self._receives:
            return _Receive(self, buf, name, src, tag, box).wait()
        RECV.call(self._lanes[RECV.lane], [header, MPI.INT64_T], MPI.ANY_SOURCE if src is None else src, tag, status)
        source = status.Get_source()
        target, error = _receiving(self, buf, name, header, source, tag)
        data, byte, seq, piece = self._lanes[RECV.data_lane], MPI.BYTE, int(header[2]), int(header[3])
        for part in self._pieces(target, piece):
            RECV.call(data, [part, byte], source, seq)
        if error is not None:
            raise error
        box[0] = source

    def _from_itself(self, src, tag) -> None:
        """A blocking receive that only this rank could send to (src is this rank, or any rank of one):
        refused unless the message is already there (this rank is blocked here: it could never come)."""
        if (src == self.rank or (src is None and self.size == 1)) and not self._to_itself.get(tag):
            raise CollectiveError(f"recv from rank {self.rank} (this rank) with tag {tag}: no message with that tag "
                                  f"was sent, and none can come while this rank waits; send(..., async_op=True) to "
                                  f"itself first")

    def _start_send(self, buf, name, dst, tag) -> _Sending:
        header = self._header(buf, name, dst, tag)
        data, byte, seq = self._lanes[SEND.data_lane], self.MPI.BYTE, int(header[2])
        reqs = [SEND.call(self._lanes[SEND.lane], [header, self.MPI.INT64_T], dst, tag, blocking=False)]
        reqs += [SEND.call(data, [piece, byte], dst, seq, blocking=False)
                 for piece in self._pieces(buf.reshape(-1).view(np.uint8), self._max_count)]
        return _Sending(self, reqs, ("send", buf, f"dst={dst}, tag={tag}"), (header, buf))


    def _progress(self) -> None:
        """Move on every started receive of this transport whose header has arrived: post its data's
        receives. A receive posts them only once it knows the message (its sender, its data's tag, whether
        it fits), so without this a rank waiting for its send would never post the receive its peer's send
        waits for, where MPI (whose receives are posted at the call) completes: every wait and test of
        the transport calls it while receives are pending, as MPI's progress moves every request."""
        for r in tuple(self._receives):
            r.head_arrived()

    def before_test(self, req: Request) -> None:
        """What every test of one of this transport's requests does first: keep ``req`` if the transport
        has failed (a mismatch or timeout of another call: it never completes, and its buffers stay alive;
        ``usable`` raises), and move the pending receives on (:meth:`_progress`)."""
        if self.failed is not None:
            self.usable(req)
        if self._receives:
            self._progress()

    def _progressing(self, req):
        """``req.Test``, moving the pending receives on before each test."""
        def test() -> bool:
            self._progress()
            return req.Test()
        return test



class _Status:
    """An MPI request tested and waited with a status (the source of a header received from any rank):
    what :meth:`MPITransport._wait` and the deadline's polling take."""

    __slots__ = ("_req", "_status")

    def __init__(self, req, status):
        self._req, self._status = req, status

    def Test(self) -> bool:
        return self._req.Test(self._status)

    def Wait(self) -> None:
        self._req.Wait(self._status)


def _receiving(transport, buf, name, header, source, tag):
    """``(where the data goes, error)``: ``buf``'s bytes and None when the message fits it, else scratch
    bytes of the sender's size and the error to raise once they are received (``p2p_mismatch``)."""
    if source == transport.rank:
        transport._to_itself[tag] -= 1
    error = p2p_mismatch(header, buf.size, buf.nbytes, name, source, tag, transport.rank)
    if error is None:
        return buf.reshape(-1).view(np.uint8), None
    return np.empty(p2p_fields(header)[0], dtype=np.uint8), error


class _Sending(Request):
    """A started send: its header's and its data's MPI requests (the buffers kept alive with them)."""

    def __init__(self, transport, reqs, what, keep):
        self._transport, self._reqs, self._what, self._keep = transport, reqs, what, keep
        self._done = False

    def test(self) -> bool:
        if not self._done:
            self._transport.before_test(self)
            self._done = self._transport.MPI.Request.Testall(self._reqs)
        return self._done

    def wait(self) -> None:
        if not self._done:
            for req in self._reqs:
                self._transport._wait(self._what, req, self._keep)  # bounded on the deadline transport (it fails it)
            self._done = True


class _Receive(Request):
    """A started receive: the header's receive first; once it has arrived (in :meth:`test` or
    :meth:`wait`), checked against the buffer, the data's receives from its sender."""

    def __init__(self, transport, buf, name, src, tag, box):
        MPI = transport.MPI
        self._transport, self._buf, self._name, self._tag, self._box = transport, buf, name, tag, box
        self._header = np.empty(HEADER_WORDS, dtype=np.int64)
        self._status = MPI.Status()
        self._what = ("recv", buf, f"src={'any' if src is None else src}, tag={tag}")
        self._head = _Status(RECV.call(transport._lanes[RECV.lane], [self._header, MPI.INT64_T],
                                       MPI.ANY_SOURCE if src is None else src, tag, blocking=False), self._status)
        self._data: list | None = None
        self._error: Exception | None = None
        self._done = False
        transport._receives.append(self)  # moved on by every wait and test of the transport (_progress)

    def head_arrived(self) -> bool:
        """Whether the header has arrived, its data's receives then posted (once)."""
        if self._data is None:
            if not self._head.Test():
                return False
            self._arrived()
        return True

    def _arrived(self) -> None:
        t = self._transport
        t._receives.remove(self)
        source = self._status.Get_source()
        target, self._error = _receiving(t, self._buf, self._name, self._header, source, self._tag)
        seq, piece = int(self._header[2]), int(self._header[3])
        lane, byte = t._lanes[RECV.data_lane], t.MPI.BYTE
        self._scratch = target
        self._data = [RECV.call(lane, [part, byte], source, seq, blocking=False) for part in t._pieces(target, piece)]
        self._box[0] = source

    def _finish(self) -> None:
        self._done = True
        if self._error is not None:
            raise self._error

    def test(self) -> bool:
        if self._done:
            return True
        t = self._transport
        if t._receives:
            t._progress()  # this receive's header too
        if self._data is None or not t.MPI.Request.Testall(self._data):
            return False
        self._finish()
        return True

    def wait(self) -> None:
        if self._done:
            return
        t = self._transport
        if self._data is None:
            t._wait(self._what, _Head(self))
        for req in self._data or ():
            t._wait(self._what, req, self)  # (the header and any scratch kept with it, should it stay pending)
        self._finish()


class _Head:
    """The header of a started receive as a request the transport's waits take: complete once it has
    arrived and the data's receives are posted (:meth:`_Receive.head_arrived`)."""

    __slots__ = ("receive",)

    def __init__(self, receive):
        self.receive = receive

    def Test(self) -> bool:
        return self.receive.head_arrived()

    def Wait(self) -> None:  # (only when no other receive is pending: MPITransport._wait)
        r = self.receive
        if r._data is None:
            r._head.Wait()
            r._arrived()

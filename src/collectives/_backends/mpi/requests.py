"""The requests of the MPI transport's non-blocking collectives: an MPI call with its fingerprint beside
it (:class:`_MPIRequest`), and a kind's first call, started once its lane is made (:class:`_FirstCall`)."""

from __future__ import annotations

from ..._errors import MismatchError
from ..base import Request
from .._fingerprint import describe as _describe


class _MPIRequest(Request):
    """An MPI request of a transport, with the fingerprint reduced beside it (``check``: ``(request,
    buffer)``, or None): :meth:`test` is ``MPI_Test`` (which also lets MPI progress it); :meth:`wait` is the
    transport's wait (``MPI_Wait``, or polling under the deadline). The fingerprint is looked at first: a
    call that the ranks made differently raises :class:`MismatchError` (and fails the transport) before
    its data is waited for, and its request is kept, never completed (its buffers stay alive)."""

    def __init__(self, transport, req, call, check=None):
        self._transport, self._req, self._call, self._check = transport, req, call, check
        self._done = False

    def _what(self):
        """What this request is, for messages (:func:`_describe`): made only when a message needs it."""
        return _describe(*self._call)

    def _checked(self) -> None:
        check = self._check[1]
        self._check = None
        try:
            self._transport._verify(check, self._what)  # (described only for a mismatch's message)
        except MismatchError:
            self._transport.abandon((self._req, self._call))  # (with its buffers: MPI may still use them)
            self._req = None
            raise

    def test(self) -> bool:
        if not self._done:
            self._transport.before_test(self)
            if self._check is not None:
                if not self._check[0].Test():
                    return False
                self._checked()
            self._done = self._req.Test()
        return self._done

    def wait(self) -> None:
        if not self._done:
            if self._transport.failed is not None:  # (as in test: raised at once, never waited for)
                self._transport.usable(self)  # (keeping this request: it never completes)
            try:
                if self._check is not None:
                    self._transport._wait(self._what, self._check[0])
                    self._checked()
                self._transport._wait(self._what, self._req)
            except BaseException:  # a timeout: MPI may still write into the buffers: keep them alive
                self._transport.abandon(self)
                raise
            self._done = True



class _FirstCall(Request):
    """A non-blocking call of a kind whose lane is not made yet: its fingerprint is reduced at once (in the
    order of the calls), its MPI call started when the lane is made, which any test or wait of a call
    waiting for that lane moves on (``MPITransport._advance``); from then on it is that call's
    :class:`_MPIRequest`. Starting it never blocks, as MPI's non-blocking calls do not. (So a rank that
    gives up waiting for a kind's first call, a timeout, never posted its MPI call: a late rank's
    matching call then times out too, where one on a made lane could still complete.)"""

    def __init__(self, transport, operation, args):
        self._transport, self._operation, self._args = transport, operation, args
        making = transport._making.get(operation) or transport._begin_making(operation)
        self._making = making
        making.waiting.append(self)
        self._check = transport._fingerprint_beside(operation, *args)
        self._request: _MPIRequest | None = None

    def start(self) -> None:
        t = self._transport
        self._request = _MPIRequest(t, t._start_call(self._operation, *self._args), (self._operation, self._args),
                                    self._check)

    def test(self) -> bool:
        if self._request is None:
            self._transport.usable(self)  # (failed: its fingerprint may be pending for good; kept)
            if not self._transport._advance(self._making):
                return False
        assert self._request is not None  # started by _advance
        return self._request.test()

    def wait(self) -> None:
        if self._request is None:
            self._transport.usable(self)
            try:
                self._transport._advance(self._making, self._transport._wait)
            except BaseException:  # its fingerprint may be pending for good: kept, with its buffer
                self._transport.abandon(self)
                raise
        assert self._request is not None  # started by _advance
        self._request.wait()

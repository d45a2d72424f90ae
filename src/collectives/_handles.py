"""What an asynchronous collective (``async_op=True``) returns: a :class:`Handle`.

A handle runs a collective in steps. The Communicator writes each asynchronous collective as a generator
that does the work before a transfer (validation is already done; the reduction rules' encoding:
widening, ordered integers), yields the transport's :class:`~collectives._backends.base.Request` for the
transfer, and after it completes does the work after (the decoding: ordered integers back to floats,
mean's division, rounding back, writing into the caller's array, wrapping a new array) and returns the
result. The handle starts the generator at once (the transfer is started by the call), and moves it on
when a request is complete: in :meth:`Handle.wait` (blocking), or in :meth:`Handle.done` (only if the
request is already complete: ``done`` never blocks).

No thread is involved: MPI progresses a non-blocking collective inside MPI calls (``MPI_Test`` in
``done()``, ``MPI_Wait`` or the deadline's polling in ``wait()``, and any other MPI call of the process).
"""

from __future__ import annotations

import time
from typing import Any

from ._errors import CollectiveError, CollectiveTimeoutError, reraise
from . import _threads, _trace
from ._poll import poll
from ._records import END as _END, _clock, finish as _finish_record
from ._threads import enter, leave, refuse


ABANDONED: list = []  # what a failure left in flight, kept to the end of the process since MPI may still write
# into its buffers: (request, steps) of handles that failed or that close() could not complete, and the
# transports' requests (HostTransport.abandon)


class Handle:
    """The pending result of a collective called with ``async_op=True``.

    Until :meth:`wait` has returned, the caller must neither read nor write the array it passed (nor the
    result's memory). Handles may be waited in any order; every rank must still *issue* the same
    collectives in the same order.

    Example:
        >>> import numpy as np, collectives as coll
        >>> comm = coll.world()
        >>> x = np.full(3, float(comm.rank))
        >>> h = coll.allreduce(x, op="sum", async_op=True)
        >>> isinstance(h.done(), bool)          # never blocks
        True
        >>> h.wait() is x and float(x[0]) == sum(range(comm.size))
        True
        >>> h.done()
        True
    """

    __slots__ = ("_error", "_fail", "_finished", "_owner", "_pending", "_record", "_result", "_steps", "what")

    def __init__(self, what: str, steps, owner: dict | None = None, fail=None, record=None):
        self.what = what  # the collective, for messages
        self._record = record  # the flight recorder's record of the call (_records: a list), finished with it
        # (or the timeline's stand-in for it, _timeline._Finish)
        self._steps = steps
        self._pending: Any = None  # the step's request in flight (a transport's Request), or None
        self._finished = False
        self._result = None
        self._error: BaseException | None = None
        self._owner = owner  # the communicator's outstanding handles (id -> handle), left on completion
        self._fail = fail  # fails the communicator (a wait that timed out: it can never be used again)
        if owner is not None:
            owner[id(self)] = self
        self._advance()  # starts the transfer

    @classmethod
    def completed(cls, what: str, result=None, error: BaseException | None = None) -> Handle:
        """A handle whose collective has already run (or failed: ``wait()`` raises ``error``)."""
        h = cls.__new__(cls)
        h.what, h._steps, h._pending, h._owner, h._fail, h._record = what, None, None, None, None, None
        h._finished, h._result, h._error = True, result, error
        return h

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self._finished else "pending"
        return f"<collectives.Handle {self.what} {state}>"

    def _advance(self) -> None:
        try:
            self._pending = next(self._steps)
        except StopIteration as stop:
            self._finish(stop.value, None)
        except Exception as exc:  # noqa: BLE001 - held, raised by wait()
            self._finish(None, exc)

    def _finish(self, result, error) -> None:
        if error is not None and self._pending is not None:  # failed with a transfer in flight: MPI may
            ABANDONED.append((self._pending, self._steps))  # still write into its buffers; keep them
        self._finished, self._result, self._error = True, result, error
        self._pending = self._steps = None
        rec = self._record
        if rec is not None:
            self._record = None
            if rec.__class__ is not list:  # the timeline's stand-in (it finishes the record too)
                rec.finish(error)
            elif error is None:  # _records.finish written out (a call less on every asynchronous call)
                rec[_END] = _clock()
            else:
                _finish_record(rec, error)
        if self._owner is not None:
            self._owner.pop(id(self), None)
            self._owner = None

    def done(self) -> bool:
        """True once the collective has completed (also when it failed: then :meth:`wait` raises). Never
        blocks: asks MPI whether the transfer is complete (which also lets it progress). Like a collective,
        refused (:class:`CollectiveError`) while another thread of the process is inside one (``_threads``)."""
        if self._finished:
            return True
        if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
            _threads.settle()
        if not enter(False):
            refuse(f"{self.what} handle's done()")
        try:
            return self._progress()
        finally:
            leave()

    def _progress(self) -> bool:
        while not self._finished:
            try:
                if not self._pending.test():
                    return False
            except Exception as exc:  # noqa: BLE001 - held, raised by wait()
                self._finish(None, exc)
                break
            self._advance()
        return True

    def wait(self, timeout: float | None = None):
        """Block until the collective has completed; return what the blocking call would have returned
        (the same array for an in-place call), or raise its error (:class:`MismatchError`,
        :class:`CollectiveTimeoutError` after ``COLLECTIVES_TIMEOUT`` seconds of waiting here,
        :class:`CollectiveError` for an MPI error). May be called again: it returns (or raises) the same.
        Like a collective, refused (:class:`CollectiveError`) while another thread of the process is inside
        one (``_threads``): waiting calls MPI.

        Args:
            timeout: seconds to wait at most (None: as long as the transport's own deadline allows). Past
                it, :class:`CollectiveTimeoutError`: the transfer cannot be cancelled, so the communicator
                is failed for good (every later call on it raises at once), and nothing of this call's is
                written afterwards by the library."""
        if not self._finished:
            if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
                _threads.settle()
            if not enter(False):
                refuse(f"{self.what} handle's wait()")
            try:
                if timeout is not None and not poll(self._progress, timeout):
                    self._expire(timeout)
                while not self._finished:
                    try:
                        self._pending.wait()
                    except Exception as exc:  # noqa: BLE001 - raised below
                        self._finish(None, exc)
                        break
                    self._advance()
            finally:
                leave()
        if self._error is not None:
            reraise(self._error, self.what)
        return self._result

    def _expire(self, timeout: float) -> None:
        """``wait(timeout)`` gave up: fail the communicator, hold and raise the timeout."""
        reason = f"{self.what} did not complete within {timeout:g} s"
        if self._fail is not None:
            self._fail(reason)
        # MPI cannot cancel a started collective and may still write into its buffers (when the late
        # ranks arrive and anything progresses MPI): the request and the steps holding the buffers live on
        self._finish(None, CollectiveTimeoutError(
            f"{reason}: another rank has not issued the matching call, or died. The communicator cannot be "
            f"used further (every later call on it raises); end the job"))
        _trace.failure(f"CollectiveTimeoutError: {reason}")

    def _settle(self, seconds: float) -> bool:
        """Poll :meth:`done` for up to ``seconds``; whether it completed (for ``close()``)."""
        return poll(self._progress, seconds)


def settle_all(handles: list, seconds: float, where: str) -> None:
    """Complete outstanding ``handles`` (issue order) within ``seconds`` in all, else raise a
    :class:`CollectiveError` naming those left (``close()`` and ``finalize()``; never hangs)."""
    deadline = time.monotonic() + seconds
    left = [h for h in handles if not h._settle(max(0.0, deadline - time.monotonic()))]
    if left:
        # their transfers are in flight for good: MPI may still write into their buffers (ABANDONED)
        ABANDONED.extend((h._pending, h._steps) for h in left)
        names = ", ".join(h.what for h in left)
        raise CollectiveError(
            f"{where}: {len(left)} asynchronous collective(s) did not complete within {seconds:g} s ({names}): "
            f"another rank has not issued the matching call. Call wait() on every handle before closing; "
            f"the communicator was released as far as possible (its MPI communicator is left to the end of "
            f"the process)")

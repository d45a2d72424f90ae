"""The ``Work`` of the torch backend: what every operation of the process group returns, backed by the
handles of our asynchronous collectives (or, for an operation run at the call, a completed one)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .._errors import CollectiveTimeoutError


def _seconds(timeout) -> float | None:
    """Seconds of a torch timeout (a ``timedelta``); None for none (zero: torch's kNoTimeout)."""
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return s if s > 0 else None


class Work(dist.Work):
    """What every operation of :class:`ProcessGroupCollectives` returns: torch's ``Work``, backed by the
    handles (:class:`~collectives.Handle`) of our asynchronous collectives.

    - ``wait(timeout)`` completes the operation (its results are in the output tensors afterwards) and
      returns True; it raises the operation's error (``MismatchError``, ``CollectiveError``, ...), or
      :class:`~collectives.CollectiveTimeoutError` when it has not completed within ``timeout`` (else the
      group's ``timeout=`` from ``init_process_group``/``new_group``, else ``COLLECTIVES_TIMEOUT`` as it
      was when the group was made, the smallest of those set).
    - ``is_completed()`` never blocks (it asks MPI whether the transfer is complete, which also lets it
      progress).
    - ``get_future()`` returns a ``torch.futures.Future`` holding the output tensors. It completes the
      operation first (as ``wait()``; an error is then set on the future rather than raised): no thread
      progresses our collectives in the background, so a future handed out before completion would only
      complete when something else waited. DDP asks for the future as it launches each bucket's
      allreduce, so DDP's allreduces complete in the backward pass, bucket by bucket.

    Example:
        >>> import torch, torch.distributed as dist
        >>> import collectives.torch_backend
        >>> dist.init_process_group("collectives")
        >>> t = torch.ones(4)
        >>> work = dist.all_reduce(t, async_op=True)
        >>> work.wait(), work.is_completed(), work.get_future().wait()[0] is t
        (True, True, True)
        >>> dist.destroy_process_group()
    """

    def __init__(self, what: str, handles, finish, result, timeout_s: float | None):
        super().__init__()
        self._what = what
        self._handles = list(handles)
        self._finish = finish  # callable(list of handle results) -> None: copies into output tensors
        self._result = result  # what the future holds: the output tensors
        self._timeout_s = timeout_s
        self._future: torch.futures.Future | None = None  # made by get_future (most Works are only waited for)
        self._error: BaseException | None = None
        self._done = False
        if all(h.done() for h in self._handles):
            self._complete()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self._done else "pending"
        return f"<collectives.torch_backend.Work {self._what} {state}>"

    def _complete(self) -> None:
        try:
            results = [h.wait() for h in self._handles]
            if self._finish is not None:
                self._finish(results)
        except Exception as exc:  # noqa: BLE001 - held: raised by wait(), set on the future
            self._error = exc
        self._done = True
        self._handles = []

    def is_completed(self) -> bool:
        """Whether the operation has completed (also when it failed). Never blocks."""
        if not self._done and all(h.done() for h in self._handles):
            self._complete()
        return self._done

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Complete the operation (bounded: see the class); True, or raise its error."""
        if not self._done:
            bounds = [b for b in (_seconds(timeout), self._timeout_s) if b is not None]
            limit = min(bounds) if bounds else None
            end = None if limit is None else time.monotonic() + limit
            try:  # each handle's wait is bounded by what is left; one that times out fails the group
                for h in self._handles:
                    h.wait(None if end is None else max(0.0, end - time.monotonic()))
            except CollectiveTimeoutError as exc:
                raise CollectiveTimeoutError(
                    f"{self._what} did not complete within {limit:g} s (the smallest of wait(timeout=), the "
                    f"group's timeout= and COLLECTIVES_TIMEOUT): another rank has not issued the matching "
                    f"call, or died. The group cannot be used further (every later operation on it raises); "
                    f"end the job") from exc
            except Exception:  # noqa: BLE001 - the operation's own error: held by _complete, raised below
                pass
            self._complete()
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        """A future of the output tensors, completed (see the class)."""
        if not self._done:
            try:
                self.wait()
            except CollectiveTimeoutError as exc:
                self._done, self._error = True, exc
            except Exception:  # noqa: BLE001 - the error is on the future
                pass
        if self._future is None:
            self._future = torch.futures.Future()
            if self._error is not None:
                self._future.set_exception(self._error)
            else:
                self._future.set_result(self._result)
        return self._future

    def exception(self):
        """The operation's error once it has completed with one, else None."""
        return self._error

    def result(self) -> list:
        """The output tensors, after :meth:`wait`."""
        self.wait()
        return self._result


class _Done:
    """The handle of an operation made at the call (see :meth:`ProcessGroupCollectives._start`)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def done(self) -> bool:
        return True

    def wait(self, timeout=None):
        return self.value


class _ReceiveWork(Work):
    """The Work of a receive: ``source_rank()`` (torch's ``_source_rank()``, which ``dist.recv`` reads) is
    the sender's rank in the group, once the receive has completed (it waits for it), as gloo's."""

    _source: int | None = None

    def __init__(self, what, handle, result, timeout_s):
        super().__init__(what, [handle], self._received, result, timeout_s)

    def _received(self, results) -> None:
        self._source = results[0]

    def source_rank(self) -> int:
        self.wait()
        assert self._source is not None
        return self._source

    _source_rank = source_rank


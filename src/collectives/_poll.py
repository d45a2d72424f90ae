"""The one way the library waits for something that completes elsewhere: :func:`poll`.

Every bounded wait (the deadline transport's MPI requests, :meth:`Handle.wait` with a timeout, the torch
backend's ``Work.wait``, ``close()`` settling handles) polls a ``test()`` that never blocks and lets the
transport progress (``MPI_Test``). For the first ``spin_s`` seconds it polls continuously, as a blocking MPI
call would (yielding the core every few polls, for ranks that share cores); a wait that lasts longer is a
rank waiting for a straggler, and it then sleeps between polls with a backoff of up to ``max_pause_s``, so a
long wait does not burn a core.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

SPIN_S = 0.25  # seconds of continuous polling before the backoff
MAX_PAUSE_S = 1e-3  # the longest sleep between two polls
YIELD_EVERY = 64  # polls between sched_yield() calls while spinning

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


def poll(test: Callable[[], bool], seconds: float | None, *, spin_s: float = SPIN_S,
         max_pause_s: float = MAX_PAUSE_S) -> bool:
    """Call ``test()`` until it returns True (then return True) or ``seconds`` have passed (then False;
    None: no limit). An exception of ``test`` propagates.

    Example:
        >>> import time
        >>> from collectives._poll import poll
        >>> t = time.monotonic() + 0.01
        >>> poll(lambda: time.monotonic() > t, 1.0), poll(lambda: False, 0.0)
        (True, False)
    """
    if test():
        return True
    monotonic = time.monotonic
    t0 = monotonic()
    deadline = None if seconds is None else t0 + seconds
    spin_until = t0 + spin_s if deadline is None else min(t0 + spin_s, deadline)
    polls = 0
    while not test():
        polls += 1
        if polls % YIELD_EVERY == 0:
            if monotonic() >= spin_until:
                break
            _yield()
    else:
        return True
    pause = 20e-6
    while not test():
        if deadline is not None and monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, max_pause_s)
    return True

"""One collective at a time per process: a second thread entering a collective while another thread of
the process is inside one is refused with :class:`CollectiveError`, before it communicates.

MPI at the thread levels the library starts it with (``serialized``, the default; also ``funneled``,
``single``) forbids two MPI calls at once in a process: two threads calling collectives together crashed
MPICH in its datatype engine. Even at ``multiple`` two threads' collectives on one communicator could pair
up differently on different ranks. So the library refuses instead of serialising: a lock would only hide
the mistake, and turn it into a hang or into the wrong collectives meeting across ranks.

The guard is one re-entrant lock taken without blocking (``acquire(False)``) around every public
collective: a collective that calls another in the same thread passes, another thread's is refused. It
costs two C calls on the hot path (docs/performance.md).
"""

from __future__ import annotations

import threading

import functools
from collections.abc import Callable

from ._errors import CollectiveError, reraise

GUARD = threading.RLock()
enter = GUARD.acquire  # enter(False) -> False when another thread is inside a collective
leave = GUARD.release

# settle(): called before a collective is entered, while it is not None. collectives.jax sets it (once it
# has traced a collective) to a wait for the collectives that jitted JAX computations have dispatched and
# not yet run (jax.effects_barrier; skipped inside its own callbacks): their callbacks may run on XLA's
# threads, after this thread's next call, which must not overtake them (on the other ranks it would meet
# another collective, or be refused by the guard). Until then one global look-up per call.
settle: Callable[[], None] | None = None


def refuse(what: str):
    """Raise the CollectiveError for ``what`` entered while another thread is inside a collective."""
    raise CollectiveError(
        f"{what} called from thread {threading.current_thread().name!r} while another thread of this process "
        f"is inside a collective: refused before anything was sent. MPI allows one call at a time per "
        f"process here (thread level 'serialized'); two at once crashed MPICH. Call collectives from one "
        f"thread at a time (one communication thread, or behind a lock of your own, in the same order on "
        f"every rank). The other ranks may now wait for this call: end the job (or set COLLECTIVES_TIMEOUT)")


def collective(what: str):
    """Decorator of a public collective: refused while another thread is inside one (see above), and an
    MPI error raised inside becomes a :class:`CollectiveError` (``_errors.reraise``)."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if settle is not None:  # a jitted JAX computation's collectives first (see settle)
                settle()
            if not enter(False):  # another thread is inside a collective: refused
                refuse(what)
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - re-raised (MPI errors as CollectiveError)
                reraise(exc, what)
            finally:
                leave()
        return call
    return wrap

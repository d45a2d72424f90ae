"""What happens when one rank fails: the whole job ends, promptly, saying which rank failed and why.

An MPI job whose rank raised an uncaught exception does not end by itself: the failed process exits (or
waits in ``MPI_Finalize``) while the others wait forever in their next collective. So :func:`install`
(called by :func:`collectives.init` when the MPI job has more than one process) wraps ``sys.excepthook``:
on an uncaught exception in the main thread it prints ``collectives: rank R of N failed with ...``, lets
the previous hook print the traceback, and calls ``MPI_Abort`` on ``COMM_WORLD``, which makes the launcher
end every rank with a non-zero status. ``COLLECTIVES_ABORT_ON_ERROR=0`` turns this off.

The hook stays for the life of the process (also after :func:`collectives.finalize`: a rank failing in
``try: ... finally: finalize()`` must still end the job). Exceptions in other threads, ``sys.exit`` and
a rank that simply returns early are not uncaught exceptions; against those, and against a rank that is
stuck, the deadline ``COLLECTIVES_TIMEOUT`` is the tool. A rank killed by a signal is noticed by the
launcher itself (MPICH's hydra ends the job within a second).
"""

from __future__ import annotations

import sys
import time

from . import _config, _trace

ABORT_VARIABLE = "COLLECTIVES_ABORT_ON_ERROR"
EXIT_STATUS = 1  # the errorcode handed to MPI_Abort
REPORT_GRACE_S = 0.25  # MPI_Abort makes the launcher kill every rank, and output still in a pipe is lost

_previous = None  # the hook ours wraps, called for the traceback
_installed = False


def abort_on_error() -> bool:
    """Whether an uncaught exception aborts the job (``COLLECTIVES_ABORT_ON_ERROR``, default on)."""
    return _config.flag(ABORT_VARIABLE, True)


def installed() -> bool:
    """True when the abort hook is in ``sys.excepthook`` (possibly wrapped by a later hook)."""
    return _installed


def install(transport) -> bool:
    """Install the abort-on-uncaught-exception hook once per process, if it applies; return whether it is.

    It applies when ``transport`` is the MPI transport, MPI's world has more than one process and
    ``COLLECTIVES_ABORT_ON_ERROR`` is not ``0``. Idempotent; chains to the hook it replaces.
    """
    global _previous, _installed
    if _installed:
        return True
    if getattr(transport, "name", None) != "mpi" or not abort_on_error():
        return False
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() < 2:
        return False
    _previous = sys.excepthook
    sys.excepthook = _abort_hook
    _installed = True
    return True


def uninstall() -> None:
    """Take the hook out again (for tests). If another hook wrapped ours since, ours only stops acting."""
    global _installed
    if sys.excepthook is _abort_hook and _previous is not None:
        sys.excepthook = _previous
    _installed = False


class _Both:
    """A text stream writing to two (the hook's report, where stderr was redirected around it)."""

    def __init__(self, *streams):
        self._streams = streams

    def write(self, text):
        for s in self._streams:
            try:
                s.write(text)
            except Exception:  # noqa: BLE001 - one broken stream must not silence the other
                pass
        return len(text)

    def flush(self):
        for s in self._streams:
            try:
                s.flush()
            except Exception:  # noqa: BLE001
                pass


def _describe(exc_type, exc) -> str:
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not stop the abort
        text = "<unprintable>"
    return f"{exc_type.__name__}: {text}" if text else exc_type.__name__


def abort_job(why: str) -> None:
    """End the whole MPI job now (``MPI_Abort``), saying ``why``, where the abort hook would: MPI initialised
    (by us or anyone: Lightning's MPIEnvironment initialises it), more than one process,
    ``COLLECTIVES_ABORT_ON_ERROR`` not ``0``; else return. For an uncaught error the hook is not installed
    for (no :func:`collectives.init` yet), once its traceback is printed."""
    MPI = sys.modules.get("mpi4py.MPI")
    if not abort_on_error() or MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if size < 2:
        return
    try:
        sys.stderr.write(f"collectives: aborting all {size} ranks (MPI_Abort): {why} on rank {rank}; set "
                         f"{ABORT_VARIABLE}=0 to let this rank exit alone\n")
        sys.stderr.flush()
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - the job must still end
        pass
    time.sleep(REPORT_GRACE_S)
    world.Abort(EXIT_STATUS)


def _abort_hook(exc_type, exc, tb) -> None:
    """``sys.excepthook`` while installed: report, chain to the previous hook, then ``MPI_Abort``."""
    previous = _previous if _previous is not None else sys.__excepthook__
    MPI = sys.modules.get("mpi4py.MPI")
    if not _installed or MPI is None or MPI.Is_finalized():
        previous(exc_type, exc, tb)
        return
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    # A hook that wraps ours may have pointed sys.stderr at a buffer it prints after we return (torch's
    # init_process_group does, to prefix lines with the rank): we never return, so the report goes to the
    # process's own stderr as well.
    captured = sys.stderr
    if sys.__stderr__ is not None and captured is not sys.__stderr__:
        sys.stderr = _Both(captured, sys.__stderr__)
    try:
        sys.stderr.write(f"collectives: rank {rank} of {size} failed with {_describe(exc_type, exc)}\n")
        if _trace.failure(f"rank {rank} of {size} failed with {_describe(exc_type, exc)}; the job is ending", exc):
            _trace.await_others()  # their watchers dump within a poll: let them, before MPI_Abort
        previous(exc_type, exc, tb)
        sys.stderr.write(f"collectives: aborting all {size} ranks (MPI_Abort), so that none waits forever "
                         f"for rank {rank}; set {ABORT_VARIABLE}=0 to let this rank exit alone\n")
    except Exception:  # noqa: BLE001 - whatever happens while reporting, the job must still end
        pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        time.sleep(REPORT_GRACE_S)  # let the launcher read our report off the pipe before it kills us
        sys.stderr = captured
        world.Abort(EXIT_STATUS)

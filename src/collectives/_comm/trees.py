"""The tree collectives' entries: ``synchronize`` and ``allreduce_tree`` (blocking and asynchronous) run
``_tree``'s collectives on the communicator's Engine, each with its flight-recorder record."""

from __future__ import annotations

from .. import _records, _threads, _tree
from .._errors import BackendUnavailableError, CollectiveError, transport_failure
from .._handles import Handle
from .._threads import enter as _enter, leave as _leave, refuse as _refuse_thread
from . import record
from .record import traced


def synchronize(comm, tree, root: int = 0, *, bucket_bytes: int | None = None):
    """Root's values for every leaf of ``tree``. See :func:`collectives.synchronize`. (``Communicator.synchronize``,
    bound from here.)"""
    return _synchronize(comm, tree, root, bucket_bytes)


@traced("synchronize", path="tree buckets")
def _synchronize(comm, tree, root, bucket_bytes):
    return _tree.synchronize(comm._engine, tree, root, bucket_bytes)


@traced("allreduce_tree", path="tree buckets")
def allreduce_tree(comm, tree, op, bucket_bytes, reproducible):
    return _tree.allreduce_tree(comm._engine, tree, op, bucket_bytes, False, reproducible)



def allreduce_tree_async(comm, tree, op, bucket_bytes, reproducible) -> Handle:
    """``Communicator.allreduce_tree`` with ``async_op=True``: its buckets' transfers (``_tree``) in a Handle."""
    comm._host.usable()
    if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
        _threads.settle()
    if not _enter(False):
        _refuse_thread("allreduce_tree")
    rec = record.begin(comm, "allreduce_tree", None, op, None, "tree buckets, asynchronous")
    try:
        steps = _tree.allreduce_tree(comm._engine, tree, op, bucket_bytes, True, reproducible)
    except BaseException as exc:
        if rec is not None:
            _records.finish(rec, exc)
        if isinstance(exc, BackendUnavailableError) or not isinstance(exc, Exception):
            raise
        err = exc if isinstance(exc, CollectiveError) else transport_failure(exc, "allreduce_tree")
        if err is None:
            raise
        return Handle.completed("allreduce_tree", error=err)
    finally:
        _leave()
    if isinstance(steps, Handle):
        if rec is not None:
            _records.finish(rec, steps._error)
        return steps
    return Handle("allreduce_tree", steps, comm._outstanding, comm._host.fail, rec)

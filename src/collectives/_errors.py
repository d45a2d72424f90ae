"""Exception types.

Programming mistakes (a wrong kind of argument, an illegal dtype/op pair, a root out of range) are the
builtin ``TypeError`` and ``ValueError``, raised before any communication. Failures of the distributed
job itself are :class:`CollectiveError` and its subclasses.
"""

from __future__ import annotations

import functools
import sys

__all__ = [
    "BackendUnavailableError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "MismatchError",
    "NcclError",
    "NonFiniteError",
]


class CollectiveError(RuntimeError):
    """Base class of every failure of a collective operation or of the distributed job.

    Example:
        >>> import collectives as coll
        >>> try:
        ...     coll.init(backend="no-such-backend")
        ... except ValueError as e:        # a wrong argument is a ValueError, not a CollectiveError
        ...     pass
        >>> issubclass(coll.MismatchError, coll.CollectiveError)
        True
    """


class MismatchError(CollectiveError):
    """Ranks disagreed about a call (a tree's structure, a shape, a dtype, an op, a root).

    Raised on every rank of the communicator, before any data moved; every input is left untouched and
    the communicator stays usable.

    Example:
        >>> import collectives as coll
        >>> err = coll.MismatchError("leaf 'w': rank 0 has shape (3,), rank 1 has shape (4,)")
        >>> isinstance(err, coll.CollectiveError)
        True
    """


class BackendUnavailableError(CollectiveError):
    """The requested transport cannot be used here (MPI missing under a launcher, a CUDA array without a
    GPU transport, ...). The message says why and what to install or set.

    Example:
        >>> import collectives as coll
        >>> issubclass(coll.BackendUnavailableError, coll.CollectiveError)
        True
    """


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within the deadline (``COLLECTIVES_TIMEOUT``).

    Example:
        >>> import collectives as coll
        >>> issubclass(coll.CollectiveTimeoutError, coll.CollectiveError)
        True
    """


class NonFiniteError(CollectiveError):
    """A floating reduction's input held NaN or infinity on some rank (``COLLECTIVES_CHECK_NAN=1``).

    With the check on, every rank scans its input of ``allreduce``, ``reduce``, ``reduce_scatter``,
    ``allreduce_tree`` (and so of the gradient buckets, ``DistributedOptimizer`` and the torch backend's
    reductions) before anything moves; the ranks exchange what they found (one small collective) and, if
    any rank's input holds a NaN or an infinity, every rank raises this same error, naming each such rank,
    the first such element of its input and its value. Nothing was reduced on any rank: every input is
    left untouched and the communicator stays usable. An asynchronous call (``async_op=True``, the torch
    backend's work) raises it from ``wait()``.

    Attributes:
        collective: the call that was refused (``"allreduce"``, ...).
        found: ``{rank: (where, index, value)}``: for each rank whose input held one, the first non-finite
            element: ``where`` the array that holds it (``"leaf ['w']"`` of a tree, ``"the gradient of
            fc.weight"``; ``""`` for a single array), ``index`` its position in that array (flat, C order)
            and ``value`` its text (``"nan"``, ``"inf"``, ``"-inf"``).

    Example:
        >>> import collectives as coll
        >>> err = coll.NonFiniteError("allreduce", {1: ("", 3, "nan")})
        >>> isinstance(err, coll.CollectiveError), sorted(err.found)
        (True, [1])
        >>> print(err)  # doctest: +ELLIPSIS
        allreduce: the input holds a non-finite value on rank 1 (nan at index 3) ...
        >>> import pickle; pickle.loads(pickle.dumps(err)).found
        {1: ('', 3, 'nan')}
    """

    def __init__(self, collective: str, found: dict):
        self.collective = collective
        self.found = {int(r): tuple(v) for r, v in found.items()}
        ranks = sorted(self.found)
        parts = []
        for r in ranks:
            where, index, value = self.found[r]
            parts.append(f"rank {r} ({value} at index {index}{f' of {where}' if where else ''})")
        super().__init__(
            f"{collective}: the input holds a non-finite value on {', '.join(parts)} (COLLECTIVES_CHECK_NAN=1; the first such element of each rank's input, its "
            f"flat index in C order). Nothing was reduced on any rank: every input is unchanged and the "
            f"communicator is usable; find where the values of the ranks named became NaN or inf (a division "
            f"by zero, a log of 0, a learning rate too high, an overflow in float16)")

    def __reduce__(self):
        return (type(self), (self.collective, self.found))


class NcclError(CollectiveError):
    """A NCCL call failed.

    Attributes:
        status: the numeric ``ncclResult_t``.
        name: its symbolic name (``"ncclInvalidArgument"``, ...).
        detail: NCCL's own text (``ncclGetErrorString`` and ``ncclGetLastError``).

    Example:
        >>> from collectives import NcclError
        >>> e = NcclError(4, "ncclInvalidArgument", "invalid argument")
        >>> (e.status, e.name)
        (4, 'ncclInvalidArgument')
        >>> import pickle; pickle.loads(pickle.dumps(e)).status
        4
    """

    def __init__(self, status: int, name: str = "", detail: str = "", call: str = ""):
        self.status = int(status)
        self.name = name
        self.detail = detail
        self.call = call
        where = f"{call}: " if call else ""
        super().__init__(f"{where}NCCL error {self.status} ({name}): {detail}".rstrip(": "))

    def __reduce__(self):
        return (type(self), (self.status, self.name, self.detail, self.call))


# ---------------------------------------------------------------------------------------------------------
# MPI's own errors, as CollectiveError


def transport_failure(exc: BaseException, what: str) -> CollectiveError | None:
    """A :class:`CollectiveError` describing ``exc`` if it is an error MPI reported (``mpi4py.MPI.Exception``),
    else None. mpi4py is looked up, never imported: if it is not loaded, no MPI call can have failed."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not isinstance(exc, MPI.Exception):
        return None
    try:
        name = MPI.Get_error_string(exc.Get_error_class()).split(",")[0]
    except Exception:  # noqa: BLE001 - a broken MPI must not hide the original error
        name = "error"
    text = str(exc).split(", error stack")[0].strip()
    first = text.splitlines()[0] if text else name
    try:
        where = f" on rank {MPI.COMM_WORLD.Get_rank()} of {MPI.COMM_WORLD.Get_size()}"
    except Exception:  # noqa: BLE001
        where = ""
    return CollectiveError(
        f"MPI failed in {what}{where}: {first} (MPI error class {exc.Get_error_class()}: {name}). Usually the "
        f"ranks disagreed: arrays of different sizes, or different collectives in a different order; run "
        f"with COLLECTIVES_CHECK=1 to have the library compare every call across ranks first. After an MPI "
        f"error the job cannot continue reliably: end it")


def reraise(exc: BaseException, what: str):
    """Raise ``exc``, or the :class:`CollectiveError` for it when MPI reported it (the MPI error chained).
    For ``except Exception as exc: reraise(exc, "broadcast")``; costs nothing until something is raised."""
    err = transport_failure(exc, what)
    if err is None:
        raise exc
    raise err from exc


def translating(what: str):
    """Decorator: an MPI error raised inside becomes a :class:`CollectiveError` (see :func:`reraise`).
    The public collectives use :func:`collectives._threads.collective`, which adds the one-thread guard."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - re-raised (MPI errors as CollectiveError)
                reraise(exc, what)
        return call
    return wrap

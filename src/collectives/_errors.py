"""Exception types.

Programming mistakes (a wrong kind of argument, an illegal dtype/op pair, a root out of range) are the
builtin ``TypeError`` and ``ValueError``, raised before any communication. Failures of the distributed
job itself are :class:`CollectiveError` and its subclasses.
"""

from __future__ import annotations

__all__ = [
    "CollectiveError",
    "MismatchError",
    "BackendUnavailableError",
    "CollectiveTimeoutError",
    "NcclError",
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

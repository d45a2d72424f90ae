"""The library communicators made for users' mpi4py communicators (``init(comm=c)``), found by ``c``'s
MPI communicator, not by its Python wrapper.

Frameworks hand a new mpi4py wrapper of the same communicator on every call (``MPI.Intracomm(c)``,
``MPI.Comm.f2py(h)``); a cache keyed by ``id()`` made a new library communicator (an ``MPI_Comm_dup``)
for each, until MPI ran out of communicators (MPICH: about 2000). A cache keyed by the MPI handle alone
would be wrong too: MPI reuses a freed communicator's handle for the next one. So the library marks the
user's MPI communicator itself with an MPI attribute (``MPI_Comm_set_attr``, the standard way to cache per
communicator): every wrapper sees it, a duplicate of it does not inherit it, and freeing the communicator
deletes it. The deletion callback closes the library communicator made for it (``MPI_Comm_free`` is
collective, so every rank of the group closes its own at the same point), so the library holds one
communicator per live user communicator, and no more: the cache is bounded by what the user keeps.
"""

from __future__ import annotations

import itertools
import sys

_made: dict = {}  # token -> (the user's mpi4py communicator, the library Communicator made for it)
_tokens = itertools.count(1)
_keyval = None  # the MPI attribute key, made at first use


def _key(MPI):
    global _keyval
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval(delete_fn=_released)
    return _keyval


def _mpi_comm(comm):
    """mpi4py.MPI when ``comm`` is a usable mpi4py communicator (else None: init reports the error)."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not isinstance(comm, MPI.Comm) or MPI.Is_finalized() or comm == MPI.COMM_NULL:
        return None
    return MPI


def lookup(comm):
    """The open library communicator made for ``comm``'s MPI communicator, else None."""
    MPI = _mpi_comm(comm)
    if MPI is None:
        return None
    entry = _made.get(comm.Get_attr(_key(MPI)))
    if entry is None or entry[1].closed:
        return None
    return entry[1]


def remember(comm, ours) -> None:
    """Record ``ours`` as the library communicator for ``comm`` (an mpi4py communicator)."""
    MPI = _mpi_comm(comm)
    token = next(_tokens)
    _made[token] = (comm, ours)
    if MPI is not None:
        comm.Set_attr(_key(MPI), token)  # replaces (and so releases) a closed one made for it before


def _released(comm, keyval, token) -> None:
    """MPI's deletion callback: the user freed ``comm`` (or the attribute was replaced): close ours."""
    entry = _made.pop(token, None)
    if entry is None:
        return
    try:
        entry[1].close()
    except Exception:  # noqa: BLE001 - an exception must not escape into MPI_Comm_free's callback
        pass


def forget_all() -> list:
    """Forget every recorded communicator and return them (``finalize`` closes them), in creation order."""
    entries = list(_made.values())
    _made.clear()
    for user, _ in entries:
        MPI = _mpi_comm(user)
        if MPI is not None:
            try:
                user.Delete_attr(_key(MPI))  # its callback finds nothing to close: finalize does that
            except Exception:  # noqa: BLE001 - the user may have freed it meanwhile (then it is gone)
                pass
    return [ours for _, ours in entries]

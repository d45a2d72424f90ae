"""Communicators the MPI tests make for themselves."""

from __future__ import annotations

import contextlib
import os

import collectives as coll


@contextlib.contextmanager
def deadline_communicator():
    """A second communicator of every rank whose transport has a deadline (``COLLECTIVES_TIMEOUT`` set
    at its init), closed at the end. Collective; needs the MPI backend."""
    from mpi4py import MPI

    user = MPI.COMM_WORLD.Dup()
    os.environ["COLLECTIVES_TIMEOUT"] = "300"
    try:
        c = coll.init(comm=user)
    finally:
        del os.environ["COLLECTIVES_TIMEOUT"]
    assert type(c._host).__name__ == "DeadlineMPITransport"
    try:
        yield c
    finally:
        user.Free()  # releases (closes) the library communicator made for it

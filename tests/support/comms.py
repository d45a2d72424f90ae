"""Communicators the MPI tests make for themselves."""

from __future__ import annotations

import contextlib
import os

import pytest

import collectives as coll


@contextlib.contextmanager
def deadline_communicator():
    """A second communicator of every rank whose transport has a deadline (``COLLECTIVES_TIMEOUT`` set
    at its init), closed at the end. Collective; needs the MPI backend."""
    with communicator(COLLECTIVES_TIMEOUT=300) as c:
        yield c


def gather_objects(obj) -> list:
    """Every rank's ``obj``, in rank order, over MPI's world (the tests' own channel for comparing what the
    ranks got, so that checking the library does not depend on the library); ``[obj]`` without MPI."""
    if coll.world().backend != "mpi":
        return [obj]
    from mpi4py import MPI

    return MPI.COMM_WORLD.allgather(obj)


SETTINGS = ("COLLECTIVES_SHM", "COLLECTIVES_SHM_THRESHOLD", "COLLECTIVES_SHM_SLOT_BYTES", "COLLECTIVES_TIMEOUT",
            "COLLECTIVES_SIMULATE_NODES", "COLLECTIVES_MAX_COUNT", "COLLECTIVES_SYNC_PIPELINE", "COLLECTIVES_CHECK_NAN",
            "COLLECTIVES_REPRODUCIBLE")


@contextlib.contextmanager
def settings(**env):
    """Exactly these library settings in the environment (the others unset) while the block runs: a
    transport made in it (``init``, a ``split``, a DistributedOptimizer's gradient communicator) reads
    them."""
    saved = {k: os.environ.pop(k, None) for k in SETTINGS}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        for k in SETTINGS:
            os.environ.pop(k, None)
            if saved[k] is not None:
                os.environ[k] = saved[k]


@contextlib.contextmanager
def communicator(**env):
    """A new communicator of every rank, made with exactly these settings (an mpi4py duplicate under
    ``init(comm=...)``, the public way a framework brings its own communicator)."""
    from mpi4py import MPI

    user = MPI.COMM_WORLD.Dup()
    with settings(**env):
        c = coll.init(comm=user)
    failed = False
    try:
        yield c
    except BaseException as exc:
        # A failed test, on this rank: the suite aborts the job once pytest reports it (conftest), and
        # closing first could hang it, collective as the close is where the ranks' transports still work (a
        # rank whose call raised where another's timed out would free the node-shared window alone) -- then
        # nothing is reported at all. The communicator lives to the abort. (A skip is no failure.)
        failed = MPI.COMM_WORLD.Get_size() > 1 and not isinstance(exc, pytest.skip.Exception)
        raise
    finally:
        if not failed:
            c.close()
            user.Free()  # (freeing it would also close the library's communicator made for it)

"""torch's creator of the ``"collectives"`` backend's groups: the default group (the world, or the
workers of torchrun joined into one MPI job) and ``new_group``'s groups of exactly their ranks."""

from __future__ import annotations

import collectives as _coll

from .. import _config
from .._comm import engine_of
from .._errors import BackendUnavailableError
from .group import ProcessGroupCollectives
from .rendezvous import _join_torchrun_workers, _torchrun_refusal
from .work import _seconds

_groups = None  # the world's MPI transport, once its "groups" lane is made (with the default group)


def _members(ranks: list[int], timeout: float | None):
    """``(Communicator, mpi4py communicator)`` of exactly ``ranks`` (the world's ranks), made by them alone,
    every wait bounded by ``timeout`` seconds (None: unbounded)."""
    world = _coll.world()
    if world.size == 1 or _groups is None:  # one process (or MPI not in use): the group is this process
        return world.split(0, 0, timeout=timeout), None
    sub = _groups.create_group(ranks)
    if sub is None:  # not a member (torch calls the creator on members only)
        raise RuntimeError(f"new_group: rank {world.rank} is not among the group's ranks {sorted(ranks)}")
    base = _coll.init(comm=sub)
    if timeout is None:
        return base, sub
    # the group's communicator, bounded: a split of base (closing base, at shutdown, closes it too)
    return base.split(0, base.rank, timeout=timeout), (base, sub)


def _create(options, backend_options=None):
    """torch's creator of a ``"collectives"`` backend (the extended API: it learns the group's ranks)."""
    global _groups
    ranks = list(options.global_ranks_in_group)
    joined = None if ranks else _join_torchrun_workers(options)
    try:
        world = _coll.init()
    except BackendUnavailableError as exc:
        if joined != "pmi":
            raise
        # an MPI that ignores PMI-1 (Open MPI) is a job of one process beside the PMI variables' size
        raise ValueError(_torchrun_refusal(options.group_rank, options.group_size, joined)) from exc
    finally:
        if joined == "pmi":
            _config.set_pmi_client(None)  # MPI runs: no process started later inherits the PMI variables
    if not ranks:  # the default group: the world
        if (options.group_size, options.group_rank) != (world.size, world.rank):
            if world.size == 1 and _config.torchrun_run_id() is not None:
                raise ValueError(_torchrun_refusal(options.group_rank, options.group_size, joined or "mpi"))
            raise ValueError(
                f"init_process_group('collectives'): torch has rank {options.group_rank} of {options.group_size}, "
                f"MPI rank {world.rank} of {world.size}: the collectives backend runs in the MPI job, whose ranks "
                f"must be torch's. Launch with mpiexec/srun and leave RANK/WORLD_SIZE unset (the environment of "
                f"torchrun does not start an MPI job)")
        if world.size > 1 and world.backend == "mpi" and _groups is None:
            host = engine_of(world).host
            host.lane("groups")  # every rank is here: the parent of later groups, made collectively
            _groups = host
        # a communicator of its own (every rank is here): torch's collectives never interleave with the
        # program's own on the world, and a group left broken by a failure ends with it
        return ProcessGroupCollectives(world.split(0, world.rank, timeout=_seconds(options.timeout)), options.timeout)
    comm, keep = _members(ranks, _seconds(options.timeout))
    return ProcessGroupCollectives(comm, options.timeout, keep)



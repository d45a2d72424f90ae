"""collectives as a ``torch.distributed`` backend: DDP, FSDP2 and every ``dist.*`` collective over MPI
(host tensors) and our NCCL binding (CUDA tensors), with pip's torch, which has no MPI backend.

Importing this module registers the backend ``"collectives"`` (idempotent)::

    import torch.distributed as dist
    import collectives.torch_backend          # registers "collectives"
    dist.init_process_group("collectives")    # under mpiexec/srun: rank and size from MPI

Under a launcher nothing else is needed: no ``MASTER_ADDR``/``MASTER_PORT``, no ``RANK``/``WORLD_SIZE``,
and no listening socket. Outside a launcher it is a group of one process, like :func:`collectives.init`.
Under torchrun (MPICH, one machine) ``init_process_group`` makes its workers one MPI job by serving them
PMI-1, the protocol of MPICH's launcher; where that cannot work it raises a ``ValueError`` naming the
``mpiexec`` command to run instead (docs/torchrun.md).

How it fits torch:

- **Rendezvous.** ``init_process_group`` without ``init_method`` asks torch's ``env://`` handler for a
  store, a rank and a size; that handler needs ``MASTER_ADDR``/``MASTER_PORT`` (and ``RANK``) and opens a
  TCP server (``TCPStore``) on rank 0. This module wraps it; first match wins:
  ``init_method="collectives://"``: MPI's ranks, the store below; ``MASTER_ADDR``/``MASTER_PORT`` set and
  the rank known (``RANK`` or ``rank=``): torch's handler unchanged (torchrun, Lightning); ``MASTER_ADDR``/
  ``MASTER_PORT`` set, no rank, under an MPI launcher (``accelerate launch --mpirun_hostfile``): MPI's ranks
  with torch's ``TCPStore`` at ``MASTER_ADDR``; ``MASTER_ADDR`` unset: MPI's ranks, the store below.
- **The store.** The ``"collectives"`` backend never uses it: its collectives travel over MPI/NCCL.
  torch itself touches it only for its optional store-based barrier (``TORCH_DIST_INIT_BARRIER=1``) and to
  set up other backends on the same group (gloo, NCCL). So: one process: torch's in-memory ``HashStore``;
  every rank on one node: torch's ``FileStore`` on a file rank 0 keeps open and whose name it removes once
  every rank reaches it through ``/proc/<pid>/fd`` (no file outlives the job, even killed); ranks on
  several nodes: a store that raises a clear error on use (pass ``init_method`` or ``store=`` if you need
  one).
- **The process group** (:class:`ProcessGroupCollectives`, a Python ``ProcessGroup`` as torch's own
  threaded test group is) runs every operation through the public collectives of its
  :class:`~collectives.Communicator` (split with the group's ``timeout=``, so every wait of its calls is
  bounded): with ``async_op=True``, or, for an operation torch waits for at once (``async_op=False``,
  the options' ``asyncOp``), the blocking call at once. Same validation, same dtype rules (an illegal
  op/dtype pair raises the ``TypeError`` that :func:`collectives.allreduce` raises), same bits.
- **Work.** Every operation returns a :class:`Work` backed by our handles (:class:`~collectives.Handle`),
  complete at once where the operation ran at the call: ``wait()`` (bounded by torch's ``timeout=`` and
  ``COLLECTIVES_TIMEOUT``), ``is_completed()`` (never blocks), ``get_future()`` (see :class:`Work`).
- **Groups.** ``dist.new_group(ranks)`` makes a communicator of exactly those ranks (torch calls the
  backend on members only, so it is made with ``MPI_Comm_create_group``, which only members call);
  ``split_group`` needs an accelerator in torch itself.

The package has one job a module: ``work`` (:class:`Work`), ``checks`` (torch's ops as ours, and the
argument checks that refuse what gloo refuses), ``uneven`` (the operations of any sizes), ``group``
(:class:`ProcessGroupCollectives`), ``rendezvous`` (the store, ``env://``, torchrun's workers), ``creator``
(torch's creator of the groups) and ``excepthook``; this module registers them (:func:`register`).

Example:
    >>> import torch, torch.distributed as dist
    >>> import collectives.torch_backend
    >>> dist.init_process_group("collectives")
    >>> t = torch.ones(3)
    >>> dist.all_reduce(t)
    >>> bool((t == dist.get_world_size()).all())
    True
    >>> dist.destroy_process_group()
"""


from __future__ import annotations

import importlib
import sys

import torch.distributed as dist

from .creator import _create
from .excepthook import _explaining
from .group import BACKEND as BACKEND
from .group import DEVICES as DEVICES
from .group import ProcessGroupCollectives as ProcessGroupCollectives
from .rendezvous import SCHEME as SCHEME
from .rendezvous import _mpi_rendezvous as _mpi_rendezvous  # (the rendezvous' pieces that tests look at)
from .rendezvous import _rendezvous_kind as _rendezvous_kind
from .rendezvous import _store_file as _store_file
from .rendezvous import _with_mpi_ranks as _with_mpi_ranks
from .rendezvous import _wrap_env
from .work import Work as Work

__all__ = ["BACKEND", "ProcessGroupCollectives", "Work", "register"]


def register() -> None:
    """Register the backend ``"collectives"`` and the rendezvous (importing this module does it).
    Idempotent.

    Example:
        >>> import torch.distributed as dist, collectives.torch_backend as ctb
        >>> ctb.register(); ctb.register()
        >>> "collectives" in dist.Backend.backend_list
        True
    """
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=list(DEVICES))
    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module (the package's attribute of
    handlers = rdzv._rendezvous_handlers  # that name is its function); torch reads handlers from this dict
    if SCHEME not in handlers:
        rdzv.register_rendezvous_handler(SCHEME, _mpi_rendezvous)
    if not hasattr(handlers.get("env"), "_collectives_wraps"):
        handlers["env"] = _wrap_env(handlers["env"])
    if not getattr(sys.excepthook, "_collectives_lightning", False):
        sys.excepthook = _explaining(sys.excepthook)



register()

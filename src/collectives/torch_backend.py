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

import atexit
import contextlib
import functools
import importlib
import math
import os
import shlex
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch
import torch.distributed as dist

import collectives as _coll

from . import _call, _config, _launcher, _trace_torch
from ._comm import engine_of
from ._errors import BackendUnavailableError, CollectiveTimeoutError, MismatchError

__all__ = ["BACKEND", "ProcessGroupCollectives", "Work", "register"]

BACKEND = "collectives"
DEVICES = ("cpu", "cuda")  # the devices the backend is registered for (host tensors over MPI, CUDA over NCCL)
SCHEME = "collectives"

_R: Any = dist.ReduceOp.RedOpType  # Any: torch's stubs do not list its members (SUM, ..., PREMUL_SUM)
_OPS = {_R.SUM: "sum", _R.PRODUCT: "prod", _R.MIN: "min", _R.MAX: "max", _R.AVG: "mean"}


def _op(reduce_op) -> tuple[str, object]:
    """``(our op name, PREMUL_SUM's factor or None)`` for a torch ``ReduceOp`` (or its ``RedOpType``)."""
    kind = reduce_op if isinstance(reduce_op, _R) else reduce_op.op  # ReduceOp.SUM is a RedOpType
    if kind == _R.PREMUL_SUM:
        return "sum", reduce_op.factor
    name = _OPS.get(kind)
    if name is None:
        raise ValueError(f"the collectives backend has no reduction {kind.name} (it reduces with SUM, PRODUCT, "
                         f"MIN, MAX, AVG and PREMUL_SUM); for bitwise and/or on bool tensors use MIN/MAX")
    return name, None


_OWN_NAMES = {_R.AVG: "avg", _R.PREMUL_SUM: "premul_sum"}  # torch's ops that run as one of ours, differently


def _describing_op(at: int):
    """A reduction method whose ``opts`` is its argument ``at``: the calls it makes are described with torch's
    op where torch's op is not one of ours (``AVG``: a mean, or a truncated sum of integers; ``PREMUL_SUM``:
    a sum of scaled tensors), so that AVG on one rank and SUM on another are a MismatchError (``_call``)."""

    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            opts = kwargs["opts"] if "opts" in kwargs else args[at] if len(args) > at else None
            reduce_op = _opts_op(opts)
            kind = reduce_op if isinstance(reduce_op, _R) else getattr(reduce_op, "op", None)
            named = _OWN_NAMES.get(kind)
            if named is None:
                return method(self, *args, **kwargs)
            with _call.naming(named):
                return method(self, *args, **kwargs)

        return run

    return wrap


def _seconds(timeout) -> float | None:
    """Seconds of a torch timeout (a ``timedelta``); None for none (zero: torch's kNoTimeout)."""
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return s if s > 0 else None


class Work(dist.Work):
    """What every operation of :class:`ProcessGroupCollectives` returns: torch's ``Work``, backed by the
    handles (:class:`~collectives.Handle`) of our asynchronous collectives.

    - ``wait(timeout)`` completes the operation (its results are in the output tensors afterwards) and
      returns True; it raises the operation's error (``MismatchError``, ``CollectiveError``, ...), or
      :class:`~collectives.CollectiveTimeoutError` when it has not completed within ``timeout`` (else the
      group's ``timeout=`` from ``init_process_group``/``new_group``, else ``COLLECTIVES_TIMEOUT`` as it
      was when the group was made, the smallest of those set).
    - ``is_completed()`` never blocks (it asks MPI whether the transfer is complete, which also lets it
      progress).
    - ``get_future()`` returns a ``torch.futures.Future`` holding the output tensors. It completes the
      operation first (as ``wait()``; an error is then set on the future rather than raised): no thread
      progresses our collectives in the background, so a future handed out before completion would only
      complete when something else waited. DDP asks for the future as it launches each bucket's
      allreduce, so DDP's allreduces complete in the backward pass, bucket by bucket.

    Example:
        >>> import torch, torch.distributed as dist
        >>> import collectives.torch_backend
        >>> dist.init_process_group("collectives")
        >>> t = torch.ones(4)
        >>> work = dist.all_reduce(t, async_op=True)
        >>> work.wait(), work.is_completed(), work.get_future().wait()[0] is t
        (True, True, True)
        >>> dist.destroy_process_group()
    """

    def __init__(self, what: str, handles, finish, result, timeout_s: float | None):
        super().__init__()
        self._what = what
        self._handles = list(handles)
        self._finish = finish  # callable(list of handle results) -> None: copies into output tensors
        self._result = result  # what the future holds: the output tensors
        self._timeout_s = timeout_s
        self._future: torch.futures.Future | None = None  # made by get_future (most Works are only waited for)
        self._error: BaseException | None = None
        self._done = False
        if all(h.done() for h in self._handles):
            self._complete()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self._done else "pending"
        return f"<collectives.torch_backend.Work {self._what} {state}>"

    def _complete(self) -> None:
        try:
            results = [h.wait() for h in self._handles]
            if self._finish is not None:
                self._finish(results)
        except Exception as exc:  # noqa: BLE001 - held: raised by wait(), set on the future
            self._error = exc
        self._done = True
        self._handles = []

    def is_completed(self) -> bool:
        """Whether the operation has completed (also when it failed). Never blocks."""
        if not self._done and all(h.done() for h in self._handles):
            self._complete()
        return self._done

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Complete the operation (bounded: see the class); True, or raise its error."""
        if not self._done:
            bounds = [b for b in (_seconds(timeout), self._timeout_s) if b is not None]
            limit = min(bounds) if bounds else None
            end = None if limit is None else time.monotonic() + limit
            try:  # each handle's wait is bounded by what is left; one that times out fails the group
                for h in self._handles:
                    h.wait(None if end is None else max(0.0, end - time.monotonic()))
            except CollectiveTimeoutError as exc:
                raise CollectiveTimeoutError(
                    f"{self._what} did not complete within {limit:g} s (the smallest of wait(timeout=), the "
                    f"group's timeout= and COLLECTIVES_TIMEOUT): another rank has not issued the matching "
                    f"call, or died. The group cannot be used further (every later operation on it raises); "
                    f"end the job") from exc
            except Exception:  # noqa: BLE001 - the operation's own error: held by _complete, raised below
                pass
            self._complete()
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        """A future of the output tensors, completed (see the class)."""
        if not self._done:
            try:
                self.wait()
            except CollectiveTimeoutError as exc:
                self._done, self._error = True, exc
            except Exception:  # noqa: BLE001 - the error is on the future
                pass
        if self._future is None:
            self._future = torch.futures.Future()
            if self._error is not None:
                self._future.set_exception(self._error)
            else:
                self._future.set_result(self._result)
        return self._future

    def exception(self):
        """The operation's error once it has completed with one, else None."""
        return self._error

    def result(self) -> list:
        """The output tensors, after :meth:`wait`."""
        self.wait()
        return self._result


class _Done:
    """The handle of an operation made at the call (see :meth:`ProcessGroupCollectives._start`)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def done(self) -> bool:
        return True

    def wait(self, timeout=None):
        return self.value


def _one(tensors, what: str):
    if isinstance(tensors, torch.Tensor):
        return tensors
    if len(tensors) != 1:
        raise ValueError(f"{what}: the collectives backend takes one tensor per process (torch's single-device "
                         f"form), got a list of {len(tensors)}")
    return tensors[0]


def _same_shapes(what: str, reference: torch.Tensor, tensors, role: str) -> None:
    for i, t in enumerate(tensors):
        if t.shape != reference.shape or t.dtype != reference.dtype:
            raise ValueError(f"{what}: every {role} must have the input's shape {tuple(reference.shape)} and dtype "
                             f"{reference.dtype} (the collectives backend moves equal blocks), got "
                             f"{tuple(t.shape)} {t.dtype} at index {i}")


def _integer_mean(op: str, t) -> bool:
    """AVG of an integer tensor: torch's NCCL backend sums and divides, truncating toward zero (Lightning
    averages an int64 batch count so, on every backend but gloo); our own ``op="mean"`` refuses integers."""
    return op == "mean" and not (t.is_floating_point() or t.is_complex()) and t.dtype != torch.bool


def _truncated(t, n: int) -> None:
    """``t //= n`` toward zero, in place (C's and NCCL's integer division, not Python's floor)."""
    torch.div(t, n, rounding_mode="trunc", out=t)


def _same_dtype(what: str, output, input) -> None:
    """gloo's rule: the output tensor has the input's dtype (never a silent cast)."""
    if output.dtype != input.dtype:
        raise TypeError(f"{what}: the output tensor's dtype {output.dtype} must be the input's {input.dtype} "
                        f"(the collectives backend does not cast, as gloo does not)")


def _opts_op(opts):
    if opts is None:
        return dist.ReduceOp.SUM
    if isinstance(opts, (dist.ReduceOp, _R)):
        return opts
    return opts.reduceOp


class ProcessGroupCollectives(dist.ProcessGroup):
    """The ``torch.distributed`` process group of the ``"collectives"`` backend: every operation is a
    collective of :attr:`communicator` (made by ``init_process_group("collectives")`` and ``new_group``,
    not constructed directly).

    Operations: ``allreduce`` (SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM), ``allreduce_coalesced``,
    ``broadcast``, ``reduce``, ``allgather``, ``all_gather_single`` (``all_gather_into_tensor``),
    ``allgather_into_tensor_coalesced``, ``reduce_scatter``, ``reduce_scatter_single``
    (``reduce_scatter_tensor``), ``reduce_scatter_tensor_coalesced``, ``alltoall``, ``all_to_all_single``
    (any split sizes), ``gather``, ``scatter``, ``barrier``; torch's object collectives run on these; ``send``,
    ``recv`` and ``recv_anysource`` (``dist.send``/``recv``/``isend``/``irecv``, ``batch_isend_irecv``, with
    tags).
    ``allgather`` (different sizes per rank) and ``alltoall``/``all_to_all_single`` (any sizes) agree the
    sizes first, in one small allgather: ranks that disagree get a ``MismatchError`` on every rank before
    the data moves. ``_device_types`` lists CPU and CUDA, as DCP expects of a group.

    Example (uneven all_gather):
        >>> import torch, torch.distributed as dist
        >>> import collectives.torch_backend
        >>> dist.init_process_group("collectives")
        >>> n, me = dist.get_world_size(), dist.get_rank()
        >>> outs = [torch.empty(r + 1) for r in range(n)]
        >>> dist.all_gather(outs, torch.full((me + 1,), float(me)))
        >>> outs[0].tolist(), outs[-1].shape == (n,)
        ([0.0], True)
        >>> dist.destroy_process_group()

    Example:
        >>> import torch, torch.distributed as dist
        >>> import collectives.torch_backend as ctb
        >>> dist.init_process_group("collectives")
        >>> pg = dist.distributed_c10d._get_default_group()
        >>> isinstance(pg, ctb.ProcessGroupCollectives), pg.getBackendName()
        (True, 'collectives')
        >>> pg.communicator.size == dist.get_world_size()
        True
        >>> dist.destroy_process_group()
    """

    def __init__(self, comm, timeout: timedelta | None = None, keep=None):
        super().__init__(comm.rank, comm.size)  # type: ignore[call-arg]  # the (rank, size) overload; the stub lists only (store, rank, size)
        self._comm = comm
        self._timeout_s = _seconds(timeout)
        # what bounds each Work's wait(): the smaller of the group's timeout= and COLLECTIVES_TIMEOUT (read
        # here, once per group, not per operation)
        self._wait_s = min((b for b in (self._timeout_s, _config.timeout()) if b is not None), default=None)
        self._keep = keep  # the mpi4py communicator ours was made from (its lifetime bounds ours), or
        # (the Communicator ours was split from, that mpi4py communicator)
        self._torch_seq = [0, 0, 0]  # torch's numbering of the group's operations: collectives, p2p, all
        # (as ProcessGroupNCCL counts them, for the flight recorder's dumps in torch's format: _numbered)
        # A large CPU allreduce that the ranks' own CPUs compute (one node: the node-shared window) runs at
        # the call, bounded by the group's timeout: every Work is waited for at once anyway (get_future,
        # async_op=False), and MPI's Iallreduce would move it at a fraction of the window's speed
        host = engine_of(comm).host
        host.allreduce_at_start(self._timeout_s, "the group's timeout")
        # its blocking calls are fingerprinted and bounded (_start), or it has no other rank to wait for
        self._at_once = host.checks_beside or comm.size == 1

    @property
    def communicator(self):
        """The :class:`collectives.Communicator` this group's operations run on."""
        return self._comm

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def _device_types(self) -> list:
        """The devices the group runs collectives on, as torch's ``ProcessGroup._device_types`` lists those
        of its registered backends (the backend's ``devices``, CPU first). torch's C++ group would learn
        them from ``_register_backend``, which a Python group has no backend object for; DCP reads them
        (``async_save`` needs the CPU, ``set_model_state_dict(broadcast_from_rank0=True)`` picks its
        device from them) and so does ``_get_pg_default_device`` (object collectives stay on the CPU)."""
        return [torch.device(d) for d in DEVICES]

    def shutdown(self) -> None:
        """Release the group's communicator (``dist.destroy_process_group`` calls it on every member)."""
        comm, self._comm = self._comm, None
        if comm is not None and not comm.closed:
            comm.close()
        keep, self._keep = self._keep, None
        if isinstance(keep, tuple):  # (the communicator ours was split from, the mpi4py one under both)
            base, keep = keep
            if not base.closed:
                base.close()
        if keep is not None:
            keep.Free()

    # torch keeps a group's name and description on its C++ backends, which a Python group has none of:
    # kept here (torch's C++ calls these through its Python-group trampoline)
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return getattr(self, "_group_desc", "")

    def __repr__(self) -> str:
        return f"<collectives.torch_backend.ProcessGroupCollectives rank={self.rank()} size={self.size()}>"

    def _work(self, what, handles, finish=None, result=None) -> Work:
        return Work(what, handles, finish, result, self._wait_s)

    def _start(self, opts, call, *args):
        """``call(*args, async_op=True)``: the handle of one of our collectives; or, where torch will wait
        for the operation at once (``async_op=False``: torch passes it as the options' ``asyncOp``) and the
        group's communicator bounds and checks its blocking calls (a deadline: the group's ``timeout=``),
        the blocking call made now (the hot path: no handle to drive), as a completed handle. Either way
        the call is described, fingerprinted and bounded by the same engine, and gives the same bits."""
        if self._at_once and opts is not None and opts.asyncOp is False:
            return _Done(call(*args))
        return call(*args, async_op=True)

    # ---- reductions ----
    @_describing_op(1)
    def allreduce(self, tensors, opts=None):
        op, factor = _op(_opts_op(opts))
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if factor is not None:
            for t in tensors:
                t.mul_(factor)
        if len(tensors) == 1:
            t = tensors[0]
            if _integer_mean(op, t):
                n = self.size()
                return self._work("allreduce", [self._start(opts, self._comm.allreduce, t, "sum")],
                                  lambda _: _truncated(t, n), tensors)
            return self._work("allreduce", [self._start(opts, self._comm.allreduce, t, op)], result=tensors)
        return self._coalesced("allreduce", tensors, op)

    @_describing_op(1)
    def allreduce_coalesced(self, tensors, opts=None):
        op, factor = _op(_opts_op(opts))
        tensors = list(tensors)
        if factor is not None:
            for t in tensors:
                t.mul_(factor)
        return self._coalesced("allreduce_coalesced", tensors, op)

    def _coalesced(self, what: str, tensors: list, op: str) -> Work:
        """Several tensors reduced as one flat tensor per (dtype, device), each an asynchronous allreduce
        (a fingerprint beside it; bounded by the group's timeout like every other Work), then copied back."""
        groups: dict = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        flats = [(ts, torch.cat([t.reshape(-1) for t in ts])) for ts in groups.values()]
        truncating = [_integer_mean(op, flat) for _, flat in flats]
        handles = [self._comm.allreduce(flat, "sum" if trunc else op, async_op=True)
                   for (_, flat), trunc in zip(flats, truncating, strict=True)]
        size = self.size()

        def finish(results):
            for (ts, _), out, trunc in zip(flats, results, truncating, strict=True):
                if trunc:
                    _truncated(out, size)
                at = 0
                for t in ts:
                    n = t.numel()
                    t.copy_(out[at:at + n].reshape(t.shape))
                    at += n

        return self._work(what, handles, finish, tensors)

    @_describing_op(1)
    def reduce(self, tensors, opts=None):
        t = _one(tensors, "reduce")
        op, factor = _op(_opts_op(opts))
        if factor is not None:
            t.mul_(factor)
        root = 0 if opts is None else opts.rootRank
        if _integer_mean(op, t):
            n, mine = self.size(), self.rank() == root
            return self._work("reduce", [self._start(opts, self._comm.reduce, t, "sum", root)],
                              lambda _: _truncated(t, n) if mine else None, [t])
        return self._work("reduce", [self._start(opts, self._comm.reduce, t, op, root)], result=[t])

    def _scaled(self, t, factor):
        return t if factor is None else t * factor

    @_describing_op(2)
    def reduce_scatter_single(self, output, input, opts=None):
        op, factor = _op(_opts_op(opts))
        if input.numel() != output.numel() * self.size():
            raise ValueError(f"reduce_scatter_tensor: the input must hold size ({self.size()}) times the output's "
                             f"{output.numel()} elements, got {input.numel()}")
        _same_dtype("reduce_scatter_tensor", output, input)
        blocks = self._scaled(input, factor).reshape((self.size(),) + tuple(output.shape))
        trunc, n = _integer_mean(op, input), self.size()
        h = self._start(opts, self._comm.reduce_scatter, blocks, "sum" if trunc else op)

        def finish(r):
            output.copy_(r[0].reshape(output.shape))
            if trunc:
                _truncated(output, n)

        return self._work("reduce_scatter_tensor", [h], finish, [output])

    _reduce_scatter_base = reduce_scatter_single

    @_describing_op(2)
    def reduce_scatter(self, outputs, inputs, opts=None):
        output = _one(outputs, "reduce_scatter")
        blocks = _one(inputs, "reduce_scatter")
        if len(blocks) != self.size():
            raise ValueError(f"reduce_scatter: input_list must hold one tensor per rank ({self.size()}), got "
                             f"{len(blocks)}")
        _same_shapes("reduce_scatter", output, blocks, "input tensor")
        op, factor = _op(_opts_op(opts))
        stacked = self._scaled(torch.stack(list(blocks)), factor)
        trunc, n = _integer_mean(op, output), self.size()
        h = self._start(opts, self._comm.reduce_scatter, stacked, "sum" if trunc else op)

        def finish(r):
            output.copy_(r[0].reshape(output.shape))
            if trunc:
                _truncated(output, n)

        return self._work("reduce_scatter", [h], finish, [output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._work("reduce_scatter_tensor_coalesced", [], lambda _: [w.wait() for w in works],
                          list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # ---- data movement ----
    # broadcast, gather and scatter: torch's stubs also list ProcessGroup's (tensor, root, timeout) overload,
    # which c10d never calls on a backend; it calls the (tensors, opts) form, the one written here
    def broadcast(self, tensors, opts=None):  # type: ignore[override]  # c10d's form only (above)
        t = _one(tensors, "broadcast")
        root = 0 if opts is None else opts.rootRank
        return self._work("broadcast", [self._start(opts, self._comm.broadcast, t, root)], result=[t])

    def allgather(self, outputs, inputs, opts=None):
        outs = _one(outputs, "allgather")
        t = _one(inputs, "allgather")
        if len(outs) != self.size():
            raise ValueError(f"allgather: tensor_list must hold one tensor per rank ({self.size()}), got {len(outs)}")
        if any(o.shape != t.shape for o in outs):  # uneven, as torch's NCCL backend takes them (gloo refuses)
            return self._allgather_uneven(outs, t)
        _same_shapes("allgather", t, outs, "output tensor")
        h = self._start(opts, self._comm.allgather, t)

        def finish(r):
            for o, g in zip(outs, r[0], strict=True):
                o.copy_(g)

        return self._work("allgather", [h], finish, [list(outs)])

    def _allgather_uneven(self, outs, t) -> Work:
        """all_gather of tensors of different sizes: every rank's input padded to the largest, one allgather,
        each block cut to its size. The sizes are agreed first (one small allgather): each rank gives its
        input's size and the sizes its tensor_list expects, and any difference is a MismatchError on every
        rank before the data moves."""
        me = self.rank()
        if outs[me].numel() != t.numel():
            raise ValueError(f"all_gather: tensor_list[{me}] (this rank's) must have the input's shape "
                             f"{tuple(t.shape)}, got {tuple(outs[me].shape)}")
        for o in outs:
            _same_dtype("all_gather", o, t)
        counts = self._agreed_counts("all_gather", [t.numel()] + [o.numel() for o in outs])
        given, expected = counts[:, 0], counts[:, 1:]
        bad = np.argwhere(expected != given[None, :])
        if len(bad):
            i, j = bad[0]
            raise MismatchError(f"all_gather: rank {i}'s tensor_list expects {expected[i, j]} elements from rank "
                                f"{j}, whose input has {given[j]}: the ranks disagree about the sizes; nothing was "
                                f"gathered")
        block = int(given.max())
        buf = t.new_zeros(block)
        buf[:t.numel()] = t.reshape(-1)
        h = self._comm.allgather(buf, async_op=True)

        def finish(r):
            for o, g in zip(outs, r[0], strict=True):
                o.copy_(g[:o.numel()].reshape(o.shape))

        return self._work("all_gather", [h], finish, [list(outs)])

    def _agreed_counts(self, what: str, row: list[int]) -> np.ndarray:
        """Every rank's ``row`` of integers (one allgather, waited for within the group's timeout), as an
        ``(size, len(row))`` array, the same on every rank."""
        got: list = []
        h = self._comm.allgather(torch.tensor(row, dtype=torch.int64), async_op=True)
        self._work(f"{what} (the sizes)", [h], lambda r: got.append(r[0].numpy())).wait()
        return got[0]

    def _alltoallv(self, what: str, sends: list, received: list[int], place, result) -> Work:
        """Rank j gets ``sends[j]`` (flat), rank i's block arrives as ``received[i]`` elements; ``place(pieces)``
        puts the blocks (flat, in rank order) into the outputs. The counts are agreed first (one small
        allgather: what each rank sends and expects; a difference is a MismatchError on every rank before
        the data moves), then every block padded to the largest travels in one alltoall."""
        n = self.size()
        counts = self._agreed_counts(what, [s.numel() for s in sends] + list(received))
        sent, expected = counts[:, :n], counts[:, n:]
        bad = np.argwhere(sent != expected.T)
        if len(bad):
            i, j = bad[0]
            raise MismatchError(f"{what}: rank {i} sends {sent[i, j]} elements to rank {j}, which expects "
                                f"{expected[j, i]} from it: the ranks' split sizes disagree; nothing was exchanged")
        block = int(sent.max()) if sent.size else 0
        if block == 0:  # nothing to send anywhere (every rank knows it alike)
            place([s[:0] for s in sends])
            return self._work(what, [], result=result)
        if (sent == block).all():
            buf = torch.cat(sends).reshape(n, block)
        else:
            buf = sends[0].new_zeros((n, block))
            for j, s in enumerate(sends):
                buf[j, :s.numel()] = s
        h = self._comm.alltoall(buf, async_op=True)
        return self._work(what, [h], lambda r: place([b[:c] for b, c in zip(r[0], received, strict=True)]),
                          result)

    def all_gather_single(self, output, input, opts=None):
        if output.numel() != input.numel() * self.size():
            raise ValueError(f"all_gather_into_tensor: the output must hold size ({self.size()}) times the input's "
                             f"{input.numel()} elements, got {output.numel()}")
        _same_dtype("all_gather_into_tensor", output, input)
        h = self._start(opts, self._comm.allgather, input)
        return self._work("all_gather_into_tensor", [h], lambda r: output.copy_(r[0].reshape(output.shape)),
                          [output])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._work("allgather_into_tensor_coalesced", [], lambda _: [w.wait() for w in works],
                          list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        if len(output_lists) != self.size():
            raise ValueError(f"all_gather_coalesced: output_tensor_lists must hold one list per rank ({self.size()}), "
                             f"got {len(output_lists)}")
        # output_lists[rank][i] receives rank's inputs[i]
        works = [self.allgather([[out[i] for out in output_lists]], [t], opts) for i, t in enumerate(inputs)]
        return self._work("allgather_coalesced", [], lambda _: [w.wait() for w in works], list(output_lists))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self.size()
        _same_dtype("all_to_all_single", output, input)
        rows = []
        for name, splits, t in (("input", input_split_sizes, input), ("output", output_split_sizes, output)):
            if t.dim() == 0:
                raise ValueError(f"all_to_all_single: the {name} must have a leading dimension, got a scalar")
            if splits:  # gloo's checks, in its words
                if len(splits) != n:
                    raise ValueError(f"all_to_all_single: {name}_split_sizes={list(splits)} has {len(splits)} "
                                     f"entries for a group of {n} ranks (Number of tensor splits not equal to "
                                     f"group size)")
                if min(splits) < 0:
                    raise ValueError(f"all_to_all_single: {name}_split_sizes={list(splits)} has a negative size")
                if sum(splits) != t.shape[0]:  # gloo: "Split sizes doesn't match total dim 0 size"
                    raise ValueError(f"all_to_all_single: {name}_split_sizes={list(splits)} add up to "
                                     f"{sum(splits)}, but the {name}'s dim 0 is {t.shape[0]} (Split sizes doesn't "
                                     f"match total dim 0 size)")
                rows.append([int(r) for r in splits])
            else:
                if t.shape[0] % n:
                    raise ValueError(f"all_to_all_single: the {name}'s leading dimension must be divisible by the "
                                     f"group's size {n} where no {name}_split_sizes are given, got shape "
                                     f"{tuple(t.shape)}")
                rows.append([t.shape[0] // n] * n)
        if output.shape[1:] != input.shape[1:]:
            raise ValueError(f"all_to_all_single: the output's shape {tuple(output.shape)} must be the input's "
                             f"{tuple(input.shape)} but for dim 0")
        per_row = math.prod(input.shape[1:])
        sends = list(input.reshape(-1).split([r * per_row for r in rows[0]]))

        def place(pieces):
            output.copy_(torch.cat(pieces).reshape(output.shape))

        return self._alltoallv("all_to_all_single", sends, [r * per_row for r in rows[1]], place, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        if len(inputs) != self.size() or len(outputs) != self.size():
            raise ValueError(f"all_to_all: input and output lists must hold one tensor per rank ({self.size()}), "
                             f"got {len(inputs)} and {len(outputs)}")
        for t in list(inputs) + list(outputs):  # any sizes (torch's NCCL backend takes them; gloo refuses)
            _same_dtype("all_to_all", t, inputs[0])

        def place(pieces):
            for o, p in zip(outputs, pieces, strict=True):
                o.copy_(p.reshape(o.shape))

        return self._alltoallv("all_to_all", [t.reshape(-1) for t in inputs], [o.numel() for o in outputs], place,
                               list(outputs))

    def gather(self, outputs, inputs, opts=None):  # type: ignore[override]  # c10d's form only (see broadcast)
        t = _one(inputs, "gather")
        root = opts.rootRank
        outs = _one(outputs, "gather") if self.rank() == root else []
        if self.rank() == root:
            if len(outs) != self.size():
                raise ValueError(f"gather: gather_list must hold one tensor per rank ({self.size()}), got {len(outs)}")
            _same_shapes("gather", t, outs, "gather_list tensor")
        h = self._start(opts, self._comm.gather, t, root)  # MPI_(I)gather: only the root receives

        def finish(r):
            if r[0] is not None:
                for o, g in zip(outs, r[0], strict=True):
                    o.copy_(g)

        return self._work("gather", [h], finish, [list(outs)])

    def scatter(self, outputs, inputs, opts=None):  # type: ignore[override]  # c10d's form only (see broadcast)
        out = _one(outputs, "scatter")
        root = opts.rootRank
        if self.rank() == root:
            blocks = _one(inputs, "scatter")
            if len(blocks) != self.size():
                raise ValueError(f"scatter: scatter_list must hold one tensor per rank ({self.size()}), got "
                                 f"{len(blocks)}")
            _same_shapes("scatter", out, blocks, "scatter_list tensor")
            stacked = torch.stack(list(blocks))
        else:
            stacked = torch.empty((self.size(),) + tuple(out.shape), dtype=out.dtype, device=out.device)
        h = self._start(opts, self._comm.broadcast, stacked, root)  # root's blocks to all; each keeps its own
        return self._work("scatter", [h], lambda r: out.copy_(r[0][self.rank()]), [out])

    def barrier(self, opts=None):
        # an allreduce of one byte, not the library's (blocking) barrier: wait() bounds it like the others
        flag = torch.zeros(1, dtype=torch.uint8)
        return self._work("barrier", [self._start(opts, self._comm.allreduce, flag, "max")], result=[])

    # ---- point-to-point (dist.send/recv/isend/irecv, batch_isend_irecv, pipelining) ----
    # torch calls these for dist.isend/irecv (dist.send/recv wait on the Work they return) and, one after
    # another, for batch_isend_irecv (coalescing is NCCL's ProcessGroup's alone); complex tensors arrive as
    # their real views. Host tensors over MPI, CUDA tensors over NCCL: coll.send/coll.recv.
    def send(self, tensors, dst, tag=0):
        """Start sending the tensor to ``dst`` (this group's rank; this rank itself too, as gloo allows)."""
        t = _one(tensors, "send")
        return self._work("send", [self._comm.send(t, dst, tag, async_op=True)], result=[t])

    def recv(self, tensors, src, tag=0):
        """Start receiving the tensor from ``src``; the Work's ``source_rank()`` is ``src``."""
        t = _one(tensors, "recv")
        return _ReceiveWork("recv", self._comm.recv(t, src, tag, async_op=True), [t], self._wait_s)

    def recv_anysource(self, tensors, tag=0):
        """Start receiving the tensor from any rank; the Work's ``source_rank()`` is the sender's rank."""
        t = _one(tensors, "recv")
        return _ReceiveWork("recv_anysource", self._comm.recv(t, None, tag, async_op=True), [t], self._wait_s)


# the group's operations, as torch's flight recorder names them (after "nccl:"); p2p: send, recv
_TORCH_NAMES = {"allreduce": "all_reduce", "allreduce_coalesced": "allreduce_coalesced", "reduce": "reduce",
                "reduce_scatter_single": "_reduce_scatter_base", "reduce_scatter": "reduce_scatter",
                "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced", "broadcast": "broadcast",
                "allgather": "all_gather", "all_gather_single": "_all_gather_base",
                "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
                "allgather_coalesced": "ALLGATHER_coalesced", "all_to_all_single": "all_to_all",
                "alltoall": "all_to_all", "gather": "gather", "scatter": "scatter", "barrier": "barrier",
                "send": "send", "recv": "recv", "recv_anysource": "recv"}


def _numbered(method, name: str, p2p: bool):
    """A group operation numbered as torch numbers it: the calls it makes on the group's communicator are
    noted (``_trace_torch.note``) as torch's operation ``name`` with the group's collective, p2p and
    operation counts, so that the flight recorder's dumps in torch's format number it as torch would."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self._comm is None:  # (shut down: the operation says so)
            return method(self, *args, **kwargs)
        engine = engine_of(self._comm)
        read = engine.trace_p2p_seq if p2p else engine.trace_seq
        before = read()
        try:
            return method(self, *args, **kwargs)
        finally:
            after = read()
            if after > before:
                seq = self._torch_seq
                seq[1 if p2p else 0] += 1
                seq[2] += 1
                _trace_torch.note(str(engine.name()), p2p, range(before + 1, after + 1),
                                  (self.getGroupName() or str(engine.name()), self.getGroupDesc() or "undefined",
                                   seq[0], seq[1], seq[2], name))

    return run


for _method, _torch_name in _TORCH_NAMES.items():
    setattr(ProcessGroupCollectives, _method, _numbered(getattr(ProcessGroupCollectives, _method), _torch_name,
                                                        _torch_name in ("send", "recv")))


class _ReceiveWork(Work):
    """The Work of a receive: ``source_rank()`` (torch's ``_source_rank()``, which ``dist.recv`` reads) is
    the sender's rank in the group, once the receive has completed (it waits for it), as gloo's."""

    _source: int | None = None

    def __init__(self, what, handle, result, timeout_s):
        super().__init__(what, [handle], self._received, result, timeout_s)

    def _received(self, results) -> None:
        self._source = results[0]

    def source_rank(self) -> int:
        self.wait()
        assert self._source is not None
        return self._source

    _source_rank = source_rank


# ---------------------------------------------------------------------------------------------------------
# the rendezvous: rank and size from MPI, a store without a server

class _UnsharedStore(dist.Store):
    """The store of a job on several nodes: nothing the backend needs, refused clearly on use."""

    def set_timeout(self, timeout):
        pass

    def _refuse(self, *args, **kwargs):
        raise RuntimeError("the collectives backend's store is not shared across nodes (it needs no store itself): "
                           "something asked it for a key (TORCH_DIST_INIT_BARRIER=1, or a gloo/NCCL group on the "
                           "same job). Pass init_method='tcp://...' or 'file://<shared path>' to init_process_group "
                           "for a store shared by every node")

    set = get = add = compare_set = wait = check = delete_key = num_keys = multi_get = multi_set = _refuse


_OPEN: list = []  # rank 0's descriptors of its store files, held to the end of the process


def _store(comm, timeout):
    if comm.size == 1:
        return dist.HashStore()
    if comm.local_size == comm.size:  # one node: a FileStore rank 0 makes, named over MPI
        path = _store_file(comm)
        store = dist.FileStore(path, comm.size)
        store.set_timeout(timeout)
        return store
    return _UnsharedStore()


def _store_file(comm) -> str:
    """The path of the job's FileStore, one no crash leaves behind: rank 0 makes a file in the temporary
    directory, keeps it open and removes its name once every rank can reach it as
    ``/proc/<rank 0's pid>/fd/<n>``; the kernel frees it when rank 0's process ends, however it ends
    (exit, ``MPI_Abort``, SIGKILL). Where the other ranks cannot see rank 0's ``/proc`` (another pid
    namespace, no procfs), the named file is used, removed at exit (not after a kill)."""
    names = None
    if comm.rank == 0:
        fd, name = tempfile.mkstemp(prefix="collectives-torch-store-")
        _OPEN.append(fd)
        names = (name, f"/proc/{os.getpid()}/fd/{fd}")
    name, proc = comm.broadcast_object(names, root=0)
    if all(comm.allgather_object(os.access(proc, os.R_OK | os.W_OK))):
        if comm.rank == 0:
            _unlink(name)  # every rank reaches the file through rank 0's descriptor: no name left
        return proc
    if comm.rank == 0:
        atexit.register(_unlink, name)
    return name


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _query(url: str) -> dict:
    return dict(p.split("=", 1) for p in urlparse(url).query.split("&") if "=" in p)


def _mpi_job(url: str):
    """The world communicator, after checking that a rank or size given to torch (``rank=``/``world_size=``
    in the URL, or ``WORLD_SIZE`` in the environment) is MPI's."""
    comm = _coll.init()
    query = _query(url)
    launch = _config.torch_launch()
    given = {"rank": query.get("rank"), "world_size": query.get("world_size", launch.get("WORLD_SIZE"))}
    if comm.size == 1 and _config.torchrun_run_id() is not None and int(given["world_size"] or 1) > 1:
        raise ValueError(_torchrun_refusal(int(given["rank"] or launch.get("RANK") or 0),
                                           int(given["world_size"] or 1), "mpi"))
    for key, ours in (("rank", comm.rank), ("world_size", comm.size)):
        text = given[key]
        value = int(text) if text else -1
        if value not in (-1, ours):
            raise ValueError(f"init_process_group: {key}={value} was given (argument or environment variable "
                             f"{key.upper()}), but MPI says {ours}: the collectives backend takes ranks from the "
                             f"MPI job; drop {key}= (and {key.upper()}) or launch with mpiexec/srun")
    return comm


def _mpi_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
    """A torch rendezvous handler: ``(store, rank, size)`` from MPI (see the module)."""
    comm = _mpi_job(url)
    yield _store(comm, timeout), comm.rank, comm.size
    raise RuntimeError("the collectives rendezvous cannot re-rendezvous (the MPI job is fixed)")


def _with_mpi_ranks(url: str) -> str:
    """``url`` with MPI's rank and size in its query, for torch's ``env://`` handler (which then reads
    only ``MASTER_ADDR``/``MASTER_PORT`` from the environment)."""
    comm = _mpi_job(url)
    parts = urlparse(url)
    query = {**_query(url), "rank": str(comm.rank), "world_size": str(comm.size)}
    return parts._replace(query="&".join(f"{k}={v}" for k, v in query.items())).geturl()


def _rendezvous_kind(url: str) -> str:
    """Which rendezvous ``env://`` takes (the precedence in the module's docstring): ``"torch"`` (torch's
    own, unchanged), ``"mpi+tcp"`` (MPI's ranks, torch's TCPStore at MASTER_ADDR) or ``"mpi"``."""
    launch = _config.torch_launch()
    master = "MASTER_ADDR" in launch and "MASTER_PORT" in launch
    rank_known = "rank" in _query(url) or "RANK" in launch
    if master and rank_known:
        return "torch"  # torchrun's form: torch's env:// (a TCPStore), as without this module
    if master:  # MASTER_ADDR without RANK: ranks from the MPI launcher that started us, if one did
        return "mpi+tcp" if _launcher.started_by() is not None else "torch"
    return "mpi"


def _wrap_env(original):
    def env_or_mpi(url: str, **kwargs):
        kind = _rendezvous_kind(url)
        if kind == "torch":
            return original(url, **kwargs)
        if kind == "mpi+tcp":  # e.g. accelerate launch --mpirun_hostfile: MASTER_ADDR/PORT but no RANK
            return original(_with_mpi_ranks(url), **kwargs)
        return _mpi_rendezvous(url, **kwargs)

    # a marker on the function c10d's handler table holds (installing twice must not wrap twice); mypy
    # knows no attributes of a function
    env_or_mpi._collectives_wraps = original  # type: ignore[attr-defined]
    return env_or_mpi


# ---------------------------------------------------------------------------------------------------------
# the backend

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


_PMI_SERVERS: list = []  # the PMI server this process started (rank 0 of a torchrun job), kept until exit


def _join_torchrun_workers(options) -> str | None:
    """Under torchrun, before MPI starts: make its workers one MPI job by serving them PMI-1 (the protocol
    of MPICH's launcher; ``_launcher.pmi_server``), rank 0 starting the server and every worker finding it
    through torch's store. Returns None where this does not apply (not torchrun, one process, an MPI
    launcher), ``"pmi"`` once the workers' PMI variables are set, or why it cannot be done: ``"nodes"``
    (workers on several machines), ``"initialized"`` (MPI already runs in this process)."""
    rank, size = options.group_rank, options.group_size
    if size == 1 or _config.torchrun_run_id() is None or _launcher.started_by() is not None:
        return None
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        return "initialized"
    import socket
    import subprocess

    store, timeout = options.store, options.timeout.total_seconds()
    store.set(f"collectives/pmi/host/{rank}", socket.gethostname())
    if len({store.get(f"collectives/pmi/host/{r}").decode() for r in range(size)}) > 1:
        return "nodes"
    if rank == 0:
        code = ("import sys; from collectives._launcher import pmi_server; "
                "pmi_server(int(sys.argv[1]), sys.argv[2], parent=int(sys.argv[3]))")
        server = subprocess.Popen([sys.executable, "-c", code, str(size), f"torchrun-{os.getpid()}",
                                   str(os.getpid())], stdout=subprocess.PIPE, text=True)
        _PMI_SERVERS.append(server)
        port = server.stdout.readline().strip() if server.stdout else ""
        if not port.isdigit():
            raise RuntimeError(f"init_process_group('collectives') under torchrun: the PMI server did not start "
                               f"(exit status {server.poll()}); launch with mpiexec instead (docs/torchrun.md)")
        store.set("collectives/pmi/port", port)
    fd = _launcher.pmi_connect(int(store.get("collectives/pmi/port")), timeout)
    _config.set_pmi_client(fd, rank, size)  # the descriptor now belongs to MPI
    return "pmi"


def _torchrun_refusal(rank: int, size: int, why: str = "mpi") -> str:
    """The error of a torchrun worker that is not in an MPI job of torch's size (docs/torchrun.md)."""
    script = shlex.join(sys.argv) if sys.argv and sys.argv[0] else "script.py"  # the command line torchrun ran
    reason = {
        "pmi": "torchrun's workers join one MPI job through the PMI protocol of MPICH (and of the MPIs built on "
               "it), which this MPI does not speak (Open MPI speaks PMIx: it needs its own launcher)",
        "nodes": "the collectives backend joins torchrun's workers into one MPI job on one machine only, and "
                 "these run on several",
        "initialized": "MPI was already running in this process (collectives.init() or `from mpi4py import MPI` "
                       "before init_process_group), as a job of one process; under torchrun call "
                       "init_process_group first",
        "mpi": "the collectives backend joins torchrun's workers into one MPI job only through torch's own "
               "rendezvous (leave init_method unset)",
    }[why]
    return (f"init_process_group('collectives') under torchrun: torch has rank {rank} of {size}, but this process "
            f"is not in an MPI job of {size} (MPI sees 1 process): {reason}. Start the same script with MPI's "
            f"launcher instead, `mpiexec -n {size} python {script}` (no RANK, WORLD_SIZE or MASTER_ADDR needed; "
            f"on several nodes add a hostfile, or use srun). docs/torchrun.md gives the mpiexec form of each "
            f"torchrun flag")


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


def _lightning_devices_hint(exc: BaseException) -> str | None:
    """What to do when ``exc`` is Lightning's ``IndexError`` of a rank without a device: the ranks the MPI
    launcher started outnumber ``devices * num_nodes`` of the ``Trainer`` (its default ``devices`` on CPU
    is 1), so a rank with local rank >= ``devices`` finds no device in Lightning's ``root_device``. None
    for any other exception."""
    if not isinstance(exc, IndexError):
        return None
    tb, strategy = exc.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "root_device" and "lightning" in code.co_filename:
            strategy = tb.tb_frame.f_locals.get("self")
        tb = tb.tb_next
    try:
        devices = len(strategy.parallel_devices)  # type: ignore[union-attr]
        nodes, local = strategy.num_nodes, strategy.local_rank  # type: ignore[union-attr]
        ranks = strategy.cluster_environment.world_size()  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - not the frame of a strategy as we know it
        return None
    if local < devices:
        return None
    fix = f"Trainer(devices={ranks // nodes}, num_nodes={nodes})" if ranks % nodes == 0 else \
        "Trainer(devices=<ranks on each machine>, num_nodes=<machines>)"
    return (f"collectives: Lightning's Trainer has devices={devices} and num_nodes={nodes} ({devices * nodes} "
            f"process{'es' if devices * nodes > 1 else ''} in all; on CPU, devices defaults to 1), but the launcher "
            f"started {ranks} ranks, and this one, local rank {local} on its machine, has no device: that is "
            f"the IndexError above. Under mpiexec or srun every rank is one device: pass devices = the ranks on "
            f"each machine and num_nodes = the machines, so that devices * num_nodes is the number of ranks: "
            f"here {fix}\n")


def _explaining(previous):
    """``sys.excepthook`` that adds :func:`_lightning_devices_hint` after ``previous`` has printed the
    traceback, then ends the MPI job (``_failure.abort_job``: rank 0 waits in torch's rendezvous for the
    ranks that died); installed by :func:`register`; any other exception is left to ``previous`` alone."""

    def hook(kind, exc, tb):
        previous(kind, exc, tb)
        try:
            hint = _lightning_devices_hint(exc)
            if hint:
                sys.stderr.write(hint)
                sys.stderr.flush()
                from . import _failure

                if not _failure.installed():  # the other ranks wait for this one (rank 0 in torch's
                    _failure.abort_job("a rank without a Lightning device")  # rendezvous): end them too
        except Exception:  # noqa: BLE001 - an exception hook must not raise
            pass

    hook._collectives_lightning = True  # type: ignore[attr-defined]
    return hook


register()

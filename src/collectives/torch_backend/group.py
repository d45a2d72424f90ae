"""The process group of the ``"collectives"`` backend: every ``torch.distributed`` operation as a
collective of its :class:`~collectives.Communicator`, numbered as torch numbers it for the flight recorder."""

from __future__ import annotations

import functools
import math
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import _config, _trace_torch
from .._comm import engine_of
from . import uneven
from .checks import (_describing_op, _integer_mean, _one, _op, _opts_op, _same_dtype, _same_shapes, _split_rows,
                     _truncated)
from .work import Work, _Done, _ReceiveWork, _seconds

BACKEND = "collectives"
DEVICES = ("cpu", "cuda")  # the devices the backend is registered for (host tensors over MPI, CUDA over NCCL)


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

    def _start(self, opts, call, *args, **kwargs):
        """``call(*args, **kwargs, async_op=True)``: the handle of one of our collectives; or, where torch will wait
        for the operation at once (``async_op=False``: torch passes it as the options' ``asyncOp``) and the
        group's communicator bounds and checks its blocking calls (a deadline: the group's ``timeout=``),
        the blocking call made now (the hot path: no handle to drive), as a completed handle. Either way
        the call is described, fingerprinted and bounded by the same engine, and gives the same bits."""
        if self._at_once and opts is not None and opts.asyncOp is False:
            return _Done(call(*args, **kwargs))
        return call(*args, **kwargs, async_op=True)

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
        return self._reduce_scatter("reduce_scatter_tensor", opts, blocks, op, output)

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
        return self._reduce_scatter("reduce_scatter", opts, stacked, op, output)

    def _reduce_scatter(self, what: str, opts, blocks, op: str, output) -> Work:
        """Reduce ``blocks`` (one per rank, stacked; the dtype of ``output``) into ``output``: an integer AVG
        as a sum truncated toward zero (:func:`_integer_mean`)."""
        trunc, n = _integer_mean(op, output), self.size()
        if output.is_contiguous() and output.device == blocks.device:  # reduced straight into output's memory
            rows = output.view((blocks.shape[0] // n, *blocks.shape[1:]))
            h = self._start(opts, self._comm.reduce_scatter, blocks, "sum" if trunc else op, out=rows)
            return self._work(what, [h], (lambda _: _truncated(output, n)) if trunc else None, [output])
        h = self._start(opts, self._comm.reduce_scatter, blocks, "sum" if trunc else op)

        def finish(r):
            output.copy_(r[0].reshape(output.shape))
            if trunc:
                _truncated(output, n)

        return self._work(what, [h], finish, [output])

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
            return uneven.allgather(self._comm, self._work, outs, t)
        _same_shapes("allgather", t, outs, "output tensor")
        h = self._start(opts, self._comm.allgather, t)

        def finish(r):
            for o, g in zip(outs, r[0], strict=True):
                o.copy_(g)

        return self._work("allgather", [h], finish, [list(outs)])

    def all_gather_single(self, output, input, opts=None):
        if output.numel() != input.numel() * self.size():
            raise ValueError(f"all_gather_into_tensor: the output must hold size ({self.size()}) times the input's "
                             f"{input.numel()} elements, got {output.numel()}")
        _same_dtype("all_gather_into_tensor", output, input)
        if output.is_contiguous() and output.device == input.device:  # gathered straight into output's memory
            rows = output.view((self.size(), *input.shape))
            return self._work("all_gather_into_tensor", [self._start(opts, self._comm.allgather, input, out=rows)],
                              result=[output])
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
        rows = _split_rows(output, input, output_split_sizes, input_split_sizes, self.size())
        per_row = math.prod(input.shape[1:])
        sends = list(input.reshape(-1).split([r * per_row for r in rows[0]]))

        def place(pieces):
            output.copy_(torch.cat(pieces).reshape(output.shape))

        return uneven.alltoallv(self._comm, self._work, "all_to_all_single", sends, [r * per_row for r in rows[1]],
                                place, [output])

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

        return uneven.alltoallv(self._comm, self._work, "all_to_all", [t.reshape(-1) for t in inputs],
                                [o.numel() for o in outputs], place, list(outputs))

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

"""CUDA arrays: NCCL, else CUDA-aware MPI (opt-in), else staging through host memory.

``factory.device_transport`` is called by ``Communicator._transport_for`` the first time a collective meets an
array on a CUDA device, on every rank (all ranks call collectives in the same order, so they all arrive).
It is itself collective:

1. every rank gathers local facts without communicating (which array library can reach the GPU, the
   device's PCI bus id and host, whether NCCL loads and its version, the opt-in variables), catching
   every failure;
2. one gather of those facts (``_agree.gather``); any rank's failure is raised on *every* rank, so no rank is
   left waiting in a collective the others will never enter;
3. :func:`decide` picks the transport from everybody's facts (:func:`choose_transport`, a pure function)
   and, for NCCL, refuses two ranks on one GPU with a table (:func:`check_gpu_sharing`);
4. the transport is built: ``nccl.NCCLTransport``, :class:`CudaAwareMPITransport` or
   :class:`HostStagingTransport` (``.name``: ``"nccl"``, ``"cuda-aware-mpi"``, ``"host-staging"``).

Device transports are *array level*: they take the caller's torch tensor or CuPy array (they need its
library's current stream, not only a pointer) and keep the host contract: results are written into the
caller's array, also a non-contiguous view (through a contiguous temporary on the device), and
``allgather`` returns a new array on the same device. The few array operations they need are the
``_TorchCUDA`` / ``_CupyCUDA`` classes below; neither library is ever imported here: a tensor of a
library exists only if the user imported it, so we look in ``sys.modules``.
"""

from __future__ import annotations

import platform
import sys
import warnings
from collections.abc import Sequence
from types import FrameType

from .. import _agree, _config, _dtypes
from .._errors import BackendUnavailableError, MismatchError
from .device import CUDA_AWARE_MPI, HOST_STAGING, NCCL, DeviceTransport, device_api


MIN_NCCL = (2, 14, 0)  # non-blocking communicators (ncclCommInitRankConfig, ncclCommFinalize)
MULTI_RANK_NCCL = (2, 30, 0)  # first NCCL that runs several ranks on one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1)


# ---------------------------------------------------------------------------------------------------------
# pure decisions (tested on CPU in tests/unit/test_cuda_unit.py)

def choose_transport(nccl_loadable: bool, cuda_aware_opt_in: bool | None, *, mpi: bool = True) -> str:
    """The transport for CUDA arrays, given what every rank can do.

    Args:
        nccl_loadable: NCCL (>= 2.14) loads on every rank and is not disabled (``COLLECTIVES_DISABLE_NCCL``).
        cuda_aware_opt_in: ``COLLECTIVES_CUDA_AWARE_MPI`` on every rank (True), on no rank/off (False),
            or unset (None).
        mpi: the host transport is MPI (the single-process ``self`` backend has no MPI to hand pointers to).

    Example:
        >>> choose_transport(True, None), choose_transport(False, True), choose_transport(False, None)
        ('nccl', 'cuda-aware-mpi', 'host-staging')
    """
    if nccl_loadable:
        return NCCL
    if cuda_aware_opt_in and mpi:
        return CUDA_AWARE_MPI
    return HOST_STAGING


def staging_warning_due(nccl_loadable: bool, cuda_aware_opt_in: bool | None, *, mpi: bool = True) -> bool:
    """Warn (once) when arrays are staged only because nobody said whether MPI is CUDA-aware."""
    return not nccl_loadable and cuda_aware_opt_in is None and mpi


def _visible_devices() -> str:
    value = _config.as_set("CUDA_VISIBLE_DEVICES")
    return "<unset>" if value is None else value


def choose_device(local_rank: int, visible: int) -> int:
    """The CUDA device index for a rank: its node-local rank modulo the devices it sees.

    ``visible`` is the count the array library reports, which already honours ``CUDA_VISIBLE_DEVICES``
    (device 0 is the first device listed there).

    Example:
        >>> [choose_device(r, 2) for r in range(4)]
        [0, 1, 0, 1]
    """
    if visible <= 0:
        raise BackendUnavailableError(
            f"no CUDA device is visible to this process "
            f"(CUDA_VISIBLE_DEVICES={_visible_devices()!r})")
    return int(local_rank) % int(visible)


def multi_rank_allowed(env_enabled: bool | None, nccl_version) -> bool:
    """Several ranks may share a GPU under NCCL only if the user opted in and NCCL supports it."""
    return bool(env_enabled) and nccl_version is not None and tuple(nccl_version) >= MULTI_RANK_NCCL


def shared_devices(identities) -> list[list[int]]:
    """Groups (lists of ranks, two or more) whose ``(host, device id)`` is the same.

    ``identities[r]`` is rank r's ``(host, device id)``; a device id of ``None`` (unknown) is never
    considered shared.

    Example:
        >>> shared_devices([("a", "0000:01:00.0"), ("a", "0000:01:00.0"), ("b", "0000:01:00.0")])
        [[0, 1]]
    """
    groups: dict = {}
    for rank, (host, dev) in enumerate(identities):
        if dev is not None:
            groups.setdefault((host, dev), []).append(rank)
    return [ranks for ranks in groups.values() if len(ranks) > 1]


def device_table(facts: list[dict], shared: Sequence[Sequence[int]] = ()) -> str:
    """A table rank -> host -> device, the shared rows marked, and the device each rank should use."""
    marked = {r for group in shared for r in group}
    header = ("rank", "host", "device", "PCI bus id", "local rank", "should use")
    rows = [header]
    for rank, f in enumerate(facts):
        visible = f.get("visible") or 0
        hint = f"cuda:{choose_device(f['local_rank'], visible)}" if visible > 0 else "?"
        rows.append((str(rank), str(f.get("host")), f"cuda:{f.get('index')}", str(f.get("pci") or "?"),
                     str(f.get("local_rank")), hint))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        text = "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
        if i > 0 and (i - 1) in marked:
            text += "   <- shared"
        lines.append("  " + text)
    return "\n".join(lines)


def check_gpu_sharing(facts: list[dict]) -> None:
    """Refuse (BackendUnavailableError, on every rank) two ranks on one GPU under NCCL, unless allowed."""
    shared = shared_devices([(f.get("host"), f.get("pci")) for f in facts])
    if not shared:
        return
    if all(multi_rank_allowed(f.get("multi_rank"), f.get("nccl_version")) for f in facts):
        return
    groups = "; ".join("ranks " + ", ".join(map(str, g)) for g in shared)
    version = facts[0].get("nccl_version")
    have = ".".join(map(str, version)) if version else "unknown"
    need = ".".join(map(str, MULTI_RANK_NCCL))
    raise BackendUnavailableError(
        f"{groups} would share one GPU in a NCCL communicator, which NCCL refuses or hangs on:\n"
        f"{device_table(facts, shared)}\n"
        f"Give each rank its own GPU: before making CUDA arrays, select node-local rank modulo the "
        f"visible devices (torch.cuda.set_device(comm.local_rank % torch.cuda.device_count()), or "
        f"cupy.cuda.Device(comm.local_rank % cupy.cuda.runtime.getDeviceCount()).use()), or give each rank "
        f"its own CUDA_VISIBLE_DEVICES. To share a GPU on purpose set NCCL_MULTI_RANK_GPU_ENABLE=1 on every "
        f"rank (needs NCCL >= {need}; this is {have}), or COLLECTIVES_DISABLE_NCCL=1 to use MPI instead")


# ---------------------------------------------------------------------------------------------------------
# using the device

def local_device(comm) -> int:
    """The CUDA device index this rank should use: node-local rank modulo the visible devices.

    Example (on a GPU machine):
        >>> torch.cuda.set_device(local_device(coll.world()))     # doctest: +SKIP
    """
    return choose_device(comm.local_rank, device_api().device_count())


def device_transports(engine) -> dict:
    """Which transport each CUDA device of a communicator (its ``Engine``) uses so far, e.g.
    ``{"cuda:0": "nccl"}``."""
    return {f"cuda:{dev[1]}": t.name for dev, t in engine.device_transports().items()}


# ---------------------------------------------------------------------------------------------------------
# setting up: facts, decision, construction

_warned = False


def warn_staging(why: str) -> None:
    """Say once per process that CUDA arrays are staged, and how to enable or silence it."""
    global _warned
    if _warned:
        return
    _warned = True
    level = 1
    frame: FrameType | None = sys._getframe(0)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("collectives"):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"collectives: CUDA arrays are staged through host memory (every collective waits for the stream "
        f"and copies device -> host -> device) because NCCL is not available: {why}. If your MPI library "
        f"is CUDA-aware, set COLLECTIVES_CUDA_AWARE_MPI=1 to hand it device memory directly; set "
        f"COLLECTIVES_CUDA_AWARE_MPI=0 to keep staging and silence this warning.",
        RuntimeWarning, stacklevel=level)


def local_facts(engine, index: int) -> tuple[dict, BaseException | None]:
    """What this rank knows about CUDA device ``index``, gathered without communicating; never raises."""
    facts = {"error": None, "host": platform.node(), "index": int(index), "local_rank": engine.local_rank,
             "visible": 0, "pci": None, "library": None, "nccl": False, "nccl_why": "",
             "nccl_version": None, "cuda_aware": None, "multi_rank": False, "timeout": None}
    try:
        facts["timeout"] = _config.device_timeout()  # every variable is read before the exchange
        facts["cuda_aware"] = _config.cuda_aware_mpi()
        facts["multi_rank"] = _config.nccl_multi_rank_gpu()
        api = device_api()
        facts["library"] = api.name
        facts["visible"] = n = api.device_count()
        if not 0 <= index < n:
            raise BackendUnavailableError(
                f"cuda:{index} does not exist here: {n} device(s) visible "
                f"(CUDA_VISIBLE_DEVICES={_visible_devices()!r})")
        facts["pci"] = api.pci_bus_id(index)
        from . import _libnccl

        try:
            lib = _libnccl.get()
        except _libnccl.NcclNotFound as exc:
            facts["nccl_why"] = str(exc)
        else:
            facts["nccl_version"] = tuple(lib.version_tuple)
            if facts["nccl_version"] < MIN_NCCL:
                facts["nccl_why"] = (f"NCCL {'.'.join(map(str, lib.version_tuple))} ({lib.path}) is older than "
                                     f"{'.'.join(map(str, MIN_NCCL))}, which collectives needs")
            else:
                facts["nccl"] = True
    except Exception as exc:  # noqa: BLE001 - exchanged, then raised on every rank
        facts["error"] = str(exc) if isinstance(exc, BackendUnavailableError) else f"{type(exc).__name__}: {exc}"
        return facts, exc
    return facts, None


def decide(facts: list[dict], *, mpi: bool, device: str = "cuda") -> str:
    """The transport every rank will use, from every rank's facts (identical on every rank)."""
    failed = [(r, f["error"]) for r, f in enumerate(facts) if f.get("error")]
    if failed:
        raise BackendUnavailableError(
            f"array on {device}: cannot set up a CUDA transport: "
            + "; ".join(f"rank {r}: {why}" for r, why in failed))
    nccl = all(f["nccl"] for f in facts)
    opt = [f.get("cuda_aware") for f in facts]
    opt_in = True if all(opt) else (None if all(o is None for o in opt) else False)
    name = choose_transport(nccl, opt_in, mpi=mpi)
    if name == NCCL:
        check_gpu_sharing(facts)
    return name


def initialize_eagerly(engine) -> None:
    """``COLLECTIVES_NCCL_EAGER=1``: set up this rank's CUDA transport now, at ``init()`` (collective).

    Called by :func:`collectives.init` on every rank. The ranks first exchange whether each asks for it and
    whether torch or CuPy is imported (one small allgather), since setting up a device transport is
    collective and a rank doing it alone would leave the others waiting: if only some ranks set the
    variable, every rank raises :class:`MismatchError`; if every rank sets it but some have imported
    neither library (so no CUDA array can exist there yet), every rank raises
    :class:`BackendUnavailableError`. Otherwise each rank sets up the device :func:`local_device` gives
    (node-local rank modulo the visible devices), with the usual choice of NCCL, CUDA-aware MPI or host
    staging, and its failures (no visible device, say) are reported on every rank by that choice.
    """
    mine = (bool(_config.nccl_eager()), "torch" in sys.modules or "cupy" in sys.modules)
    votes = _agree.gather(None if engine.size == 1 else engine.host, mine)
    asked = [eager for eager, _ in votes]
    if not any(asked):
        return
    if not all(asked):
        _agree.refuse(MismatchError(
            "COLLECTIVES_NCCL_EAGER=1 on some ranks only: " + _agree.holding(
                ["COLLECTIVES_NCCL_EAGER=1" if a else "it off" for a in asked]) + "; set up at init() on some "
            "ranks only, the CUDA transport would hang; set it the same on every rank"))
    missing = [r for r, (_, loaded) in enumerate(votes) if not loaded]
    if missing:
        _agree.refuse(BackendUnavailableError(
            f"COLLECTIVES_NCCL_EAGER=1, but {_agree.ranks(missing)} imported neither torch nor CuPy before "
            f"init(), so there is no CUDA library to set up a device with: import one first, or unset "
            f"COLLECTIVES_NCCL_EAGER"))
    try:
        index = local_device(engine)
    except BackendUnavailableError:
        index = 0  # device_transport reports the problem on every rank
    engine.transport_for((2, index))  # 2: DLPack's kDLCUDA


# ---------------------------------------------------------------------------------------------------------
# the transports without NCCL

class HostStagingTransport(DeviceTransport):
    """Copy to host memory (waiting for the producer stream), run the host collective, copy back in place.

    Slow but always available. Every rule of the data (dtypes, ops, NaN check) is the host path's, since
    the host collective's steps run it (``Engine.staged``), as part of the device call: validated,
    recorded and (checked mode) agreed once, by the engine, before this transport is reached.
    """

    name = HOST_STAGING

    def broadcast(self, x, a, root):
        xp, _ = self._prepare(x)
        host = self._engine.staged("broadcast", xp.to_host(x), root)
        if self.rank != root:
            xp.from_host(x, host)
        return x

    def allreduce(self, x, a, op):
        _, info = self._prepare(x)
        _dtypes.check_reduction(info, op)
        return self._staged(x, op)

    def reduce(self, x, a, op, root):
        _, info = self._prepare(x)
        _dtypes.check_reduction(info, op)
        return self._staged(x, op, root)

    def allgather(self, x, a):
        xp, _ = self._prepare(x)
        return xp.to_device(self._engine.staged("allgather", xp.to_host(x)), x)

    def reduce_scatter(self, x, a, op):
        _, info = self._prepare(x)
        _dtypes.check_reduction(info, op)
        return self._staged_scatter(x, op)

    def alltoall(self, x, a):
        return self._staged_alltoall(x)


def _pieces(total: int, step: int):
    """``(offset, count)`` pieces of ``total`` elements, each at most ``step``."""
    for lo in range(0, total, step):
        yield lo, min(step, total - lo)


class CudaAwareMPITransport(DeviceTransport):
    """Hand device pointers to MPI (``COLLECTIVES_CUDA_AWARE_MPI=1``; cannot be detected reliably).

    MPI does not know CUDA streams: the producer stream is synchronised before each call, and MPI returns
    only when the device memory holds the result. The host rules (``_dtypes.wire``, with this MPI's
    verified ops) are encoded on the device: bfloat16 (and float16 where MPI cannot reduce it) widened to
    float32, float min/max as ordered integers, ``mean`` a sum divided once, then rounded back. Each MPI
    call is the MPI transport's own, made from its operation's row (``MPITransport.call``: on the
    transport's communicator for that kind, its lane, so it can never be matched with another kind of
    collective); this transport hands it device memory in MPI's terms.
    """

    name = CUDA_AWARE_MPI

    def __init__(self, engine, index):
        super().__init__(engine, index)
        host = self._host
        self._call, self._MPI, self._mpi_type = host.call, host.MPI, host.mpi_type
        self._lane = host.lane  # a kind's lane made at its first call, also where no MPI call follows (empty)
        self._max = _config.max_count()
        buffers = getattr(self._MPI, "buffer", None) or self._MPI.memory  # mpi4py 4 / 3
        self._address = buffers.fromaddress

    def _plan(self, info, op: str) -> _dtypes.Wire | None:
        """How this reduction travels (the host rules, with this MPI's verified ops), or None: an integer op
        this MPI was found to get wrong (``HostTransport.reduces``), reduced through host memory instead."""
        if info.kind in "iu" and not self._host.reduces(info.storage, _dtypes.wire_op(op)):
            return None
        return _dtypes.wire(info, op, self._host.reduces)

    def _mem(self, ptr: int, nbytes: int):
        return self._address(ptr, nbytes)

    def _datatype(self, plan: _dtypes.Wire):
        """The MPI datatype the encoded values are reduced in, and their item size."""
        dt = plan.ordered if plan.ordered is not None else plan.dtype
        return self._mpi_type(dt), dt.itemsize

    def broadcast(self, x, a, root):
        xp, _ = self._prepare(x)
        is_root = self.rank == root
        buf, in_place = xp.contiguous(x, copy=is_root)
        xp.synchronize(x)
        base = xp.ptr(buf)
        self._lane("broadcast")
        for off, n in _pieces(xp.numel(x) * xp.itemsize(x), self._max):
            self._call("broadcast", [self._mem(base + off, n), self._MPI.BYTE], root)
        if not in_place and not is_root:
            xp.copy_back(x, buf)
        return x

    def _reduce(self, x, op, root):
        xp, info = self._prepare(x)
        _dtypes.check_reduction(info, op)
        plan = self._plan(info, op)
        if plan is None:
            return self._staged(x, op, root)
        receives = root is None or self.rank == root
        buf, in_place = xp.contiguous(x)
        wire, fresh = self._encode(xp, buf, info, plan, keep=not receives)
        xp.synchronize(x)
        datatype, size = self._datatype(plan)
        base = xp.ptr(wire)
        self._lane("allreduce" if root is None else "reduce")
        for off, n in _pieces(xp.numel(x), self._max):
            mem = [self._mem(base + off * size, n * size), n, datatype]  # in place (on root, for a reduce)
            if root is None:
                self._call("allreduce", mem, plan.op)
            else:
                self._call("reduce", mem, plan.op, root)
        if not receives:
            return x
        self._decode(xp, wire, plan, buf, fresh)
        if not in_place:
            xp.copy_back(x, buf)
        return x

    def allreduce(self, x, a, op):
        return self._reduce(x, op, None)

    def reduce(self, x, a, op, root):
        return self._reduce(x, op, root)

    def allgather(self, x, a):
        xp, send, out, nbytes = self._allgather_buffers(x)
        self._lane("allgather")
        if nbytes and nbytes <= self._max:
            xp.synchronize(x)
            self._call("allgather", [self._mem(xp.ptr(send), nbytes), self._MPI.BYTE],
                       [self._mem(xp.ptr(out), nbytes * self.size), self._MPI.BYTE])
        elif nbytes:  # past the count limit: every rank broadcasts its row, piece by piece (on the allgather lane)
            xp.copy_back(out[self.rank], send)
            xp.synchronize(x)
            base = xp.ptr(out)
            for r in range(self.size):
                for off, n in _pieces(nbytes, self._max):
                    self._call("broadcast", [self._mem(base + r * nbytes + off, n), self._MPI.BYTE], r,
                               lane="allgather")
        return out

    def reduce_scatter(self, x, a, op):
        xp, info = self._prepare(x)
        _dtypes.check_reduction(info, op)
        n = xp.numel(x) // self.size  # elements of one rank's block
        plan = self._plan(info, op)
        if plan is None or n > self._max:
            return self._staged_scatter(x, op)
        shape = xp.shape(x)
        send, _ = xp.contiguous(x)
        out = xp.empty((shape[0] // self.size,) + shape[1:], like=x)
        wire, fresh = self._encode(xp, send, info, plan, keep=True)  # x stays as it was
        recv = xp.empty((n,), like=wire) if fresh else xp.flat(out)  # encoded: a temporary of the wire's dtype
        xp.synchronize(x)
        datatype, size = self._datatype(plan)
        if n:
            self._call("reduce_scatter", [self._mem(xp.ptr(wire), n * self.size * size), n, datatype],  # n per block
                       [self._mem(xp.ptr(recv), n * size), n, datatype], plan.op)
        self._decode(xp, recv, plan, out, fresh)
        return out

    def alltoall(self, x, a):
        xp, _ = self._prepare(x)
        nbytes = xp.numel(x) * xp.itemsize(x)
        if nbytes // self.size > self._max:
            return self._staged_alltoall(x)
        send, _ = xp.contiguous(x)
        out = xp.empty(xp.shape(x), like=x)
        if nbytes:
            xp.synchronize(x)
            self._call("alltoall", [self._mem(xp.ptr(send), nbytes), self._MPI.BYTE],
                       [self._mem(xp.ptr(out), nbytes), self._MPI.BYTE])
        return out

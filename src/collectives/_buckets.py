"""Fused collectives over many arrays: pack small ones into flat buffers, move big ones where they lie.

A model's tree has hundreds of leaves, most of them small (biases, norms) and a few large (weight
matrices). One collective per leaf pays the per-call cost (a rendezvous of the ranks) hundreds of times;
packing everything into one buffer pays two extra copies of every byte (pack before, unpack after). So:

- **allreduce**: a leaf of ``solo_bytes(bucket_bytes)`` bytes or more (``SOLO_BYTES``, 256 KiB, or a
  quarter of ``bucket_bytes`` when that is smaller) is reduced on its own, in its own memory when that is
  contiguous and writable (else on a temporary), through the transport's direct call (``fast_call``: for
  host buffers from the shared-memory threshold on, the reduction runs in a node-shared window, and
  ``mean`` divides only the rank's own slice, no extra pass); smaller leaves are packed, in the tree's
  canonical order, into flat buffers per (device kind, dtype), each at most ``bucket_bytes``;
- **broadcast**: where the host transport offers it (``can_broadcast_many``: MPI, every rank on one node),
  all host leaves go to its ``broadcast_many`` in one call, a pipeline that packs on the root only and
  receives straight into the leaves (see ``_backends.mpi``); otherwise the same as allreduce with
  ``BROADCAST_SOLO_BYTES`` (4 MiB) and buckets of at most ``BROADCAST_BUCKET_BYTES`` (8 MiB): one MPI
  broadcast costs several rendezvous, more than copying a few MiB, and with several buckets the root packs
  the next one while the others unpack the last;
- leaves in device memory (CUDA) are never packed on the host: they go to their device's transport, per
  device in one call where the transport fuses (``allreduce_many``: one NCCL group), else one by one.

The thresholds were chosen by measurement (``benchmarks/bench_tree.py --thresholds``, 2 ranks on 2 shared
cores): for allreduce, 128-512 KiB were best and 1-4 MiB worse; for broadcast, 2-8 MiB with 8-16 MiB
buckets were best and everything at or below 1 MiB worse.

The plan (:class:`Plan`) depends only on what every rank agreed on (order, shapes, dtypes, device kinds,
bucket_bytes, op), never on a local property such as writability, so every rank issues the same sequence
of collectives. It is returned by :func:`broadcast` and :func:`allreduce` and may be passed back for the
next call on a tree of the same structure (``_tree`` caches it by the structure's fingerprint), which then
skips planning.

For ``allreduce`` a buffer has the *wire* dtype: float32 for bfloat16 (and for float16 where MPI cannot
reduce it), widened while packing so no extra copy is made. For ``broadcast`` every dtype goes into one
byte buffer per device kind, bit for bit (offsets aligned to 64 bytes).

Buffers are reused across calls: one per wire dtype per communicator, grown to the largest bucket seen
(so at most ``bucket_bytes`` each), the least recently used dropped beyond eight.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from . import _arrays, _dtypes, _reduction, _reproducible

SOLO_BYTES = 256 << 10  # allreduce: leaves this big are reduced in their own memory (measured)
BROADCAST_SOLO_BYTES = 4 << 20  # broadcast: leaves this big are broadcast in their own memory (measured)
BROADCAST_BUCKET_BYTES = 8 << 20  # broadcast buckets are at most this big (pipelining, see broadcast())
ALIGN = 64  # byte alignment of leaves inside a broadcast buffer
MAX_POOLED = 8  # buffers kept per communicator


def solo_bytes(bucket_bytes: int, solo: int | None = None) -> int:
    """Leaves of at least this many bytes get their own collective (``solo``: default ``SOLO_BYTES``)."""
    return min(SOLO_BYTES if solo is None else solo, max(1, bucket_bytes // 4))


class Item:
    """One array leaf on its way through a fused collective.

    ``view`` is the NumPy view of its host memory in storage dtype (``_arrays``), or ``None`` for a leaf
    in device memory (moved by its device's transport); ``result`` is what the caller's tree gets back:
    the leaf itself when it was updated in place, else a new array.
    """

    __slots__ = ("adapter", "device", "info", "leaf", "result", "view")

    def __init__(self, leaf, adapter, view: np.ndarray | None, info: _dtypes.DType, device: tuple[int, int]):
        self.leaf = leaf
        self.adapter = adapter
        self.view = view
        self.info = info
        self.device = device
        self.result = leaf

    @property
    def nbytes(self) -> int:
        return self.view.nbytes  # type: ignore[union-attr]  # asked of host items only (they have a view)

    def writable_in_place(self) -> bool:
        return bool(self.view.flags.writeable) and self.adapter.writable(self.leaf, self.view)  # type: ignore[union-attr]  # host items only

    def take(self, fill) -> None:
        """Write a result into the leaf, or into a new array when the leaf cannot be written.

        ``fill(target)`` writes the result into ``target``, an array of the view's shape and dtype. A leaf
        the library can write although its view cannot be (a lazily conjugated torch tensor) is written
        through the library.
        """
        if self.writable_in_place():
            fill(self.view)
            return
        out = np.empty(self.view.shape, dtype=self.view.dtype)  # type: ignore[union-attr]  # host items only
        fill(out)
        if self.adapter.writable(self.leaf, self.view):
            self.adapter.write_back(self.leaf, self.view, out)
            return
        self.result = self.adapter.wrap(out, self.info, self.leaf)


def mark_written(items: list[Item]) -> None:
    """After a fused collective: bump autograd's version counter of every torch leaf written in place
    (``item.result is item.leaf``), in one call, as a write under ``torch.no_grad()`` would."""
    torch_adapter = _arrays.TORCH
    tensors = tuple(item.leaf for item in items if item.adapter is torch_adapter and item.result is item.leaf)
    if tensors:
        _arrays.bump_versions(tensors)


def _device_kind(device) -> int:
    return _arrays.CPU if device[0] in _arrays.HOST_DEVICE_TYPES else device[0]


class Pool:
    """Reusable flat buffers, one per dtype, least recently used first out. A communicator owns one
    (``Communicator._pool``) and drops it in ``close()``."""

    def __init__(self):
        self._buffers: OrderedDict[np.dtype, np.ndarray] = OrderedDict()

    def take(self, dtype: np.dtype, n: int) -> np.ndarray:
        buf = self._buffers.pop(dtype, None)
        if buf is None or buf.size < n:
            buf = np.empty(n, dtype=dtype)
        self._buffers[dtype] = buf
        while len(self._buffers) > MAX_POOLED:
            self._buffers.popitem(last=False)
        return buf[:n]


def assign(keys: Sequence, nbytes: Sequence[int], sizes: Sequence[int], bucket_bytes: int,
           solo_at: int | None, *, runs: bool = False) -> list[tuple[object, list[int], bool]]:
    """The one bucket assignment of the library (trees and ``DistributedOptimizer``'s gradients alike; in
    the manner of DDP's ``compute_bucket_assignment_by_size``): item ``i`` has the key ``keys[i]`` (items
    may share a bucket only with items of their key), ``nbytes[i]`` bytes as the caller holds it and
    ``sizes[i]`` bytes in a bucket's buffer. Pure: no array is touched.

    Returns ``[(key, [item indices], solo), ...]`` in the order the buckets are opened: items are taken in
    the order given; one of ``solo_at`` bytes or more (``nbytes``; None: never) gets a bucket of its own
    (``solo`` True: reduced where it lies); the others fill their key's open bucket until the next would
    take it past ``bucket_bytes`` (``sizes``), which closes it (a bucket holds at least one item). With
    ``runs``, a solo item also closes its key's open bucket, so that every bucket is a run of consecutive
    items of its key (gradients in the order backward produces them: a bucket is complete early).

    >>> assign(["f", "f", "f", "i"], [4, 40, 8, 4], [4, 40, 8, 4], bucket_bytes=12, solo_at=32)
    [('f', [0, 2], False), ('f', [1], True), ('i', [3], False)]
    >>> assign(["f", "f", "f", "i"], [4, 40, 8, 4], [4, 40, 8, 4], bucket_bytes=12, solo_at=32, runs=True)
    [('f', [0], False), ('f', [1], True), ('f', [2], False), ('i', [3], False)]
    """
    out: list[tuple[object, list[int], bool]] = []
    open_: dict = {}  # key -> [its open bucket's indices, bytes used]
    for i, (k, n) in enumerate(zip(keys, nbytes)):
        if solo_at is not None and n >= solo_at:
            out.append((k, [i], True))
            if runs:
                open_.pop(k, None)
            continue
        b = open_.get(k)
        if b is None or b[1] + sizes[i] > bucket_bytes:
            b = open_[k] = [[], 0]
            out.append((k, b[0], False))
        b[0].append(i)
        b[1] += sizes[i]
    return out


def plan(items: list[Item], bucket_bytes: int, key, size,
         threshold: int | None = None) -> tuple[list[Item], list[tuple[object, list[Item]]]]:
    """Split items into solo leaves and buckets (:func:`assign`): ``(solos, [(key, bucket items), ...])``,
    the buckets of each key together, keys in the order they first appear.

    ``key(item)`` groups items that may share a buffer; ``size(item)`` is an item's bytes in the buffer;
    items of ``threshold`` bytes or more (default ``solo_bytes(bucket_bytes)``) are solo. Zero-size leaves
    are left out (nothing to move).
    """
    if threshold is None:
        threshold = solo_bytes(bucket_bytes)
    items = [item for item in items if item.nbytes]
    keys = [key(item) for item in items]
    assigned = assign(keys, [item.nbytes for item in items], [size(item) for item in items], bucket_bytes,
                      threshold)
    rank: dict = {}  # the keys in the order of their first bucket
    for k, _, solo in assigned:
        if not solo:
            rank.setdefault(k, len(rank))
    solos = [items[b[0]] for _, b, solo in assigned if solo]
    buckets = sorted(((k, [items[i] for i in b]) for k, b, solo in assigned if not solo),
                     key=lambda kb: rank[kb[0]])  # (stable: a key's buckets stay in order)
    return solos, buckets


class Plan:
    """Which item (by position in the items list) goes where; reusable for a tree of the same structure.

    Attributes:
        devices: positions of device (CUDA) items, grouped per device in order of first appearance.
        solos: positions of host items that get a collective of their own.
        buckets: ``(key, total, [(position, offset, count), ...])`` per flat buffer; ``key`` is the device
            kind for broadcast (offsets and ``total`` in bytes) and ``(device kind, dtype name, wire
            dtype)`` for allreduce (in elements of the wire dtype).
    """

    __slots__ = ("buckets", "devices", "solos")

    def __init__(self, devices, solos, buckets):
        self.devices = devices
        self.solos = solos
        self.buckets = buckets


def _device_groups(items) -> list[list[int]]:
    groups: dict = {}
    for pos, item in enumerate(items):
        if item.view is None:
            groups.setdefault(item.device, []).append(pos)
    return list(groups.values())


# ---------------------------------------------------------------------------------------------------------
# broadcast


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def broadcast_plan(items: list[Item], bucket_bytes: int) -> Plan:
    """The plan of :func:`broadcast`: byte buckets per device kind, offsets aligned to 64 bytes."""
    host = [item for item in items if item.view is not None]
    position = {id(item): pos for pos, item in enumerate(items)}
    solos, buckets = plan(host, min(bucket_bytes, BROADCAST_BUCKET_BYTES), key=lambda it: _device_kind(it.device),
                          size=lambda it: _aligned(it.nbytes),
                          threshold=solo_bytes(bucket_bytes, BROADCAST_SOLO_BYTES))
    laid = []
    for k, bucket in buckets:
        entries, off = [], 0
        for item in bucket:
            entries.append((position[id(item)], off, item.nbytes))
            off += _aligned(item.nbytes)
        laid.append((k, off, entries))
    return Plan(_device_groups(items), [position[id(item)] for item in solos], laid)


def _device_transports(engine, items, groups):
    """The transport of every device group, made before any data moves (making one is collective, and may
    fail: then it fails on every rank while nothing has changed yet)."""
    return [engine.transport_for(items[group[0]].device) for group in groups]


def broadcast(engine, items: list[Item], root: int, bucket_bytes: int, the_plan: Plan | None = None) -> Plan:
    """Root's values into every rank's items (``item.result`` is set where a new array was needed).

    Returns the plan used; pass it back as ``the_plan`` for items of the same agreed description.
    """
    if the_plan is None:
        the_plan = broadcast_plan(items, bucket_bytes)
    if not items:
        return the_plan
    is_root = engine.rank == root
    for transport, group in zip(_device_transports(engine, items, the_plan.devices), the_plan.devices):
        for pos in group:  # device leaves, one by one on their device's transport (no host copy)
            item = items[pos]
            item.result = transport.broadcast(item.leaf, item.adapter, root)
    if not the_plan.solos and not the_plan.buckets:
        return the_plan
    host = engine.transport_for(_arrays.HOST)
    if host.can_broadcast_many:
        _broadcast_many(host, items, is_root, root, bucket_bytes)
        return the_plan
    bcast = host.fast_call("broadcast", np.dtype(np.uint8), engine.size) or host.broadcast
    for pos in the_plan.solos:
        item = items[pos]
        view = item.view
        contiguous = view.flags.c_contiguous
        if is_root:
            bcast((view if contiguous else np.ascontiguousarray(view)).reshape(-1).view(np.uint8), root)
        elif contiguous and item.writable_in_place():
            bcast(view.reshape(-1).view(np.uint8), root)
        else:
            buf = np.empty(view.shape, dtype=view.dtype)
            bcast(buf.reshape(-1).view(np.uint8), root)
            item.take(lambda target, buf=buf: np.copyto(target, buf))
    for _, total, entries in the_plan.buckets:
        buf = engine.pool.take(np.dtype(np.uint8), total)
        if is_root:
            for pos, off, nbytes in entries:
                view = items[pos].view
                buf[off:off + nbytes].view(view.dtype).reshape(view.shape)[...] = view
        bcast(buf, root)
        if not is_root:
            for pos, off, nbytes in entries:
                item = items[pos]
                view = item.view
                seg = buf[off:off + nbytes].view(view.dtype).reshape(view.shape)
                if item.writable_in_place():
                    np.copyto(view, seg)
                else:
                    item.take(lambda target, seg=seg: np.copyto(target, seg))
    return the_plan


def _broadcast_many(host, items: list[Item], is_root: bool, root: int, bucket_bytes: int) -> None:
    """Every host item through the transport's pipelined ``broadcast_many``, in the agreed order: no
    packing here (the transport packs on the root, into at most ``bucket_bytes`` of buffers, and the
    others receive straight into their leaves); a leaf that cannot be written in place receives into a
    temporary first."""
    bufs, later = [], []
    for item in items:
        view = item.view
        if view is None or view.nbytes == 0:
            continue
        contiguous = view.flags.c_contiguous
        if is_root:
            buf = view if contiguous else np.ascontiguousarray(view)
        elif contiguous and item.writable_in_place():
            buf = view
        else:
            buf = np.empty(view.shape, dtype=view.dtype)
            later.append((item, buf))
        bufs.append(buf.reshape(-1).view(np.uint8))
    host.broadcast_many(bufs, root, bucket_bytes)
    for item, buf in later:
        item.take(lambda target, buf=buf: np.copyto(target, buf))


# ---------------------------------------------------------------------------------------------------------
# allreduce


def allreduce_plan(engine, items: list[Item], op: str, bucket_bytes: int, reproducible: bool = False) -> Plan:
    """The plan of :func:`allreduce`: buckets per (device kind, dtype, wire dtype), offsets in elements.
    ``reproducible``: float and complex leaves are packed as they are (their storage dtype), to be summed
    reproducibly (``_reproducible``)."""
    host = engine.transport_for(_arrays.HOST)
    wires: dict = {}

    def wire(item):
        w = wires.get(item.info)
        if w is None:
            w = wires[item.info] = (item.info.storage if reproducible and _reproducible.applies(item.info, op)
                                    else _reduction.value_dtype(item.info, op, host.reduces))
        return w

    hosted = [item for item in items if item.view is not None]
    position = {id(item): pos for pos, item in enumerate(items)}
    solos, buckets = plan(hosted, bucket_bytes, key=lambda it: (_device_kind(it.device), it.info.name, wire(it)),
                          size=lambda it: it.view.size * wire(it).itemsize)
    laid = []
    for k, bucket in buckets:
        entries, off = [], 0
        for item in bucket:
            n = item.view.size  # type: ignore[union-attr]  # bucketed items are hosted: they have a view
            entries.append((position[id(item)], off, n))
            off += n
        laid.append((k, off, entries))
    return Plan(_device_groups(items), [position[id(item)] for item in solos], laid)


def allreduce(engine, items: list[Item], op: str, bucket_bytes: int, the_plan: Plan | None = None, *,
              reproducible: bool = False) -> Plan:
    """Reduce every item over all ranks with ``op`` (already validated against every item's dtype);
    ``reproducible``: float and complex items summed reproducibly (element by element, so the buckets do
    not change the bits).

    Returns the plan used; pass it back as ``the_plan`` for items of the same agreed description.
    """
    if the_plan is None:
        the_plan = allreduce_plan(engine, items, op, bucket_bytes, reproducible)
    host = engine.transport_for(_arrays.HOST)
    solos = len(the_plan.solos)
    together: list = []  # solo leaves whose direct calls the transport may make in one pass (allreduce_fused)

    def flush():
        if together and not (len(together) > 1 and host.allreduce_fused([b for b, _, _ in together], op)):
            for buf, info, _ in together:
                engine.runner(host, info, op)(buf)
        for _, _, finish in together:
            finish()
        together.clear()

    for k, (buf, info, finish) in enumerate(_allreduce_parts(engine, items, op, the_plan, bucket_bytes, pooled=True,
                                                             reproducible=reproducible)):
        if reproducible and _reproducible.applies(info, op):
            flush()
            engine.summing(host, buf, info, op)
        elif k < solos and _reduction.as_is(info, op, host.reduces):
            if together and together[0][1] != info:
                flush()  # (one dtype per pass)
            together.append((buf, info, finish))
            continue
        else:
            flush()
            engine.runner(host, info, op)(buf)  # the rules of _reduction
        finish()
    flush()
    return the_plan


def start_allreduce(engine, items: list[Item], op: str, bucket_bytes: int, the_plan: Plan | None = None, *,
                    reproducible: bool = False):
    """:func:`allreduce` as non-blocking transfers: ``(plan, steps)``. Every host transfer (one per solo
    leaf and bucket, in the plan's order, the same on every rank) starts here; ``steps`` is a generator
    that yields each transfer's request in turn (``_handles``) and unpacks its bucket once it is
    complete. Buckets get buffers of their own (not the pool: several may be in flight). Device leaves
    are reduced here, blocking."""
    if the_plan is None:
        the_plan = allreduce_plan(engine, items, op, bucket_bytes, reproducible)
    parts = list(_allreduce_parts(engine, items, op, the_plan, bucket_bytes, pooled=False,  # every bucket packed now
                                  reproducible=reproducible))
    host = engine.transport_for(_arrays.HOST) if parts else None
    started = []
    for buf, info, finish in parts:
        if reproducible and _reproducible.applies(info, op):
            run = engine.summing_steps(host, buf, info, op, finish)
        else:
            run = engine.reducing(host, "allreduce", buf, info, op, (), finish)
        try:
            started.append((run, next(run)))  # starts the transfer
        except StopIteration:  # ran at the call (see _comm.rules.reducing)
            pass

    def steps():
        for run, request in started:
            while True:
                yield request
                try:
                    request = run.send(None)
                except StopIteration:
                    break

    return the_plan, steps()


def _allreduce_parts(engine, items, op, the_plan, bucket_bytes: int, *, pooled: bool, reproducible: bool = False):
    """The parts of :func:`allreduce` (a generator, to be run to its end): device leaves reduced first
    (by their transports), then for the host leaves ``(buf, info, finish)``, one per solo leaf and bucket
    in the plan's order: the contiguous buffer to allreduce under ``info``'s rules (a bucket's, packed and
    widened when it is yielded), and ``finish()`` to put the result back (unpacking, rounding back).
    ``pooled``: buckets in the communicator's pool buffers, so each must be finished before the next is
    taken; else in buffers of their own. ``reproducible``: a bucket of float or complex items holds them as
    they are, reduced under ``info`` = their dtype's (even at one rank: a reproducible sum of one term is
    its value, but NaN as the canonical NaN, as at any number of ranks); its device leaves in buckets of up
    to ``bucket_bytes`` (:func:`_allreduce_device`)."""
    if not items:
        return
    for transport, group in zip(_device_transports(engine, items, the_plan.devices), the_plan.devices):
        _allreduce_device(transport, [items[pos] for pos in group], op, bucket_bytes, reproducible)
    if engine.size == 1 and not reproducible:  # the reduction of one rank is the identity: only immutable leaves need new arrays
        for item in items:
            if item.view is not None and not item.writable_in_place():
                item.take(lambda target, view=item.view: np.copyto(target, view))
        return
    for pos in the_plan.solos:
        item = items[pos]
        view = item.view
        if view.flags.c_contiguous and item.writable_in_place():
            yield view, item.info, _nothing  # in the leaf's own memory: no copy
        else:
            buf = np.array(view, order="C")
            yield buf, item.info, lambda item=item, buf=buf: item.take(lambda target: np.copyto(target, buf))
    for (_, name, wire), total, entries in the_plan.buckets:
        buf = engine.pool.take(wire, total) if pooled else np.empty(total, dtype=wire)
        info = items[entries[0][0]].info
        as_they_are = reproducible and _reproducible.applies(info, op)  # (the bucket's items share their dtype)
        bf16 = name == "bfloat16" and not as_they_are
        for pos, off, n in entries:  # pack (widening on the way)
            view = items[pos].view
            if bf16:
                _dtypes.bf16_to_f32(view, out=buf[off:off + n].reshape(view.shape))
            else:
                buf[off:off + n].reshape(view.shape)[...] = view
        yield buf, info if as_they_are else _dtypes.from_numpy(wire), lambda buf=buf, entries=entries, bf16=bf16: _unpack(
            items, buf, entries, bf16)


def _nothing() -> None:
    return None


def _unpack(items, buf, entries, bf16: bool) -> None:
    """A reduced bucket back into its leaves (rounding back on the way)."""
    for pos, off, n in entries:
        item = items[pos]
        view = item.view
        seg = buf[off:off + n].reshape(view.shape)
        if bf16:
            item.take(lambda target, seg=seg: _dtypes.f32_to_bf16(seg, out=target))
        elif item.writable_in_place():
            np.copyto(view, seg, casting="unsafe")
        else:
            item.take(lambda target, seg=seg: np.copyto(target, seg, casting="unsafe"))


def _allreduce_device(transport, group: list[Item], op: str, bucket_bytes: int, reproducible: bool = False) -> None:
    """Reduce the device items of one device: in one fused call where the transport has one (NCCL: one
    group), else one by one. Device transports write into the caller's arrays. ``reproducible``: float
    and complex items by the transport's reproducible sum (through host memory, element by element: the
    bits of a host leaf's), in buckets of one dtype and up to ``bucket_bytes`` (:func:`assign`, as the host
    leaves': one host collective a bucket, ``DeviceTransport.reproducible_packed``; a leaf of
    ``solo_bytes(bucket_bytes)`` or more alone); the others as without it."""
    if reproducible:
        summed: list[Item] = []
        others: list[Item] = []
        for item in group:
            (summed if _reproducible.applies(item.info, op) else others).append(item)
        group = others
        sizes = [transport.nbytes(item.leaf) for item in summed]
        for _, members, _ in assign([item.info.name for item in summed], sizes, sizes, bucket_bytes,
                                    solo_bytes(bucket_bytes)):
            if len(members) == 1:
                item = summed[members[0]]
                item.result = transport.reproducible(item.leaf, item.adapter, "allreduce", op)
            else:
                transport.reproducible_packed([summed[i].leaf for i in members], summed[members[0]].adapter, op)
    if transport.fuses and len(group) > 1:
        transport.allreduce_many([item.leaf for item in group], group[0].adapter, op)
        return
    for item in group:
        item.result = transport.allreduce(item.leaf, item.adapter, op)


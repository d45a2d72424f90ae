"""Fused collectives over many arrays: pack small ones into flat buffers, move big ones where they lie.

A model's tree has hundreds of leaves, most of them small (biases, norms) and a few large (weight
matrices). One collective per leaf pays the latency hundreds of times; copying everything into one buffer
pays two copies of every byte. So:

- a leaf of ``solo_bytes(bucket_bytes)`` or more (1 MiB, or a quarter of the bucket bound when that is
  smaller) gets a collective of its own, run directly on its memory when that is contiguous and writable
  (no copy at all), else on a temporary copy;
- smaller leaves are packed, in the tree's canonical order, into flat buffers per (device kind, dtype),
  each at most ``bucket_bytes``; one collective per buffer; then unpacked into the leaves.

The plan depends only on what every rank agreed on (order, shapes, dtypes, device kinds, bucket_bytes),
never on a local property such as writability, so every rank issues the same sequence of collectives.

For ``allreduce`` a buffer has the *wire* dtype: float32 for bfloat16 (and for float16 where MPI cannot
reduce it), widened while packing so no extra copy is made. For ``broadcast`` every dtype goes into one
byte buffer per device kind, bit for bit (offsets aligned to 64 bytes).

Buffers are reused across calls: one per wire dtype per communicator, grown to the largest bucket seen
(so at most ``bucket_bytes`` each), the least recently used dropped beyond eight.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np

from . import _arrays, _dtypes

SOLO_BYTES = 1 << 20  # leaves this big are never copied into a bucket
ALIGN = 64  # byte alignment of leaves inside a broadcast buffer
MAX_POOLED = 8  # buffers kept per communicator


def solo_bytes(bucket_bytes: int) -> int:
    """Leaves of at least this many bytes get their own collective."""
    return min(SOLO_BYTES, max(1, bucket_bytes // 4))


class Item:
    """One array leaf on its way through a fused collective.

    ``view`` is the NumPy view of its host memory in storage dtype (``_arrays``), or ``None`` for a leaf
    in device memory (moved on its own by the Communicator's per-array collective); ``result`` is what the
    caller's tree gets back: the leaf itself when it was updated in place, else a new array.
    """

    __slots__ = ("leaf", "adapter", "view", "info", "device", "result")

    def __init__(self, leaf, adapter, view: np.ndarray, info: _dtypes.DType, device: tuple[int, int]):
        self.leaf = leaf
        self.adapter = adapter
        self.view = view
        self.info = info
        self.device = device
        self.result = leaf

    @property
    def nbytes(self) -> int:
        return self.view.nbytes

    def writable_in_place(self) -> bool:
        return bool(self.view.flags.writeable) and self.adapter.writable(self.leaf, self.view)

    def take(self, fill) -> None:
        """Write a result into the leaf, or into a new array when the leaf cannot be written.

        ``fill(target)`` writes the result into ``target``, an array of the view's shape and dtype.
        """
        if self.writable_in_place():
            fill(self.view)
            return
        out = np.empty(self.view.shape, dtype=self.view.dtype)
        fill(out)
        self.result = self.adapter.wrap(out, self.info, self.leaf)


def _device_kind(device) -> int:
    return _arrays.CPU if device[0] in _arrays.HOST_DEVICE_TYPES else device[0]


class _Pool:
    """Reusable flat buffers, one per dtype, least recently used first out."""

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


_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pool(comm) -> _Pool:
    """The buffer pool of a communicator (dropped with it)."""
    p = _pools.get(comm)
    if p is None:
        p = _pools[comm] = _Pool()
    return p


def plan(items: list[Item], bucket_bytes: int, key, size) -> tuple[list[Item], list[tuple[object, list[Item]]]]:
    """Split items into solo leaves and buckets: ``(solos, [(key, bucket items), ...])``.

    ``key(item)`` groups items that may share a buffer; ``size(item)`` is an item's bytes in the buffer.
    Zero-size leaves are left out (nothing to move).
    """
    threshold = solo_bytes(bucket_bytes)
    solos: list[Item] = []
    groups: dict[object, list[Item]] = {}
    for item in items:
        nbytes = item.nbytes
        if nbytes == 0:
            continue
        if nbytes >= threshold:
            solos.append(item)
        else:
            groups.setdefault(key(item), []).append(item)
    buckets = []
    for k, group in groups.items():
        current: list[Item] = []
        used = 0
        for item in group:
            n = size(item)
            if current and used + n > bucket_bytes:
                buckets.append((k, current))
                current, used = [], 0
            current.append(item)
            used += n
        if current:
            buckets.append((k, current))
    return solos, buckets


# ---------------------------------------------------------------------------------------------------------
# broadcast


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def broadcast(comm, items: list[Item], root: int, bucket_bytes: int) -> None:
    """Root's values into every rank's items (``item.result`` is set where a new array was needed)."""
    if not items:
        return
    is_root = comm.rank == root
    for item in items:  # device leaves, one by one through the Communicator (its device transport)
        if item.view is None:
            item.result = comm.broadcast(item.leaf, root)
    items = [item for item in items if item.view is not None]
    solos, buckets = plan(items, bucket_bytes, key=lambda it: _device_kind(it.device),
                          size=lambda it: _aligned(it.nbytes))
    for item in solos:
        transport = comm._transport_for(item.device)
        view = item.view
        if is_root:
            transport.broadcast(view if view.flags.c_contiguous else np.ascontiguousarray(view), root)
        elif item.writable_in_place() and view.flags.c_contiguous:
            transport.broadcast(view, root)
        else:
            buf = np.empty(view.shape, dtype=view.dtype)
            transport.broadcast(buf, root)
            item.take(lambda target, buf=buf: np.copyto(target, buf))
    buffers = pool(comm)
    for _, bucket in buckets:
        transport = comm._transport_for(bucket[0].device)
        offsets = []
        total = 0
        for item in bucket:
            offsets.append(total)
            total += _aligned(item.nbytes)
        buf = buffers.take(np.dtype(np.uint8), total)
        if is_root:
            for item, off in zip(bucket, offsets):
                view = item.view
                buf[off:off + view.nbytes].view(view.dtype).reshape(view.shape)[...] = view
        transport.broadcast(buf, root)
        if not is_root:
            for item, off in zip(bucket, offsets):
                view = item.view
                seg = buf[off:off + view.nbytes].view(view.dtype).reshape(view.shape)
                item.take(lambda target, seg=seg: np.copyto(target, seg))


# ---------------------------------------------------------------------------------------------------------
# allreduce


def wire_dtype(transport, info: _dtypes.DType, op: str) -> np.dtype:
    """The dtype a leaf travels in: float32 for bfloat16 and for float16 the transport cannot reduce."""
    wire_op = "sum" if op == "mean" else op
    if info.name == "bfloat16":
        return np.dtype(np.float32)
    if info.storage == np.float16 and not transport.reduces(info.storage, wire_op):
        return np.dtype(np.float32)
    return info.storage


def allreduce(comm, items: list[Item], op: str, bucket_bytes: int) -> None:
    """Reduce every item over all ranks with ``op`` (already validated against every item's dtype)."""
    if not items:
        return
    for item in items:  # device leaves, one by one through the Communicator (its device transport)
        if item.view is None:
            item.result = comm.allreduce(item.leaf, op)
    items = [item for item in items if item.view is not None]
    if comm.size == 1:  # the reduction of one rank is the identity: only immutable leaves need new arrays
        for item in items:
            if not item.writable_in_place():
                item.take(lambda target, view=item.view: np.copyto(target, view))
        return

    def key(item):
        transport = comm._transport_for(item.device)
        return _device_kind(item.device), item.info.name, wire_dtype(transport, item.info, op)

    solos, buckets = plan(items, bucket_bytes, key=key,
                          size=lambda it: it.view.size * wire_dtype(comm._transport_for(it.device), it.info,
                                                                    op).itemsize)
    for item in solos:
        transport = comm._transport_for(item.device)
        item.result = comm._in_place(
            item.leaf, item.adapter, item.view, item.info,
            lambda buf, t=transport, info=item.info: comm._reduce_buffer(t, buf, info, op, t.allreduce))
    buffers = pool(comm)
    for (_, name, wire), bucket in buckets:
        transport = comm._transport_for(bucket[0].device)
        total = sum(item.view.size for item in bucket)
        buf = buffers.take(wire, total)
        bf16 = name == "bfloat16"
        off = 0
        for item in bucket:  # pack (widening on the way)
            n = item.view.size
            if bf16:
                bits = buf[off:off + n].view(np.uint32)
                bits.reshape(item.view.shape)[...] = item.view
                bits <<= 16
            else:
                buf[off:off + n].reshape(item.view.shape)[...] = item.view
            off += n
        comm._reduce_buffer(transport, buf, _dtypes.from_numpy(wire), op, transport.allreduce)
        off = 0
        for item in bucket:  # unpack (rounding back on the way)
            n = item.view.size
            seg = buf[off:off + n].reshape(item.view.shape)
            if bf16:
                item.take(lambda target, seg=seg: _dtypes.f32_to_bf16(seg, out=target))
            else:
                item.take(lambda target, seg=seg: np.copyto(target, seg, casting="unsafe"))
            off += n

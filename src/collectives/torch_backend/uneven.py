"""The operations of any sizes: ``all_gather`` of tensors of different sizes per rank, and ``all_to_all``
/ ``all_to_all_single`` with any split sizes (torch's NCCL backend takes them; gloo refuses them). The sizes
are agreed first, in one small allgather, so that ranks that disagree get a ``MismatchError`` on every rank
before the data moves; then every block, padded to the largest, travels in one collective of equal blocks.

Each function takes the group's communicator ``comm`` and ``work``, its maker of a :class:`Work` bounded by
the group's timeout (``work(what, handles, finish=None, result=None)``).
"""

from __future__ import annotations

import numpy as np
import torch

from .._errors import MismatchError
from .checks import _same_dtype
from .work import Work


def allgather(comm, work, outs, t) -> Work:
    """all_gather of tensors of different sizes: every rank's input padded to the largest, one allgather,
    each block cut to its size. The sizes are agreed first (one small allgather): each rank gives its
    input's size and the sizes its tensor_list expects, and any difference is a MismatchError on every
    rank before the data moves."""
    me = comm.rank
    if outs[me].numel() != t.numel():
        raise ValueError(f"all_gather: tensor_list[{me}] (this rank's) must have the input's shape "
                         f"{tuple(t.shape)}, got {tuple(outs[me].shape)}")
    for o in outs:
        _same_dtype("all_gather", o, t)
    counts = agreed_counts(comm, work, "all_gather", [t.numel()] + [o.numel() for o in outs])
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
    h = comm.allgather(buf, async_op=True)

    def finish(r):
        for o, g in zip(outs, r[0], strict=True):
            o.copy_(g[:o.numel()].reshape(o.shape))

    return work("all_gather", [h], finish, [list(outs)])

def agreed_counts(comm, work, what: str, row: list[int]) -> np.ndarray:
    """Every rank's ``row`` of integers (one allgather, waited for within the group's timeout), as an
    ``(size, len(row))`` array, the same on every rank."""
    got: list = []
    h = comm.allgather(torch.tensor(row, dtype=torch.int64), async_op=True)
    work(f"{what} (the sizes)", [h], lambda r: got.append(r[0].numpy())).wait()
    return got[0]

def alltoallv(comm, work, what: str, sends: list, received: list[int], place, result) -> Work:
    """Rank j gets ``sends[j]`` (flat), rank i's block arrives as ``received[i]`` elements; ``place(pieces)``
    puts the blocks (flat, in rank order) into the outputs. The counts are agreed first (one small
    allgather: what each rank sends and expects; a difference is a MismatchError on every rank before
    the data moves), then every block padded to the largest travels in one alltoall."""
    n = comm.size
    counts = agreed_counts(comm, work, what, [s.numel() for s in sends] + list(received))
    sent, expected = counts[:, :n], counts[:, n:]
    bad = np.argwhere(sent != expected.T)
    if len(bad):
        i, j = bad[0]
        raise MismatchError(f"{what}: rank {i} sends {sent[i, j]} elements to rank {j}, which expects "
                            f"{expected[j, i]} from it: the ranks' split sizes disagree; nothing was exchanged")
    block = int(sent.max()) if sent.size else 0
    if block == 0:  # nothing to send anywhere (every rank knows it alike)
        place([s[:0] for s in sends])
        return work(what, [], result=result)
    if (sent == block).all():
        buf = torch.cat(sends).reshape(n, block)
    else:
        buf = sends[0].new_zeros((n, block))
        for j, s in enumerate(sends):
            buf[j, :s.numel()] = s
    h = comm.alltoall(buf, async_op=True)
    return work(what, [h], lambda r: place([b[:c] for b, c in zip(r[0], received, strict=True)]),
                      result)

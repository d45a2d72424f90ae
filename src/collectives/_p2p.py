"""Point-to-point messages (``send``/``recv``): the header that travels before the data, and the check a
receive makes against its buffer. One rule for every transport: MPI's (``_backends.mpi``), the single
process's (``_backends.self``) and NCCL's, whose description travels by the host path
(``_backends.nccl``). NumPy only."""

from __future__ import annotations

import numpy as np

HEADER_WORDS = 6  # int64: bytes, elements, sequence number (the data's tag), piece size, dtype name (16 bytes)
_NAME_BYTES = 16


def p2p_header(count: int, nbytes: int, name: str, seq: int, piece: int) -> np.ndarray:
    """The header of a message of ``count`` elements (``nbytes`` bytes) of the dtype called ``name``;
    ``seq``: the tag its data travels under; ``piece``: the largest message the data is cut into.

    Example:
        >>> from collectives._p2p import p2p_header, p2p_fields
        >>> p2p_fields(p2p_header(3, 24, "float64", 7, 2**31 - 1))
        (24, 3, 7, 2147483647, 'float64')
    """
    h = np.zeros(HEADER_WORDS, dtype=np.int64)
    h[:4] = (nbytes, count, seq, piece)
    h[4:].view(np.uint8)[:] = np.frombuffer(name.encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0"), np.uint8)
    return h


def p2p_fields(header: np.ndarray) -> tuple[int, int, int, int, str]:
    """``(nbytes, count, seq, piece, dtype name)`` of a header made by :func:`p2p_header`."""
    name = header[4:].tobytes().rstrip(b"\0").decode(errors="replace")
    return int(header[0]), int(header[1]), int(header[2]), int(header[3]), name


def p2p_mismatch(header: np.ndarray, count: int, nbytes: int, name: str, source: int, tag: int,
                 rank: int) -> Exception | None:
    """The error a receive raises when the message described by ``header`` (from ``source``) does not fit
    its buffer of ``count`` elements of ``name`` (``nbytes`` bytes), or None when it fits: a TypeError for
    another dtype, a ValueError for another number of elements."""
    s_bytes, s_count, _, _, s_name = p2p_fields(header)
    if s_name == name and s_count == count and s_bytes == nbytes:
        return None
    kind = TypeError if s_name != name else ValueError
    return kind(f"recv on rank {rank}: rank {source} sent {s_count} x {s_name} (tag {tag}), but the receive "
                f"buffer holds {count} x {name}: pass a buffer of the sender's dtype and number of elements. The "
                f"message was received and dropped (the buffer is unchanged); the communicator stays usable")

"""The contract every transport fulfils.

A transport moves *contiguous NumPy buffers* (host memory) or device pointers (GPU transports); it knows
nothing about array libraries, dtype legality or the ``mean`` op: the Communicator has already validated
the call, converted the data to a dtype the transport reduces natively (:meth:`Transport.reduces`), and
will divide for ``mean``. ``op`` is one of ``"sum" "prod" "min" "max"``.
"""

from __future__ import annotations

import abc

import numpy as np


class Transport(abc.ABC):
    name: str = "abstract"
    array_level = False  # host transports take NumPy buffers; device transports take arrays
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    def reduces(self, dtype: np.dtype, op: str) -> bool:
        """True if this transport reduces ``dtype`` with ``op`` natively (else the caller widens it)."""
        return dtype != np.float16 or self._float16

    _float16 = True

    @abc.abstractmethod
    def allreduce(self, buf: np.ndarray, op: str) -> None:
        """Reduce ``buf`` across ranks, result in ``buf`` on every rank."""

    @abc.abstractmethod
    def reduce(self, buf: np.ndarray, op: str, root: int) -> None:
        """Reduce ``buf`` across ranks, result in ``buf`` on ``root``; other ranks' ``buf`` unchanged."""

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Copy root's ``buf`` into every rank's ``buf``."""

    @abc.abstractmethod
    def allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        """``recv[r]`` becomes rank r's ``send``; ``recv`` has shape ``(size, send.size)``."""

    @abc.abstractmethod
    def allgather_object(self, obj) -> list:
        """Every rank's picklable ``obj``, in rank order (used for agreement checks, not for data)."""

    @abc.abstractmethod
    def broadcast_object(self, obj, root: int):
        """Root's picklable ``obj`` on every rank."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has entered."""

    def close(self) -> None:  # noqa: B027 - optional: a transport that holds nothing keeps this no-op
        """Release what the transport holds; idempotent."""

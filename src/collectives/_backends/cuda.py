"""CUDA arrays: choose NCCL, else CUDA-aware MPI (opt-in), else staging through host memory."""

from __future__ import annotations

from .._errors import BackendUnavailableError


def make_transport(comm, device):
    """The device transport for CUDA ``device`` on ``comm`` (called once per device by the Communicator)."""
    raise BackendUnavailableError(
        f"array on cuda:{device[1]}: the CUDA transports are not available in this build; copy the array "
        f"to host memory first"
    )

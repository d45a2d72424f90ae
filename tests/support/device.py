"""A device array and library that host staging can run on without a GPU, and a communicator whose CUDA
arrays go to it: the whole device call (validation, checked mode's agreement, the record, the engine's
staged host steps) through the Communicator, as on a GPU machine with COLLECTIVES_DISABLE_NCCL=1."""

from __future__ import annotations

import contextlib

import numpy as np

from collectives import _dtypes
from collectives._backends import cuda
from collectives._comm import engine_of  # the device transports' interface to a Communicator


class OnDevice:
    """An array on cuda:0 as far as collectives can tell (DLPack device ``(2, 0)``); its values are a NumPy
    array, which :class:`DeviceLibrary` copies to and from "host memory"."""

    def __init__(self, values, copy: bool = True):
        self.values = np.array(values) if copy else values  # copy=False: a view of another's values
        self.shape, self.dtype = self.values.shape, self.values.dtype

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kw):
        raise AssertionError("a device array's memory is moved by its transport, never read as host memory")

    def __setitem__(self, key, value):  # as CuPy's ``out[...] = result``, device to device
        self.values[key] = value.values


class DeviceLibrary:
    """The operations host staging takes of a device library (``device._TorchCUDA``'s), on :class:`OnDevice`:
    copies, and streams and events that are always done."""

    name = "stand-in"

    def dtype(self, x):
        return _dtypes.from_numpy(x.values.dtype)

    def numel(self, x):
        return x.values.size

    def itemsize(self, x):
        return x.values.itemsize

    def shape(self, x):
        return x.values.shape

    def contiguous(self, x, copy=True):
        return x, True  # (its values are a C-contiguous NumPy array)

    def flat(self, buf):
        return OnDevice(buf.values.reshape(-1), copy=False)

    def empty(self, shape, like):
        return OnDevice(np.empty(shape, like.values.dtype), copy=False)

    def part(self, buf, offset, count, shape):
        return OnDevice(buf.values[offset:offset + count].reshape(shape), copy=False)

    def copy_back(self, x, buf):
        x.values[...] = buf.values

    def to_host(self, x):
        return x.values.copy()

    def from_host(self, x, host):
        x.values[...] = host

    def to_device(self, host, like):
        return OnDevice(host)

    def new_stream(self, x):
        return "side"

    def current_stream(self, x):
        return "current"

    def on_stream(self, x, stream):
        return contextlib.nullcontext()

    def event_on(self, stream):
        return stream

    def wait_event(self, stream, event):
        pass

    def event_done(self, event):
        return True

    def keep_for(self, x, stream):
        pass


def staging(comm, monkeypatch, transport=cuda.HostStagingTransport):
    """Route ``comm``'s arrays on cuda:0 (:class:`OnDevice`) to a host-staging transport over
    :class:`DeviceLibrary` (replacing the communicator's transport choice, as tests may); returns it.
    ``transport``: another device transport class made from the engine alone (``cuda.CudaAwareMPITransport``,
    for what it stages through the host path as host staging does: its reproducible sums)."""
    host = comm._transport_for
    t = transport(engine_of(comm), 0)
    t._library_of = lambda x: DeviceLibrary()
    monkeypatch.setattr(comm, "_transport_for", lambda device: t if device[0] == 2 else host(device))
    return t

"""The CUDA transports without a GPU.

- the pure decisions: device per rank, two ranks on one GPU (and its table), the transport chooser;
- the one-time staging warning, ``COLLECTIVES_DISABLE_NCCL`` and ``COLLECTIVES_CUDA_AWARE_MPI``;
- a CUDA array on this CPU machine gets a clear BackendUnavailableError;
- the transports' own logic, with torch CPU tensors standing in for CUDA tensors (``FakeTorch``): NCCL
  against a fake libnccl that computes what N identical ranks would (pointers, counts, dtypes, in-place
  and non-contiguous write-back, polling, timeout, abort, close); host staging and CUDA-aware MPI for
  real, under ``mpiexec -n 2`` and ``-n 3`` (MPI accepts host pointers the same way).
"""

from __future__ import annotations

import contextlib
import ctypes
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

import collectives as coll
from collectives._comm import engine_of  # the device transports' interface to a Communicator
from collectives import _config, _dtypes
from collectives._backends import _libnccl, cuda, device, factory
from collectives._backends.self import SelfTransport
from collectives._launcher import find_mpiexec, job_command, job_environment  # any launcher

try:
    import torch
except ImportError:  # the pure decisions are still tested; the transports need torch CPU tensors
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch (CPU) stands in for CUDA tensors here")

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "cupy", "jax", "mpi4py", "mpi4py.MPI")


def run_python(code: str, env_extra=None, timeout=120):
    env = job_environment(**(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=timeout)


# ---------------------------------------------------------------------------------------------------------
# pure decisions

def test_choose_device_is_local_rank_modulo_visible():
    assert [cuda.choose_device(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert cuda.choose_device(3, 1) == 0
    with pytest.raises(coll.BackendUnavailableError, match="CUDA_VISIBLE_DEVICES"):
        cuda.choose_device(0, 0)


def test_shared_devices_groups_same_host_and_bus_id_only():
    ids = [("a", "0000:01:00.0"), ("a", "0000:02:00.0"), ("a", "0000:01:00.0"), ("b", "0000:01:00.0"),
           ("b", None), ("b", None)]
    assert cuda.shared_devices(ids) == [[0, 2]]
    assert cuda.shared_devices([("a", "x"), ("a", "y")]) == []


def facts(host, index, pci, local_rank, visible=2, multi=False, version=(2, 32, 3), nccl=True, aware=None):
    return {"error": None, "host": host, "index": index, "pci": pci, "local_rank": local_rank,
            "visible": visible, "library": "torch", "nccl": nccl, "nccl_why": "" if nccl else "no libnccl",
            "nccl_version": version, "cuda_aware": aware, "multi_rank": multi}


def test_two_ranks_on_one_gpu_are_refused_with_a_table():
    everyone = [facts("node1", 0, "0000:3b:00.0", 0), facts("node1", 0, "0000:3b:00.0", 1),
                facts("node2", 0, "0000:3b:00.0", 0)]
    with pytest.raises(coll.BackendUnavailableError) as info:
        cuda.check_gpu_sharing(everyone)
    text = str(info.value)
    assert text.startswith("ranks 0, 1 would share one GPU")
    table = text.splitlines()[1:5]
    assert table[0].split() == ["rank", "host", "device", "PCI", "bus", "id", "local", "rank", "should", "use"]
    assert table[1].split() == ["0", "node1", "cuda:0", "0000:3b:00.0", "0", "cuda:0", "<-", "shared"]
    assert table[2].split() == ["1", "node1", "cuda:0", "0000:3b:00.0", "1", "cuda:1", "<-", "shared"]
    assert table[3].split() == ["2", "node2", "cuda:0", "0000:3b:00.0", "0", "cuda:0"]
    for hint in ("torch.cuda.set_device(comm.local_rank % torch.cuda.device_count())",
                 "NCCL_MULTI_RANK_GPU_ENABLE=1", "NCCL >= 2.30.0; this is 2.32.3", "COLLECTIVES_DISABLE_NCCL=1"):
        assert hint in text


def test_gpu_sharing_allowed_only_with_opt_in_on_every_rank_and_new_nccl():
    def pair(multi0, multi1, version):
        return [facts("h", 0, "p", 0, multi=multi0, version=version),
                facts("h", 0, "p", 1, multi=multi1, version=version)]

    cuda.check_gpu_sharing(pair(True, True, (2, 30, 0)))  # allowed: no exception
    for multi0, multi1, version in [(True, False, (2, 32, 3)), (False, False, (2, 32, 3)),
                                    (True, True, (2, 29, 7))]:
        with pytest.raises(coll.BackendUnavailableError, match="share one GPU"):
            cuda.check_gpu_sharing(pair(multi0, multi1, version))
    assert cuda.multi_rank_allowed(True, (2, 31, 0)) and not cuda.multi_rank_allowed(True, None)
    cuda.check_gpu_sharing([facts("h", 0, "p", 0), facts("h", 1, "q", 1)])  # distinct GPUs: fine


@pytest.mark.parametrize("nccl, opt_in, mpi, want", [
    (True, None, True, "nccl"), (True, True, True, "nccl"), (True, False, True, "nccl"),
    (True, None, False, "nccl"),
    (False, True, True, "cuda-aware-mpi"), (False, None, True, "host-staging"),
    (False, False, True, "host-staging"), (False, True, False, "host-staging"),
])
def test_transport_chooser(nccl, opt_in, mpi, want):
    assert cuda.choose_transport(nccl, opt_in, mpi=mpi) == want
    assert cuda.staging_warning_due(nccl, opt_in, mpi=mpi) == (want == "host-staging" and opt_in is None and mpi)


def test_decide_uses_every_ranks_facts():
    assert cuda.decide([facts("a", 0, "p", 0), facts("b", 0, "p", 0)], mpi=True) == "nccl"
    # NCCL missing on one rank: nobody uses it; opt-in must hold on every rank
    assert cuda.decide([facts("a", 0, "p", 0), facts("b", 0, "p", 0, nccl=False)], mpi=True) == "host-staging"
    both = [facts("a", 0, "p", 0, nccl=False, aware=True), facts("b", 0, "p", 0, nccl=False, aware=True)]
    assert cuda.decide(both, mpi=True) == "cuda-aware-mpi"
    both[1]["cuda_aware"] = None
    assert cuda.decide(both, mpi=True) == "host-staging"
    # two ranks on one GPU without NCCL: allowed (staging does not care)
    assert cuda.decide([facts("a", 0, "p", 0, nccl=False), facts("a", 0, "p", 1, nccl=False)],
                       mpi=True) == "host-staging"
    broken = facts("b", 0, "p", 0)
    broken["error"] = "no usable CUDA array library"
    with pytest.raises(coll.BackendUnavailableError, match="cuda:3: cannot set up a CUDA transport: rank 1: no usable"):
        cuda.decide([facts("a", 0, "p", 0), broken], mpi=True, device="cuda:3")


def test_config_accessors(monkeypatch):
    monkeypatch.delenv("COLLECTIVES_CUDA_AWARE_MPI", raising=False)
    assert _config.cuda_aware_mpi() is None
    monkeypatch.setenv("COLLECTIVES_CUDA_AWARE_MPI", "1")
    assert _config.cuda_aware_mpi() is True
    monkeypatch.setenv("COLLECTIVES_CUDA_AWARE_MPI", "0")
    assert _config.cuda_aware_mpi() is False
    monkeypatch.setenv("COLLECTIVES_CUDA_AWARE_MPI", "maybe")
    with pytest.raises(ValueError, match="COLLECTIVES_CUDA_AWARE_MPI"):
        _config.cuda_aware_mpi()
    for raw, want in [("1", True), ("2", True), ("0", False), ("", False), ("yes", False)]:  # as NCCL reads it
        monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", raw)
        assert _config.nccl_multi_rank_gpu() is want
    monkeypatch.delenv("COLLECTIVES_TIMEOUT", raising=False)
    assert _config.device_timeout() == 300.0
    monkeypatch.setenv("COLLECTIVES_TIMEOUT", "2.5")
    assert _config.device_timeout() == 2.5


# ---------------------------------------------------------------------------------------------------------
# set-up with a stand-in GPU: facts, the disable switch, the warning

class FakeDeviceAPI:
    name = "fake"

    def unusable(self):
        return None

    def device_count(self):
        return 2

    def pci_bus_id(self, index):
        return f"0000:0{index + 1}:00.0"

    def using(self, index):
        return contextlib.nullcontext()


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(cuda, "device_api", FakeDeviceAPI)
    monkeypatch.setattr(cuda, "_warned", False)
    for name in ("COLLECTIVES_DISABLE_NCCL", "COLLECTIVES_CUDA_AWARE_MPI", "NCCL_MULTI_RANK_GPU_ENABLE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def mpi_comm():
    comm = coll.init()
    if comm.backend != "mpi":
        pytest.skip("needs mpi4py")
    return comm


def test_local_facts(fake_gpu, monkeypatch):
    comm = coll.Communicator(SelfTransport())
    f, failure = cuda.local_facts(comm, 1)
    assert failure is None and f["pci"] == "0000:02:00.0" and f["visible"] == 2 and f["library"] == "fake"
    if _libnccl.info()["available"]:
        assert f["nccl"] is True and f["nccl_version"] >= (2, 14, 0)
    monkeypatch.setenv("COLLECTIVES_DISABLE_NCCL", "1")
    f, _ = cuda.local_facts(comm, 1)
    assert f["nccl"] is False and "COLLECTIVES_DISABLE_NCCL" in f["nccl_why"]
    f, failure = cuda.local_facts(comm, 5)
    assert isinstance(failure, coll.BackendUnavailableError) and "cuda:5 does not exist" in f["error"]


def test_disable_nccl_selects_staging_and_warns_once(fake_gpu, monkeypatch, mpi_comm):
    monkeypatch.setenv("COLLECTIVES_DISABLE_NCCL", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = factory.device_transport(engine_of(mpi_comm), (2, 0))
        second = factory.device_transport(engine_of(mpi_comm), (2, 1))
    assert first.name == second.name == "host-staging" and first.array_level
    assert len(caught) == 1, [str(w.message) for w in caught]
    w = caught[0]
    assert issubclass(w.category, RuntimeWarning) and w.filename == __file__  # points at the user's line
    text = str(w.message)
    for part in ("staged through host memory", "COLLECTIVES_DISABLE_NCCL", "COLLECTIVES_CUDA_AWARE_MPI=1",
                 "COLLECTIVES_CUDA_AWARE_MPI=0", "silence"):
        assert part in text


def test_cuda_aware_opt_in_and_silence(fake_gpu, monkeypatch, mpi_comm):
    monkeypatch.setenv("COLLECTIVES_DISABLE_NCCL", "1")
    monkeypatch.setenv("COLLECTIVES_CUDA_AWARE_MPI", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert factory.device_transport(engine_of(mpi_comm), (2, 0)).name == "cuda-aware-mpi"
        monkeypatch.setenv("COLLECTIVES_CUDA_AWARE_MPI", "0")
        assert factory.device_transport(engine_of(mpi_comm), (2, 0)).name == "host-staging"  # and no warning


def test_self_backend_stages_without_warning(fake_gpu, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_DISABLE_NCCL", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = factory.device_transport(engine_of(coll.Communicator(SelfTransport())), (2, 0))
    assert t.name == "host-staging"


def test_cuda_array_on_a_cpu_machine_is_a_clear_error():
    code = f"""
        import sys, collectives as coll
        class FakeCuda:
            def __dlpack_device__(self): return (2, 0)
            def __dlpack__(self, **kw): raise AssertionError("must not be touched")
        for f in (coll.allreduce, coll.broadcast, coll.allgather, coll.reduce):
            try:
                f(FakeCuda())
            except coll.BackendUnavailableError as e:
                print("refused:", e)
        print("heavy:", [m for m in {HEAVY!r} if m in sys.modules and m not in ("mpi4py", "mpi4py.MPI")])
    """
    proc = run_python(code, {"COLLECTIVES_BACKEND": "self"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len([ln for ln in lines if ln.startswith("refused: array on cuda:0")]) == 4, proc.stdout
    assert "torch is not imported; CuPy is not imported" in lines[0]
    assert lines[-1] == "heavy: []"


@pytest.mark.skipif(torch is None or torch.cuda.is_available(), reason="needs a CPU-only torch")
def test_cuda_array_with_cpu_only_torch_is_a_clear_error():
    class FakeCuda:
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, **kw):
            raise AssertionError("must not be touched")

    with pytest.raises(coll.BackendUnavailableError, match=r"torch.cuda.is_available\(\) is False"):
        coll.allreduce(FakeCuda(), comm=coll.Communicator(SelfTransport()))


def test_importing_the_cuda_transports_pulls_in_no_heavy_library():
    proc = run_python(f"""
        import sys, collectives
        from collectives._backends import cuda, nccl
        print([m for m in {HEAVY!r} if m in sys.modules])
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", (proc.stdout, proc.stderr)


@needs_torch
def test_unsupported_cuda_library_is_refused():
    class Other:
        pass

    with pytest.raises(coll.BackendUnavailableError, match="torch tensors and CuPy arrays only"):
        device.library_of(Other())
    assert device.library_of(torch.zeros(1)).name == "torch"


# ---------------------------------------------------------------------------------------------------------
# torch CPU tensors standing in for CUDA tensors

class FakeTorch(device._TorchCUDA):
    """The real torch helper, with the CUDA-only calls replaced."""

    def __init__(self):
        super().__init__(torch)
        self.syncs = 0

    def stream(self, x):
        return 0x5EA

    def synchronize(self, x):
        self.syncs += 1

    def using(self, index):
        return contextlib.nullcontext()

    def index(self, x):
        return 0

    def to_host(self, x):
        return x.detach().clone()  # a real copy, as device -> host would be

    def to_device(self, host, like):
        return host.clone()


NP_OF_NCCL = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16,
              7: np.float32, 8: np.float64, 9: np.uint16}


def memory(ptr, count, dtype):
    dtype = np.dtype(dtype)
    raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(ptr)
    return np.ctypeslib.as_array(raw).view(dtype)


class FakeNCCL:
    """Computes what ``nranks`` ranks holding identical data would get; records every call."""

    version_tuple = (2, 32, 3)

    def __init__(self, nranks=3, rank=0):
        self.nranks, self.rank = nranks, rank
        self.calls = []
        self.states = []  # comm_get_async_error answers, then 0
        self.status = 0  # what collectives return
        self.config = None

    def _next_state(self):
        return self.states.pop(0) if self.states else 0

    def get_unique_id(self):
        return bytes(range(128))

    def comm_init_rank_config(self, nranks, uid, rank, config):
        self.calls.append(("init", nranks, len(uid), rank))
        self.config = config
        return 0xC0FFEE

    def comm_get_async_error(self, handle):
        return self._next_state()

    def error_string(self, state):
        return f"error {state}"

    def last_error(self):
        return "the fake's last error"

    error = _libnccl.NCCLLibrary.error  # the real library's one way to make an NcclError from a status

    def comm_finalize(self, h):
        self.calls.append(("finalize", h))
        return 7

    def comm_destroy(self, h):
        self.calls.append(("destroy", h))
        return 0

    def comm_abort(self, h):
        self.calls.append(("abort", h))
        return 0

    def group_start(self):
        self.calls.append(("group_start",))
        return 0

    def group_end(self):
        self.calls.append(("group_end",))
        for ptr, count, _peer in self._recvs:  # every peer holds this rank's data: what peer sends us is
            memory(ptr, count, np.uint8)[...] = memory(self._sends[self.rank], count, np.uint8)  # our block
        self._recvs, self._sends = (), {}
        return self.status

    _recvs: tuple = ()  # (pointer, count, peer) of the receives of the open group
    _sends: dict = {}  # noqa: RUF012 - peer -> pointer of the open group's sends; replaced, never mutated

    def send(self, ptr, count, dtype, peer, comm, stream):
        self.calls.append(("send", ptr, count, dtype, peer, comm, stream))
        self._sends = {**self._sends, peer: ptr}
        return 0

    def recv(self, ptr, count, dtype, peer, comm, stream):
        self.calls.append(("recv", ptr, count, dtype, peer, comm, stream))
        self._recvs = (*self._recvs, (ptr, count, peer))
        return 0

    def reduce_scatter(self, send, recv, count, dtype, op, comm, stream):
        self.calls.append(("reduce_scatter", send, recv, count, dtype, op, comm, stream))
        block = send + self.rank * count * np.dtype(NP_OF_NCCL[dtype]).itemsize
        self._reduce(block, recv, count, dtype, op)
        return self.status

    def _reduce(self, send, recv, count, dtype, op):
        x = memory(send, count, NP_OF_NCCL[dtype]).copy()
        if dtype == _libnccl.ncclBfloat16:
            x = _dtypes.bf16_to_f32(x)
        n = self.nranks
        y = {0: x * n, 1: x ** n, 2: x, 3: x, 4: x}[op] if x.dtype.kind != "b" else x
        out = memory(recv, count, NP_OF_NCCL[dtype])
        if dtype == _libnccl.ncclBfloat16:
            _dtypes.f32_to_bf16(y.astype(np.float32), out=out)
        else:
            out[...] = y

    def all_reduce(self, send, recv, count, dtype, op, comm, stream):
        self.calls.append(("all_reduce", send, recv, count, dtype, op, comm, stream))
        self._reduce(send, recv, count, dtype, op)
        return self.status

    def reduce(self, send, recv, count, dtype, op, root, comm, stream):
        self.calls.append(("reduce", send, recv, count, dtype, op, root, comm, stream))
        if root == self.rank:
            self._reduce(send, recv, count, dtype, op)
        return self.status

    def broadcast(self, send, recv, count, dtype, root, comm, stream):
        self.calls.append(("broadcast", send, recv, count, dtype, root, comm, stream))
        if root != self.rank:
            memory(recv, count, np.uint8)[...] = 0x40 + root  # "root's bytes"
        return self.status

    def all_gather(self, send, recv, count, dtype, comm, stream):
        self.calls.append(("all_gather", send, recv, count, dtype, comm, stream))
        data = memory(send, count, np.uint8).copy()
        out = memory(recv, count * self.nranks, np.uint8)
        for r in range(self.nranks):
            out[r * count:(r + 1) * count] = data
        return self.status


class FakeHost:
    name = "fake"
    failed = None  # HostTransport.failed: never

    def __init__(self, size=3, rank=0):
        self.size, self.rank, self.local_rank, self.local_size = size, rank, rank, size
        self.objects = []

    def broadcast_object(self, obj, root):
        self.objects.append(("broadcast_object", obj))
        return obj if self.rank == root else self.from_root

    from_root = bytes(range(128))  # what the root broadcasts to the others: FakeNCCL's unique id

    def allgather_object(self, obj):
        self.objects.append(("allgather_object", obj))
        return [obj] * self.size

    def allgather(self, send, recv):
        self.objects.append(("allgather", send.copy()))
        recv[...] = send

    agree_allgather = allgather  # the agreement protocol's exchange (HostTransport.agree_allgather)


class FakeComm:
    """Stands for a Communicator's Engine (``collectives._comm.Engine``): what a device transport gets."""

    def __init__(self, size=3, rank=0, check=False):
        self.host = FakeHost(size, rank)
        self.rank, self.size, self.local_rank, self.local_size = rank, size, rank, size
        self.check = check  # checked mode (Engine.check)


def nccl_transport(lib=None, *, size=3, rank=0, timeout=5.0, check=False):
    from collectives._backends.nccl import NCCLTransport

    lib = lib or FakeNCCL(size, rank)
    t = NCCLTransport(FakeComm(size, rank, check), 0, lib, FakeTorch(), timeout=timeout)
    t._library_of = lambda x: FakeTorch()
    return t, lib


def collective_calls(lib):
    return [c for c in lib.calls if c[0] in ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter",
                                             "send", "recv")]


@needs_torch
def test_nccl_init_is_non_blocking_and_polled():
    lib = FakeNCCL()
    lib.states = [7, 7, 7, 0]
    t, _ = nccl_transport(lib)
    assert t.name == "nccl" and t.array_level and t._handle == 0xC0FFEE
    assert lib.config.blocking == 0 and lib.calls[0] == ("init", 3, 128, 0)
    assert lib.states == []  # polled until no longer in progress
    assert t._host.objects[0] == ("broadcast_object", bytes(range(128)))  # rank 0's id, raw bytes


@needs_torch
def test_nccl_init_timeout_aborts_and_raises():
    lib = FakeNCCL()
    lib.states = [7] * 10**7
    with pytest.raises(coll.CollectiveTimeoutError, match=r"ncclCommInitRankConfig .* within 0.05 s \(COLLECTIVES_TIMEOUT\)"):
        nccl_transport(lib, timeout=0.05)
    assert ("abort", 0xC0FFEE) in lib.calls


@needs_torch
def test_nccl_init_async_error_aborts_and_raises_nccl_error():
    lib = FakeNCCL()
    lib.states = [7, _libnccl.ncclSystemError]
    with pytest.raises(coll.NcclError) as info:
        nccl_transport(lib)
    assert info.value.status == _libnccl.ncclSystemError and "the fake's last error" in str(info.value)
    assert ("abort", 0xC0FFEE) in lib.calls


@needs_torch
def test_nccl_allreduce_in_place_contiguous():
    t, lib = nccl_transport()
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    ptr = x.data_ptr()
    assert t.allreduce(x, None, "sum") is x
    assert x.data_ptr() == ptr and x.tolist() == [[0, 3, 6], [9, 12, 15]]
    (call,) = collective_calls(lib)
    assert call == ("all_reduce", ptr, ptr, 6, _libnccl.ncclFloat32, _libnccl.ncclSum, 0xC0FFEE, 0x5EA)


@needs_torch
def test_nccl_allreduce_non_contiguous_view_writes_only_its_elements():
    t, lib = nccl_transport()
    base = torch.ones(4, 6, dtype=torch.float64)
    view = base[:, ::2]
    assert t.allreduce(view, None, "sum") is view
    assert (base[:, ::2] == 3).all() and (base[:, 1::2] == 1).all()
    (call,) = collective_calls(lib)
    assert call[1] == call[2] != base.data_ptr() and call[3] == 12  # a contiguous temporary


@needs_torch
@pytest.mark.parametrize("dtype, op, want_dtype, want_op, mult", [
    ("complex64", "sum", _libnccl.ncclFloat32, _libnccl.ncclSum, 2),
    ("complex128", "mean", _libnccl.ncclFloat64, _libnccl.ncclSum, 2),  # mean: a sum, divided once after
    ("bool", "max", _libnccl.ncclUint8, _libnccl.ncclMax, 1),
    ("bool", "min", _libnccl.ncclUint8, _libnccl.ncclMin, 1),
    # the host rules (_dtypes.wire): float16/bfloat16 widened to float32 on the device, never ncclAvg
    ("bfloat16", "mean", _libnccl.ncclFloat32, _libnccl.ncclSum, 1),
    ("bfloat16", "sum", _libnccl.ncclFloat32, _libnccl.ncclSum, 1),
    ("float16", "mean", _libnccl.ncclFloat32, _libnccl.ncclSum, 1),
    ("float16", "sum", _libnccl.ncclFloat32, _libnccl.ncclSum, 1),
    ("float16", "prod", _libnccl.ncclFloat32, _libnccl.ncclProd, 1),
    ("float32", "mean", _libnccl.ncclFloat32, _libnccl.ncclSum, 1),
    ("float64", "prod", _libnccl.ncclFloat64, _libnccl.ncclProd, 1),
    # float min/max: the ordered integers, reduced with NCCL's integer MIN/MAX on the device
    ("float16", "max", _libnccl.ncclInt32, _libnccl.ncclMax, 1),  # NCCL has no int16: widened first
    ("bfloat16", "min", _libnccl.ncclInt32, _libnccl.ncclMin, 1),
    ("float32", "min", _libnccl.ncclInt32, _libnccl.ncclMin, 1),
    ("float64", "max", _libnccl.ncclInt64, _libnccl.ncclMax, 1),
    ("int64", "min", _libnccl.ncclInt64, _libnccl.ncclMin, 1),
    ("uint8", "sum", _libnccl.ncclUint8, _libnccl.ncclSum, 1),
])
def test_nccl_dtype_op_mapping(dtype, op, want_dtype, want_op, mult):
    t, lib = nccl_transport()
    made = len(t._host.objects)  # the unique id's broadcast, at construction
    x = torch.ones(5, dtype=getattr(torch, dtype))
    t.allreduce(x, None, op)
    (call,) = collective_calls(lib)
    assert call[3:6] == (5 * mult, want_dtype, want_op)
    assert len(t._host.objects) == made, "nothing went through the host (no staging)"


@needs_torch
def test_nccl_values_through_the_fake():
    t, _ = nccl_transport()
    z = torch.tensor([1 + 2j, -3j], dtype=torch.complex64)
    t.allreduce(z, None, "sum")
    assert z.tolist() == [3 + 6j, -9j]
    b = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    t.allreduce(b, None, "sum")
    assert b.float().tolist() == [4.5, -6.75]


# ---- the host rules on the device: the same bits as the host path (issue 21) ----

FLOATS = ("float16", "bfloat16", "float32", "float64")
_INT_OF_SIZE = {2: "int16", 4: "int32", 8: "int64"}


def _bits(t):
    """``(integer bits, NaN mask)`` of a float tensor, flat, as NumPy."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(getattr(torch, _INT_OF_SIZE[t.element_size()])).numpy(), torch.isnan(t).numpy()


def same_bits_torch(got, want) -> bool:
    """Equal bit for bit, any NaN equal to any NaN (its payload is free), -0.0 unlike +0.0."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    (g, gn), (w, wn) = _bits(got), _bits(want)
    return bool((gn == wn).all() and (g[~gn] == w[~wn]).all())


def float_inputs(dtype: str, seed: int = 0, count: int = 97):
    """Seeded values of ``dtype`` that make every rule visible: inexact quotients and products, overflow
    of the narrow types, subnormals, zeros of both signs, infinities and NaNs (a negative one too)."""
    rng = np.random.default_rng([FLOATS.index(dtype), seed])
    v = rng.normal(0, 8, count) * rng.choice([1e-6, 1.0, 3e4], count)
    v[:12] = (0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-7, -1e-7, 6e4, -6e4, 1.0 / 3, 2.0 / 3)
    t = torch.from_numpy(v).to(getattr(torch, dtype))
    return t[torch.from_numpy(rng.permutation(count))]


def host_bits(x, op: str, n: int):
    """The host path (``_reduction.reduce_buffer``) on x's values, over ``n`` ranks holding x, with a
    network that reduces exactly as FakeNCCL does, and NCCL's own reductions (``nccl.reduces``): the
    reference for the device path."""
    from collectives import _reduction
    from collectives._backends import nccl

    info = FakeTorch().dtype(x)
    storage = x.detach().contiguous().reshape(-1)
    if x.dtype == torch.bfloat16:
        buf = storage.view(torch.int16).numpy().view(np.uint16).copy()
    else:
        buf = storage.numpy().copy()

    def network(wire, wop):  # n identical ranks
        y = {"sum": wire * n, "prod": wire ** n}.get(wop, wire)
        wire[...] = y

    _reduction.reduce_buffer(buf, info, op, n, network, nccl.reduces)
    if x.dtype == torch.bfloat16:
        return torch.from_numpy(buf.view(np.int16)).view(torch.bfloat16).reshape(x.shape)
    return torch.from_numpy(buf).reshape(x.shape)


@needs_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_device_ordered_integers_are_the_host_map(dtype):
    """The device's order-preserving map (torch's own bitwise operations) gives ``_reduction.to_ordered``'s
    integers for every float16 and bfloat16 bit pattern and for random float32/float64 patterns, with NaN at
    the extreme of each op, and maps them back to the same bits (NaN to a NaN)."""
    from collectives import _reduction

    api = FakeTorch()
    width = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    ints = np.dtype(_INT_OF_SIZE[width])
    if width == 2:
        patterns = np.arange(-2**15, 2**15, dtype=np.int16)
    else:
        rng = np.random.default_rng(width)
        patterns = rng.integers(np.iinfo(ints).min, np.iinfo(ints).max, 50_000, dtype=ints, endpoint=True)
        special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-40, -1e-40], dtype=f"f{width}")
        patterns = np.concatenate([patterns, special.view(ints)])
    for op in ("min", "max"):
        t = torch.from_numpy(patterns.copy()).view(getattr(torch, dtype))
        got = api.to_ordered_(t, ints, _dtypes.ordered_nan(ints, op))
        if dtype == "bfloat16":  # NumPy has no bfloat16: the map is on the bits, NaN where the exponent is full
            host = patterns.copy()
            nan = ((host.view(np.uint16) & 0x7F80) == 0x7F80) & ((host.view(np.uint16) & 0x7F) != 0)
            host = np.where(host < 0, host ^ np.int16(0x7FFF), host)
            host[nan] = _dtypes.ordered_nan(ints, op)
        else:
            host = _reduction.to_ordered(patterns.copy().view(f"f{width}"), op)
        assert np.array_equal(got.numpy(), host), (dtype, op)
        back = api.from_ordered_(got, np.dtype(np.float32) if dtype == "bfloat16" else np.dtype(f"f{width}"))
        if dtype == "bfloat16":
            back = got.view(torch.bfloat16)
        want = torch.from_numpy(patterns.copy()).view(getattr(torch, dtype))
        assert same_bits_torch(back, want), (dtype, op)
    assert got.data_ptr() == t.data_ptr(), "in place"


@needs_torch
@pytest.mark.parametrize("op", ["sum", "prod", "mean", "min", "max"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_nccl_device_rules_give_the_host_bits(dtype, op):
    """Every NCCL reduction of floats, with the host rules encoded on the device (widening, ordered
    integers, one division), against the host path over the same (fake) network, bit for bit: allreduce
    (contiguous and a strided view), reduce (root; a non-root rank's x untouched, NaN payloads included),
    reduce_scatter and allreduce_many; nothing goes through host memory."""
    n = 3
    x = float_inputs(dtype)
    want = host_bits(x, op, n)
    t, lib = nccl_transport(FakeNCCL(n, rank=0))
    other, _ = nccl_transport(FakeNCCL(n, rank=1), rank=1)
    made = len(t._host.objects), len(other._host.objects)  # the unique id's broadcast, at construction
    got = x.clone()
    t.allreduce(got, None, op)
    assert same_bits_torch(got, want), f"allreduce {dtype} {op}"
    base = torch.zeros(x.numel(), 2, dtype=x.dtype)
    base[:, 0] = x
    t.allreduce(base[:, 0], None, op)
    assert same_bits_torch(base[:, 0].contiguous(), want) and (base[:, 1] == 0).all(), "strided view"
    root = x.clone()
    t.reduce(root, None, op, 0)
    assert same_bits_torch(root, want), f"reduce {dtype} {op}"
    kept = x.clone()
    other.reduce(kept, None, op, 0)
    assert np.array_equal(_bits(kept)[0], _bits(x)[0]), "a non-root rank's x is left bit for bit as it was"
    blocks = x[:96].reshape(n, 32)
    mine = t.reduce_scatter(blocks, None, op)
    assert same_bits_torch(mine, want[:96].reshape(n, 32)[:1]), f"reduce_scatter {dtype} {op}"
    many = [x.clone(), x.clone()[::2], torch.ones(3, dtype=x.dtype)]
    t.allreduce_many(many, None, op)
    assert same_bits_torch(many[0], want) and same_bits_torch(many[1], want[::2])
    assert (len(t._host.objects), len(other._host.objects)) == made, "nothing went through the host"
    for call in collective_calls(lib):
        if op in ("min", "max"):
            assert call[4] in (_libnccl.ncclInt32, _libnccl.ncclInt64), call  # ordered integers
        elif dtype in ("float16", "bfloat16"):
            assert call[4] == _libnccl.ncclFloat32, call  # widened on the device
        assert call[5] != _libnccl.ncclAvg, call  # the op (ncclAvg and ncclInt64 share the number 4)


@needs_torch
@pytest.mark.parametrize("n", [2, 3, 5, 7])
def test_device_mean_divides_as_the_host_does(n):
    """mean's division on the device is ``_dtypes.divide``'s: ``buf / n`` in the value dtype (a true
    division, not a product with 1/n), complex part by part."""
    api = FakeTorch()
    rng = np.random.default_rng(n)
    for dtype in (np.float16, np.float32, np.float64, np.complex64):
        v = (rng.normal(0, 100, 1000) + (1j * rng.normal(0, 100, 1000) if dtype == np.complex64 else 0)).astype(dtype)
        host = v.copy()
        _dtypes.divide(host, n)
        t = torch.from_numpy(v.copy())
        api.divide_(t, n)
        assert np.array_equal(t.numpy().view(f"u{np.dtype(dtype).itemsize // (2 if dtype == np.complex64 else 1)}"),
                              host.view(f"u{np.dtype(dtype).itemsize // (2 if dtype == np.complex64 else 1)}")), dtype


def host_message(dtype_name, op):
    info = _dtypes.from_numpy(np.dtype(dtype_name))
    with pytest.raises(TypeError) as err:
        _dtypes.check_reduction(info, op)
    return str(err.value)


@needs_torch
@pytest.mark.parametrize("dtype, op, match", [
    ("bool", "sum", None),  # the host path's own words
    ("int32", "mean", None),
    ("complex64", "max", None),
    ("complex64", "prod", "op='prod' on complex dtype complex64 is not supported by NCCL"),
    ("int16", "sum", "dtype int16 is not a NCCL type"),
    ("float8_e4m3fn", "sum", "needs a numeric dtype"),
])
def test_nccl_illegal_pairs_raise_before_any_call(dtype, op, match):
    t, lib = nccl_transport()
    x = torch.zeros(3, dtype=getattr(torch, dtype))
    with pytest.raises(TypeError) as err:
        t.allreduce(x, None, op)
    if match is None:
        assert str(err.value) == host_message(dtype, op)
    else:
        assert match in str(err.value)
    with pytest.raises(TypeError):
        t.reduce(x, None, op, 0)
    assert collective_calls(lib) == [] and not lib.calls[-1][0].startswith("group")


@needs_torch
def test_nccl_conj_and_requires_grad_are_written_in_place():
    t, _ = nccl_transport()
    base = torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64)
    view = base.conj()
    assert view.is_conj()
    t.allreduce(view, None, "sum")
    assert view.resolve_conj().tolist() == [3 - 3j, 6 + 3j]
    p = torch.ones(3, requires_grad=True)
    assert t.allreduce(p, None, "sum") is p
    assert p.requires_grad and p.detach().tolist() == [3, 3, 3] and p.grad is None


@needs_torch
def test_nccl_broadcast_moves_bytes_in_place():
    t, lib = nccl_transport(rank=0)
    x = torch.arange(4, dtype=torch.int16)
    assert t.broadcast(x, None, 0) is x and x.tolist() == [0, 1, 2, 3]  # root keeps its values
    assert t.broadcast(x, None, 2) is x
    assert x.view(torch.uint8).tolist() == [0x42] * 8  # root 2's bytes
    calls = collective_calls(lib)
    assert calls[1][3:6] == (8, _libnccl.ncclUint8, 2) and calls[1][1] == calls[1][2] == x.data_ptr()
    base = torch.zeros(3, 4, dtype=torch.uint8)
    t.broadcast(base[:, 1], None, 1)
    assert base[:, 1].tolist() == [0x41] * 3 and (base[:, [0, 2, 3]] == 0).all()


@needs_torch
def test_nccl_reduce_root_and_non_root():
    t, _ = nccl_transport(rank=0)
    x = torch.full((2, 4), 2.0)[:, ::2]
    t.reduce(x, None, "prod", 0)
    assert (x == 8).all()
    y = torch.full((3,), 2.0)
    t.reduce(y, None, "sum", 1)  # not root: unchanged
    assert (y == 2).all()


@needs_torch
def test_nccl_allgather_returns_a_new_array():
    t, lib = nccl_transport()
    x = torch.arange(6, dtype=torch.float16).reshape(2, 3).t()  # non-contiguous
    out = t.allgather(x, None)
    assert out.shape == (3, 3, 2) and out.dtype == torch.float16
    for r in range(3):
        assert torch.equal(out[r], x)
    assert collective_calls(lib)[0][3:5] == (12, _libnccl.ncclUint8)


@needs_torch
def test_nccl_empty_and_zero_d():
    t, lib = nccl_transport()
    e = torch.zeros(0)
    assert t.allreduce(e, None, "sum") is e and t.broadcast(e, None, 1) is e
    assert t.allgather(e, None).shape == (3, 0)
    assert collective_calls(lib) == []
    s = torch.tensor(2.0)
    t.allreduce(s, None, "sum")
    assert s.item() == 6.0


@needs_torch
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_nccl_reduce_scatter_gives_this_ranks_block(op):
    t, lib = nccl_transport(FakeNCCL(3, rank=1))  # the fake library plays rank 1 (the block it returns)
    x = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    before = x.clone()
    out = t.reduce_scatter(x, None, op)
    assert torch.equal(x, before), "x is left unchanged"
    want = before[2:4] * 3
    if op == "mean":
        want = want / 3
    assert out.shape == (2, 2) and torch.equal(out, want)
    (call,) = collective_calls(lib)
    assert call[0] == "reduce_scatter" and call[1] == x.data_ptr() and call[2] == out.data_ptr()
    assert call[3:6] == (4, _libnccl.ncclFloat32, _libnccl.ncclSum)  # recvcount: one rank's block


@needs_torch
@pytest.mark.parametrize("op", ["mean", "max"])
def test_nccl_reduce_scatter_of_encoded_values_leaves_x_and_gives_the_block(op):
    t, lib = nccl_transport(FakeNCCL(3, rank=2))
    x = torch.tensor([[1.5, -0.0], [0.0, float("nan")], [-2.25, 3.0]], dtype=torch.float16)
    before = x.clone()
    out = t.reduce_scatter(x, None, op)
    assert torch.equal(x.view(torch.int16), before.view(torch.int16)), "x is left bit for bit as it was"
    assert out.shape == (1, 2) and out.dtype == torch.float16
    assert same_bits_torch(out, before[2:] if op == "max" else (before[2:].float() * 3 / 3).half())
    (call,) = collective_calls(lib)
    assert call[1] != x.data_ptr() and call[2] != out.data_ptr()  # float32 / int32 temporaries
    assert call[3:6] == (2, _libnccl.ncclInt32 if op == "max" else _libnccl.ncclFloat32,
                         _libnccl.ncclMax if op == "max" else _libnccl.ncclSum)


@needs_torch
def test_nccl_reduce_scatter_complex_counts_pairs_and_non_contiguous_input():
    t, lib = nccl_transport(FakeNCCL(3, rank=2))
    x = torch.ones(4, 3, dtype=torch.complex64).t()  # (3, 4), non-contiguous
    out = t.reduce_scatter(x, None, "sum")
    assert out.shape == (1, 4) and (out == 3).all()
    assert collective_calls(lib)[0][3] == 8  # 4 complex values: 8 floats


@needs_torch
def test_nccl_alltoall_is_one_group_of_sends_and_receives():
    t, lib = nccl_transport(FakeNCCL(3, rank=1))
    x = torch.arange(12, dtype=torch.int16).reshape(6, 2)  # any dtype: bytes
    before = x.clone()
    out = t.alltoall(x, None)
    assert torch.equal(x, before) and out.shape == x.shape and out.dtype == x.dtype
    for i in range(3):  # every (fake) rank holds x: block i of the result is rank i's block 1
        assert torch.equal(out[2 * i:2 * i + 2], before[2:4])
    names = [c[0] for c in lib.calls if c[0] != "init"]
    assert names == ["group_start"] + ["send", "recv"] * 3 + ["group_end"]
    sends = [c for c in lib.calls if c[0] == "send"]
    recvs = [c for c in lib.calls if c[0] == "recv"]
    assert [c[1] - x.data_ptr() for c in sends] == [0, 8, 16] and [c[4] for c in sends] == [0, 1, 2]
    assert [c[1] - out.data_ptr() for c in recvs] == [0, 8, 16] and [c[2] for c in recvs] == [8] * 3
    assert t.alltoall(torch.zeros(0, 3), None).shape == (0, 3)


@needs_torch
def test_nccl_allreduce_many_is_one_group():
    t, lib = nccl_transport()
    a, b = torch.ones(4), torch.full((2, 4), 2, dtype=torch.int32)
    c = torch.ones(3, 4, dtype=torch.complex64)[:, 1]
    assert t.allreduce_many([a, b, c], None, "sum") == [a, b, c]
    assert (a == 3).all() and (b == 6).all() and (c == 3).all()
    names = [call[0] for call in lib.calls if call[0] != "init"]
    assert names == ["group_start", "all_reduce", "all_reduce", "all_reduce", "group_end"]
    with pytest.raises(TypeError):
        t.allreduce_many([a, torch.ones(2, dtype=torch.int16)], None, "sum")
    assert [call[0] for call in lib.calls].count("group_start") == 1  # nothing enqueued


@needs_torch
def test_nccl_in_progress_call_is_polled():
    lib = FakeNCCL()
    t, _ = nccl_transport(lib)
    lib.status = _libnccl.ncclInProgress
    lib.states = [0, 7, 7, 0]  # the pre-call check, then two polls
    x = torch.ones(2)
    t.allreduce(x, None, "sum")
    assert lib.states == [] and (x == 3).all()


@needs_torch
def test_nccl_collective_timeout_aborts_and_later_calls_refuse():
    lib = FakeNCCL()
    t, _ = nccl_transport(lib, timeout=0.05)
    lib.status = _libnccl.ncclInProgress
    lib.states = [0] + [7] * 10**7
    with pytest.raises(coll.CollectiveTimeoutError, match="ncclAllReduce on cuda:0 .* aborted"):
        t.allreduce(torch.ones(2), None, "sum")
    assert ("abort", 0xC0FFEE) in lib.calls
    with pytest.raises(coll.BackendUnavailableError, match="timed out .*finalize"):
        t.allreduce(torch.ones(2), None, "sum")
    t.close()
    t.close()
    assert [c[0] for c in lib.calls].count("abort") == 1 and ("destroy", 0xC0FFEE) not in lib.calls


@needs_torch
def test_nccl_async_error_from_a_peer_surfaces_before_the_next_call():
    lib = FakeNCCL()
    t, _ = nccl_transport(lib)
    lib.states = [_libnccl.ncclRemoteError]
    with pytest.raises(coll.NcclError) as err:
        t.allreduce(torch.ones(2), None, "sum")
    assert err.value.status == _libnccl.ncclRemoteError and collective_calls(lib) == []
    assert ("abort", 0xC0FFEE) in lib.calls


@needs_torch
def test_nccl_close_finalizes_then_destroys_once():
    lib = FakeNCCL()
    t, _ = nccl_transport(lib)
    lib.states = [7, 7, 0]
    t.close()
    t.close()
    names = [c[0] for c in lib.calls]
    assert names == ["init", "finalize", "destroy"]
    with pytest.raises(coll.BackendUnavailableError, match="closed"):
        t.allreduce(torch.ones(1), None, "sum")


@needs_torch
def test_nccl_close_never_hangs(monkeypatch):
    from collectives._backends import nccl

    monkeypatch.setattr(nccl, "CLOSE_TIMEOUT", 0.05)
    lib = FakeNCCL()
    t, _ = nccl_transport(lib)
    lib.states = [7] * 10**6
    t.close()
    assert [c[0] for c in lib.calls] == ["init", "finalize", "abort"]


@needs_torch
def test_nccl_in_checked_mode_agrees_nothing_itself(monkeypatch):
    """Issue 33: a CUDA call in checked mode is agreed once, by the engine, before its transport is chosen
    (``validate.agree_device``; a tree's device leaves by the tree's agreement): the NCCL transport itself
    sends no agreement of its own for any collective (it did, a second one, with another header)."""
    from collectives import _agree

    t, lib = nccl_transport(check=True)
    agreed = []
    monkeypatch.setattr(_agree, "agree", lambda *a, **k: agreed.append(a[1]))
    before = list(t._host.objects)
    x = torch.ones(3, 2)
    t.allreduce(x, None, "mean")
    t.reduce(x, None, "sum", 0)
    t.broadcast(x, None, 0)
    t.allgather(x, None)
    t.reduce_scatter(x, None, "sum")
    t.alltoall(x, None)
    t.allreduce_many([x, torch.ones(4)], None, "sum")
    assert agreed == [] and t._host.objects == before
    assert [c[0] for c in collective_calls(lib)][:5] == ["all_reduce", "reduce", "broadcast", "all_gather",
                                                         "reduce_scatter"]


# ---------------------------------------------------------------------------------------------------------
# host staging and CUDA-aware MPI, for real (MPI takes host pointers the same way)

@needs_torch
def test_staging_single_process_in_place():
    comm = coll.Communicator(SelfTransport())
    t = cuda.HostStagingTransport(engine_of(comm), 0)
    fake = FakeTorch()
    t._library_of = lambda x: fake
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = base[:, 1::2]
    assert t.allreduce(view, None, "mean") is view and base[0].tolist() == [0, 1, 2, 3]
    assert t.allgather(view, None).shape == (1, 3, 2)
    with pytest.raises(TypeError, match="bool"):
        t.allreduce(torch.ones(2, dtype=torch.bool), None, "sum")


def test_a_staged_device_call_is_one_call_agreed_once(monkeypatch):
    """Issue 33, calls run upward: a CUDA call through host staging, in checked mode, is validated, recorded
    and agreed once, by the engine (the agreement on the device array, before its transport is chosen); the
    host collective's steps run inside it (``Engine.staged``), with no record or agreement of their own,
    blocking and asynchronous. (Point-to-point, between ranks: tests/mpi/test_checked.py.)"""
    from collectives import _agree
    from support.device import OnDevice, staging

    comm = coll.Communicator(SelfTransport(), check=True)
    staging(comm, monkeypatch)
    agreed = []
    real = _agree.agree
    monkeypatch.setattr(_agree, "agree",
                        lambda transport, what, *a, **k: (agreed.append(what), real(transport, what, *a, **k)))
    engine = engine_of(comm)

    def once(what, call, p2p=False):
        agreed.clear()
        seq, p2p_seq = engine.trace_seq(), engine.trace_p2p_seq()
        out = call()
        assert agreed == ([] if p2p else [what]), (what, agreed)
        assert (engine.trace_seq() - seq, engine.trace_p2p_seq() - p2p_seq) == ((0, 1) if p2p else (1, 0)), what
        return out

    x = OnDevice([1.5, -2.0, 3.25, 4.0])
    assert once("allreduce", lambda: comm.allreduce(x, "mean")).values.tolist() == [1.5, -2.0, 3.25, 4.0]
    assert once("allreduce", lambda: comm.allreduce(x, "max", async_op=True).wait()) is x
    assert once("reduce", lambda: comm.reduce(x, "sum", 0)) is x
    assert once("reduce_scatter", lambda: comm.reduce_scatter(x, "sum")).values.tolist() == x.values.tolist()
    assert once("alltoall", lambda: comm.alltoall(x)).values.tolist() == x.values.tolist()
    assert once("broadcast", lambda: comm.broadcast(x, 0)) is x
    assert once("allgather", lambda: comm.allgather(x)).values.shape == (1, 4)
    assert once("gather", lambda: comm.gather(x, 0)).values.tolist() == [x.values.tolist()]
    entries = engine.trace_entries()
    assert [e["collective"] for e in entries[-8:]] == ["allreduce", "allreduce", "reduce", "reduce_scatter",
                                                        "alltoall", "broadcast", "allgather", "gather"], entries[-8:]
    with pytest.raises(TypeError, match="bool"):  # the host rules' words, before anything moves
        comm.allreduce(OnDevice([True]), "sum")


def test_a_staged_message_is_the_host_path_s_without_a_record():
    """NCCL's message description, host staging's messages: ``Engine.staged("send", ..., async_op=True)`` is
    a Handle of the host path's send (its header, the receive's check and words), and neither it nor the
    staged receive begins a record (the device call has one)."""
    comm = coll.Communicator(SelfTransport())
    engine = engine_of(comm)
    seq = engine.trace_p2p_seq()
    sent = engine.staged("send", np.arange(3.0), 0, 9, async_op=True)
    y = np.zeros(3)
    assert engine.staged("recv", y, 0, 9) == 0 and y.tolist() == [0.0, 1.0, 2.0]
    assert sent.wait() is None and engine.trace_p2p_seq() == seq
    engine.staged("send", np.arange(3.0), 0, 9, async_op=True)
    with pytest.raises(ValueError, match=r"rank 0 sent 3 x float64 \(tag 9\), but the receive buffer holds 2 x"):
        engine.staged("recv", np.zeros(2), 0, 9)
    with pytest.raises(ValueError, match="send: dst=0 is this rank: a blocking send to itself"):
        engine.staged("send", np.arange(3.0), 0, 9)
    assert engine.trace_p2p_seq() == seq


SCRIPT = r"""
import sys, numpy as np, torch, collectives as coll
sys.path.insert(0, {here!r})
from test_cuda_unit import FakeTorch
from collectives._backends import cuda
from collectives._comm import engine_of

comm = coll.init()
rank, size = comm.rank, comm.size
fake = FakeTorch()
for Transport in (cuda.HostStagingTransport, cuda.CudaAwareMPITransport):
    t = Transport(engine_of(comm), 0)
    t._library_of = lambda x: fake
    tri = size * (size + 1) / 2
    base = torch.full((4, 6), float(rank + 1))
    view = base[:, ::2]
    assert t.allreduce(view, None, "sum") is view
    assert (base[:, ::2] == tri).all() and (base[:, 1::2] == rank + 1).all(), (Transport.name, base)
    b = torch.full((5,), rank + 1.0, dtype=torch.bfloat16)
    t.allreduce(b, None, "mean")
    assert (b.float() == tri / size).all(), (Transport.name, b)
    h = torch.full((3,), rank + 1.0, dtype=torch.float16)
    t.allreduce(h, None, "max")
    assert (h == size).all()
    z = torch.full((2,), 1 + 1j, dtype=torch.complex64)
    t.allreduce(z, None, "prod")
    assert torch.allclose(z, torch.full((2,), (1 + 1j) ** size, dtype=torch.complex64))
    flags = torch.tensor([rank == 0, True])
    t.allreduce(flags, None, "min")
    assert flags.tolist() == [size == 1, True]
    s = torch.arange(6, dtype=torch.int16).reshape(2, 3) + 10 * rank
    t.broadcast(s.t(), None, size - 1)
    assert (s == torch.arange(6, dtype=torch.int16).reshape(2, 3) + 10 * (size - 1)).all(), (Transport.name, s)
    r = torch.full((3,), rank + 1, dtype=torch.int64)
    t.reduce(r, None, "sum", 0)
    assert (r == (tri if rank == 0 else rank + 1)).all()
    g = t.allgather(torch.full((2, 2), rank, dtype=torch.int32)[:, 0], None)
    assert g.shape == (size, 2) and g[:, 0].tolist() == list(range(size)), g
    e = torch.zeros(0)
    assert t.allreduce(e, None, "sum") is e and t.allgather(e, None).shape == (size, 0)
assert fake.syncs > 0  # the CUDA-aware path waits for the stream before handing pointers to MPI
import os as _os; _os.write(1, ("ok %d %d\n" % (rank, size)).encode())  # one write: ranks share the pipe
"""



@needs_torch
@pytest.mark.parametrize("n", [3])
def test_staging_and_cuda_aware_paths_under_mpiexec(n):
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("mpiexec not found")
    cmd = job_command(n, [sys.executable, "-c", SCRIPT.format(here=str(Path(__file__).parent))], mpiexec=mpiexec)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=job_environment(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(proc.stdout.split("\n")[:-1]) == [f"ok {r} {n}" for r in range(n)], proc.stdout


@needs_torch
def test_make_transport_builds_nccl_with_the_exchanged_settings(fake_gpu, monkeypatch):
    lib = FakeNCCL(nranks=1)
    monkeypatch.setattr(_libnccl, "get", lambda path=None: lib)
    monkeypatch.setenv("COLLECTIVES_TIMEOUT", "7")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NCCL: no staging warning
        t = factory.device_transport(engine_of(coll.Communicator(SelfTransport())), (2, 1))
    assert t.name == "nccl" and t.device_index == 1 and t._timeout == 7.0
    assert lib.calls[0] == ("init", 1, 128, 0) and lib.config.blocking == 0
    t.close()


# ---------------------------------------------------------------------------------------------------------
# COLLECTIVES_NCCL_EAGER: the device transport at init, agreed first

class VotingHost(FakeHost):
    """A host whose allgather hands back the given ranks' answers (this process is rank 0)."""

    def __init__(self, others):
        super().__init__(size=1 + len(others))
        self.others = others

    def allgather_object(self, obj):
        self.objects.append(("allgather_object", obj))
        return [obj] + list(self.others)


@needs_torch
def test_eager_sets_up_the_local_device_at_init(fake_gpu, monkeypatch):
    lib = FakeNCCL(nranks=1)
    monkeypatch.setattr(_libnccl, "get", lambda path=None: lib)
    comm = coll.Communicator(SelfTransport())
    cuda.initialize_eagerly(engine_of(comm))
    assert comm._devices == {}  # not asked for: nothing made
    monkeypatch.setenv("COLLECTIVES_NCCL_EAGER", "1")
    cuda.initialize_eagerly(engine_of(comm))
    assert cuda.device_transports(engine_of(comm)) == {"cuda:0": "nccl"} and lib.calls[0][0] == "init"
    comm.close()


@needs_torch
def test_eager_refuses_ranks_that_disagree_or_have_no_cuda_library(fake_gpu, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_NCCL_EAGER", "1")
    comm = coll.Communicator(SelfTransport())
    comm._host = VotingHost([(True, True), (False, True)])
    with pytest.raises(coll.MismatchError, match=r"ranks 0,1 have COLLECTIVES_NCCL_EAGER=1, rank 2 has it off"):
        cuda.initialize_eagerly(engine_of(comm))
    comm._host = VotingHost([(True, False), (True, True)])
    with pytest.raises(coll.BackendUnavailableError, match=r"rank 1 imported neither torch nor CuPy"):
        cuda.initialize_eagerly(engine_of(comm))
    assert comm._devices == {}


def test_eager_without_any_cuda_library_is_refused_on_one_process(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_NCCL_EAGER", "1")
    for name in ("torch", "cupy"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(coll.BackendUnavailableError, match="COLLECTIVES_NCCL_EAGER=1"):
        cuda.initialize_eagerly(engine_of(coll.Communicator(SelfTransport())))


# ---- the asynchronous device contract (issue 14), with a stand-in that logs streams and events ----
# (private: without a GPU there is no public way to reach a device transport's start())

class StreamLog(FakeTorch):
    """FakeTorch whose streams are names and whose events are logged, so the order can be asserted."""

    def __init__(self):
        super().__init__()
        self.log, self.current = [], "caller"

    def current_stream(self, x):
        return self.current

    def new_stream(self, x):
        self.log.append(("new", "side"))
        return "side"

    @contextlib.contextmanager
    def on_stream(self, x, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def stream(self, x):
        return {"caller": 0xCA11, "side": 0x51DE}[self.current]

    def event_on(self, stream):
        self.log.append(("record", stream))
        return {"on": stream, "done": False}

    def wait_event(self, stream, event):
        self.log.append(("wait", stream, event["on"]))

    def event_done(self, event):
        return event["done"]

    def keep_for(self, x, stream):
        self.log.append(("keep", stream))


def test_nccl_async_runs_on_its_own_stream_after_the_callers():
    t, lib = nccl_transport()
    api = StreamLog()
    t._library_of = lambda x: api
    x = torch.ones(4)
    result, request = t.start("allreduce", x, None, "sum")
    assert result is x and (x == 3).all()
    assert lib.calls[-1][0] == "all_reduce" and lib.calls[-1][-1] == 0x51DE  # enqueued on the own stream
    assert api.log == [("new", "side"), ("record", "caller"), ("wait", "side", "caller"), ("keep", "side"),
                       ("record", "side")]
    assert request.test() is False  # the event is not reached: done() is False, and never blocks
    request.wait()
    assert api.log[-1] == ("wait", "caller", "side")  # the caller's stream waits; the host does not
    # a blocking call while it is still running is ordered after it, on the caller's stream
    before = len(api.log)
    t.allreduce(torch.ones(2), None, "sum")
    assert api.log[before:] == [("wait", "caller", "side")] and lib.calls[-1][-1] == 0xCA11
    t._last_event["done"] = True
    before = len(api.log)
    t.allreduce(torch.ones(2), None, "sum")
    assert len(api.log) == before and t._last_event is None  # complete: no wait any more
    t.start("reduce_scatter", torch.ones(6), None, "sum")
    assert ("new", "side") not in api.log[before:]  # one stream per library, reused
    assert lib.calls[-1][0] == "reduce_scatter" and lib.calls[-1][-1] == 0x51DE


def test_async_validation_errors_are_raised_at_the_call_and_nothing_is_enqueued():
    t, lib = nccl_transport()
    api = StreamLog()
    t._library_of = lambda x: api
    n = len(lib.calls)
    with pytest.raises(TypeError, match="mean"):
        t.start("allreduce", torch.ones(3, dtype=torch.int32), None, "mean")
    assert len(lib.calls) == n

"""GPU tests, run under mpiexec exactly like tests/mpi (whose hooks this reuses)::

    mpiexec -n 2 python tests/mpi_pytest.py tests/gpu -q

Where no GPU is usable every test is skipped, saying why; with ``COLLECTIVES_TEST_REQUIRE_GPU=1`` (GPU
CI, ``scripts/gpu_check.sh``) they fail instead. Each rank uses device ``local_rank % device_count``; the
``dev`` fixture runs a test once per CUDA array library (torch, CuPy): a library that is not installed
is skipped, one that is installed but cannot reach the GPU fails under ``COLLECTIVES_TEST_REQUIRE_GPU=1``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("_collectives_mpi_conftest",
                                               Path(__file__).resolve().parents[1] / "mpi" / "conftest.py")
_mpi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mpi)

# the tests/mpi hooks: one report on rank 0, a failing rank aborts the job, per-rank summaries
pytest_configure = _mpi.pytest_configure
pytest_collection_modifyitems = _mpi.pytest_collection_modifyitems
pytest_runtest_logreport = _mpi.pytest_runtest_logreport
pytest_sessionfinish = _mpi.pytest_sessionfinish
comm = _mpi.comm

REQUIRE = os.environ.get("COLLECTIVES_TEST_REQUIRE_GPU", "").strip().lower() not in ("", "0", "false", "no")
LIBRARIES = ("torch", "cupy")
_state: dict = {}


def library_state(name: str):
    """``(module, None)`` when ``name`` can reach a GPU, else ``(None, reason)``; ``installed`` separately."""
    if name in _state:
        return _state[name]
    if importlib.util.find_spec(name) is None:
        result = (None, f"{name} is not installed", False)
    else:
        try:
            module = importlib.import_module(name)
            if name == "torch":
                n = module.cuda.device_count() if module.cuda.is_available() else 0
                why = "torch.cuda.is_available() is False" + ("" if module.version.cuda else " (CPU-only build)")
            else:
                n = module.cuda.runtime.getDeviceCount()
                why = "CuPy sees no GPU"
            result = (module, None, True) if n > 0 else (None, why, True)
        except Exception as exc:  # noqa: BLE001 - a reason to report
            result = (None, f"{name} cannot reach a GPU: {type(exc).__name__}: {exc}", True)
    _state[name] = result
    return result


def no_gpu_reason() -> str | None:
    reasons = []
    for name in LIBRARIES:
        module, why, _ = library_state(name)
        if module is not None:
            return None
        reasons.append(why)
    return "no GPU usable from torch or CuPy: " + "; ".join(reasons)


@pytest.fixture(autouse=True)
def _gpu_gate():
    reason = no_gpu_reason()
    if reason is not None:
        if REQUIRE:
            pytest.fail(f"COLLECTIVES_TEST_REQUIRE_GPU=1, but {reason}", pytrace=False)
        pytest.skip(reason)


class Dev:
    """One array library on this rank's GPU: make arrays from NumPy, read them back."""

    def __init__(self, name: str, module, index: int):
        self.name, self.xp, self.index = name, module, index

    def has(self, dtype: str) -> bool:
        if self.name == "torch":
            return dtype not in ("uint16", "uint32", "uint64")  # partial support in torch
        return dtype != "bfloat16"

    def make(self, values: np.ndarray, dtype: str):
        if self.name == "torch":
            torch = self.xp
            if dtype == "bfloat16":
                return torch.from_numpy(np.asarray(values, dtype=np.float32)).to(torch.bfloat16).cuda(self.index)
            return torch.from_numpy(np.array(values, dtype=dtype, order="C")).cuda(self.index)
        with self.xp.cuda.Device(self.index):
            return self.xp.asarray(np.array(values, dtype=dtype))

    def to_numpy(self, x) -> np.ndarray:
        if self.name == "torch":
            t = x.detach().resolve_conj().resolve_neg().cpu()
            return (t.float() if t.dtype == self.xp.bfloat16 else t).numpy()
        return self.xp.asnumpy(x)

    def ptr(self, x) -> int:
        return x.data_ptr() if self.name == "torch" else x.data.ptr

    def device_of(self, x) -> int:
        return x.device.index if self.name == "torch" else x.device.id

    def is_array(self, x) -> bool:
        return isinstance(x, self.xp.Tensor if self.name == "torch" else self.xp.ndarray)

    def synchronize(self) -> None:
        if self.name == "torch":
            self.xp.cuda.synchronize(self.index)
        else:
            self.xp.cuda.Device(self.index).synchronize()


@pytest.fixture(params=LIBRARIES)
def dev(request, comm):
    module, why, installed = library_state(request.param)
    if module is None:
        if REQUIRE and installed and no_gpu_reason() is None:
            pytest.fail(f"COLLECTIVES_TEST_REQUIRE_GPU=1, but {why}", pytrace=False)
        pytest.skip(why)
    if request.param == "torch":
        index = comm.local_rank % module.cuda.device_count()
        module.cuda.set_device(index)
    else:
        index = comm.local_rank % module.cuda.runtime.getDeviceCount()
        module.cuda.Device(index).use()
    return Dev(request.param, module, index)

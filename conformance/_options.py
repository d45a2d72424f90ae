"""Every choice made from outside the suite, read in one place.

=====================================  =================================================================
environment variable                   meaning (the pytest option of the same name wins)
=====================================  =================================================================
``COLLECTIVES_CONFORMANCE_LIBS``       array libraries: ``numpy,torch,strict,jax,cupy,torch-cuda``, and
                                       ``xp:<module>`` for any array-API library in host memory
                                       (default: the host libraries that are installed, or for the
                                       ``nccl``/``host-staging`` backends the CUDA ones)
``COLLECTIVES_CONFORMANCE_BACKEND``    ``auto`` (default), ``mpi``, ``self``, ``nccl``, ``host-staging``,
                                       ``cuda-aware-mpi``
``COLLECTIVES_CONFORMANCE_SUT``        module exposing the same names as ``collectives``
                                       (default ``conformance.sut``)
``COLLECTIVES_CONFORMANCE_FULL``       ``1``: the whole matrix; default: a deterministic sample of it
``COLLECTIVES_CONFORMANCE_SEED``       which sample (an integer, default 0); rotate it in CI
``COLLECTIVES_CONFORMANCE_REQUIRE``    ``1``: a requested library or backend that is missing fails
                                       instead of skipping (for GPU CI)
``COLLECTIVES_CONFORMANCE_RESULTS``    path of a JSON-lines file rank 0 appends every outcome to
``COLLECTIVES_CONFORMANCE_XFAIL_DIR``  directory of expected-failure files (default ``conformance/xfail``)
=====================================  =================================================================
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

HOST_LIBS = ("numpy", "torch", "strict", "jax")
CUDA_LIBS = ("cupy", "torch-cuda")
ALL_LIBS = HOST_LIBS + CUDA_LIBS
LIB_ALIASES = {"np": "numpy", "array-api-strict": "strict", "array_api_strict": "strict",
               "torch-cpu": "torch", "torch_cuda": "torch-cuda"}

# backend name -> (init backend, the device kind its arrays live on, environment it needs)
BACKENDS = {
    "auto": ("auto", "host", {}),
    "mpi": ("mpi", "host", {}),
    "self": ("self", "host", {}),
    # MPI with every 2 ranks of a node acting as one node, and every allreduce from 1 byte through the
    # node-shared-memory path: the hierarchical reduction (node, node leaders, node) and synchronize's
    # bucket path under the whole suite, on one machine
    "mpi-nodes": ("mpi", "host", {"COLLECTIVES_SIMULATE_NODES": "2", "COLLECTIVES_SHM_THRESHOLD": "1"}),
    "nccl": ("auto", "cuda", {}),
    "host-staging": ("auto", "cuda", {"COLLECTIVES_DISABLE_NCCL": "1", "COLLECTIVES_CUDA_AWARE_MPI": "0"}),
    "cuda-aware-mpi": ("auto", "cuda", {"COLLECTIVES_DISABLE_NCCL": "1", "COLLECTIVES_CUDA_AWARE_MPI": "1"}),
}

_TRUE = {"1", "true", "yes", "on"}


@dataclass
class Options:
    libs: list[str]
    backend: str
    sut: str = "conformance.sut"
    full: bool = False
    seed: int = 0
    require: bool = False
    results: str | None = None
    xfail_dir: Path = field(default_factory=lambda: HERE / "xfail")
    libs_explicit: bool = False

    @property
    def init_backend(self) -> str:
        return BACKENDS[self.backend][0]

    @property
    def device_kind(self) -> str:
        return BACKENDS[self.backend][1]

    @property
    def backend_env(self) -> dict:
        return BACKENDS[self.backend][2]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def default_libs(device_kind: str) -> list[str]:
    if device_kind == "cuda":
        return list(CUDA_LIBS)
    module = {"numpy": "numpy", "torch": "torch", "strict": "array_api_strict", "jax": "jax"}
    return [lib for lib in HOST_LIBS if _installed(module[lib])]


def parse_libs(raw: str) -> list[str]:
    libs = []
    for part in raw.split(","):
        name = part.strip().lower()
        if not name:
            continue
        name = LIB_ALIASES.get(name, name)
        if name.startswith("xp:") and len(name) > 3:
            name = "xp:" + part.strip()[3:]  # a module name keeps its case
        elif name not in ALL_LIBS:
            raise ValueError(f"COLLECTIVES_CONFORMANCE_LIBS: unknown array library {part.strip()!r}; "
                             f"expected some of {', '.join(ALL_LIBS)}")
        if name not in libs:
            libs.append(name)
    return libs


def _flag(name: str, raw: str | None) -> bool:
    if raw is None or raw.strip() == "":
        return False
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off")


def read(overrides: dict | None = None) -> Options:
    """Options from the environment, with ``overrides`` (pytest options; None = not given) on top."""
    o = {k: v for k, v in (overrides or {}).items() if v is not None}
    env = os.environ

    backend = str(o.get("backend", env.get("COLLECTIVES_CONFORMANCE_BACKEND", "")) or "auto").strip().lower()
    if backend not in BACKENDS:
        raise ValueError(f"COLLECTIVES_CONFORMANCE_BACKEND={backend!r}: expected one of {', '.join(BACKENDS)}")
    raw_libs = o.get("libs", env.get("COLLECTIVES_CONFORMANCE_LIBS", ""))
    libs = parse_libs(raw_libs) if raw_libs and raw_libs.strip() else default_libs(BACKENDS[backend][1])
    raw_seed = str(o.get("seed", env.get("COLLECTIVES_CONFORMANCE_SEED", "")) or "0")
    try:
        seed = int(raw_seed)
    except ValueError:
        raise ValueError(f"COLLECTIVES_CONFORMANCE_SEED={raw_seed!r}: expected an integer") from None
    full = o["full"] if "full" in o else _flag("COLLECTIVES_CONFORMANCE_FULL", env.get("COLLECTIVES_CONFORMANCE_FULL"))
    require = o["require"] if "require" in o else _flag(
        "COLLECTIVES_CONFORMANCE_REQUIRE", env.get("COLLECTIVES_CONFORMANCE_REQUIRE"))
    xfail_dir = Path(o.get("xfail_dir", env.get("COLLECTIVES_CONFORMANCE_XFAIL_DIR", "")) or HERE / "xfail")
    return Options(
        libs=libs,
        backend=backend,
        sut=str(o.get("sut", env.get("COLLECTIVES_CONFORMANCE_SUT", "")) or "conformance.sut").strip(),
        full=bool(full),
        seed=seed,
        require=bool(require),
        results=o.get("results", env.get("COLLECTIVES_CONFORMANCE_RESULTS")) or None,
        xfail_dir=xfail_dir,
        libs_explicit=bool(raw_libs and raw_libs.strip()),
    )


# Set by conftest.pytest_configure before any test module is imported; test modules read it to build
# their parameter matrices.
current: Options | None = None


def get() -> Options:
    global current
    if current is None:
        current = read()
    return current

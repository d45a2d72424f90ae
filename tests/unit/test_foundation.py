"""Single-process checks of the foundation: imports, backend choice, self backend, info, dtype rules."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import collectives as coll
from collectives import _dtypes
from collectives._launcher import find_mpiexec, job_command, job_environment, kind

HEAVY = ("torch", "cupy", "jax", "mpi4py", "mpi4py.MPI", "array_api_strict", "ml_dtypes")


def run_python(code: str, env_extra=None, path_prefix=None, timeout=120):
    env = job_environment()  # a fresh process, not a rank of this job (collectives._launcher)
    env.pop("COLLECTIVES_BACKEND", None)
    if path_prefix:
        env["PYTHONPATH"] = os.pathsep.join([str(path_prefix), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_import_pulls_in_no_heavy_library():
    proc = run_python(f"""
        import sys, collectives
        heavy = [m for m in {HEAVY!r} if m in sys.modules]
        assert not heavy, heavy
        print("clean")
    """)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr


def test_self_backend_needs_no_mpi(tmp_path):
    (tmp_path / "mpi4py").mkdir()
    (tmp_path / "mpi4py" / "__init__.py").write_text("raise ImportError('mpi4py is not installed (test)')\n")
    proc = run_python("""
        import sys, numpy as np, collectives as coll
        c = coll.init()
        x = np.array([1.0, 3.0])
        assert coll.allreduce(x, op="mean") is x and x.tolist() == [1.0, 3.0]
        assert coll.allgather(x).shape == (1, 2)
        print(c.backend, c.size, "mpi4py.MPI" in sys.modules)
    """, path_prefix=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["self", "1", "False"]


@pytest.mark.parametrize("variable", ["PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"])
def test_launcher_without_mpi_is_refused(tmp_path, variable):
    (tmp_path / "mpi4py").mkdir()
    (tmp_path / "mpi4py" / "__init__.py").write_text("raise ImportError('mpi4py is not installed (test)')\n")
    proc = run_python("""
        import collectives as coll
        try:
            coll.init()
        except coll.BackendUnavailableError as e:
            print("refused:", e)
        else:
            print("ran alone")
    """, env_extra={variable: "4"}, path_prefix=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("refused:"), proc.stdout
    assert f"{variable}=4" in proc.stdout and "mpi4py is not installed" in proc.stdout


def test_launcher_with_foreign_mpi_is_refused():
    """Open MPI's launcher said 4 processes, but mpi4py's MPI (MPICH here) sees a world of 1."""
    proc = run_python("""
        import collectives as coll
        try:
            coll.init()
        except coll.BackendUnavailableError as e:
            print("refused:", e)
    """, env_extra={"OMPI_COMM_WORLD_SIZE": "4"})
    assert "refused:" in proc.stdout and "not the launcher's" in proc.stdout, proc.stdout + proc.stderr


def test_explicit_mpi_backend_without_mpi_fails(tmp_path):
    (tmp_path / "mpi4py").mkdir()
    (tmp_path / "mpi4py" / "__init__.py").write_text("raise ImportError('no mpi4py')\n")
    proc = run_python("""
        import collectives as coll
        try:
            coll.init("mpi")
        except coll.BackendUnavailableError as e:
            print("refused:", e)
    """, path_prefix=tmp_path)
    assert "refused: MPI is not usable: no mpi4py" in proc.stdout, proc.stdout + proc.stderr


def test_init_arguments_and_idempotence():
    proc = run_python("""
        import collectives as coll
        c = coll.init("self", check=False)
        assert coll.init() is c and coll.init("self") is c and coll.world() is c
        assert coll.init(check=True) is c and c.check
        try:
            coll.init("mpi")
        except ValueError as e:
            assert "already initialised with backend 'self'" in str(e)
        else:
            raise AssertionError("no error")
        try:
            coll.init("tcp")
        except ValueError as e:
            assert "unknown backend='tcp'" in str(e)
        coll.finalize()
        assert c.closed
        d = coll.init()
        assert d is not c and d.backend == "mpi"
        print("ok", repr(c), repr(d))
    """)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr


def test_environment_backend_choice():
    proc = run_python("import collectives as coll; print(coll.init().backend)",
                      env_extra={"COLLECTIVES_BACKEND": "self"})
    assert proc.stdout.strip() == "self", proc.stderr
    proc = run_python("import collectives as coll; coll.init()", env_extra={"COLLECTIVES_BACKEND": "nope"})
    assert proc.returncode != 0 and "COLLECTIVES_BACKEND='nope'" in proc.stderr


def test_cuda_like_array_is_refused_clearly():
    class FakeCuda:
        dtype = np.dtype(np.float32)

        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, **kw):
            raise AssertionError("must not be touched")

    with pytest.raises(coll.BackendUnavailableError, match="cuda:0"):
        coll.allreduce(FakeCuda(), comm=coll.init())


def test_info_command_text_and_json():
    proc = subprocess.run([sys.executable, "-m", "collectives", "info", "--json"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["collectives"] == coll.__version__
    # the copy that runs: imported from this package's directory; where the distribution is installed (a
    # wheel, or an editable install of this checkout), its metadata's version is the package's
    assert info["imported_from"] == os.path.dirname(os.path.abspath(coll.__file__))
    assert info["distribution"] in (f"collectives-py {coll.__version__}", "collectives-py not installed")
    assert "numpy" in info["array_libraries"]
    assert info["mpi"]["mpi4py"]  # whichever MPI mpi4py loads (MPICH, Open MPI, ...): named, with its version
    assert info["mpi"]["implementation"] in info["mpi"]["library"] and "\0" not in info["mpi"]["library"]
    assert info["mpi"]["implementation"] in ("MPICH", "Open MPI", "Intel MPI", "MVAPICH")
    assert info["launcher"]["started_by"] is None  # a plain python
    if info["launcher"]["mpiexec"]:
        assert info["launcher"]["mpiexec_kind"] in ("Hydra", "PRRTE", "Slurm")
    assert info["rank"] == 0 and info["size"] == 1
    assert "nccl" in info
    text = subprocess.run([sys.executable, "-m", "collectives", "info"], capture_output=True, text=True,
                          timeout=120)
    assert text.returncode == 0 and "mpi4py" in text.stdout and "nccl" in text.stdout
    assert "implementation" in text.stdout and "started_by" in text.stdout


def test_info_says_what_is_available_one_line_each_and_the_nccl_fix_only_when_asked(tmp_path):
    from collectives.__main__ import gpu_present

    not_a_library = tmp_path / "libnccl.so.2"
    not_a_library.write_text("not a shared library")  # NCCL found but unloadable: the loader's To fix text
    env = {**os.environ, "COLLECTIVES_NCCL_LIBRARY": str(not_a_library)}
    env.pop("COLLECTIVES_DISABLE_NCCL", None)

    def info(*flags):
        proc = subprocess.run([sys.executable, "-m", "collectives", "info", *flags], capture_output=True,
                              text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    text = info()
    summary = text.split("\n")[:7]
    assert summary[0] == "available:"
    for name in ("MPI", "torch.distributed", "GPU", "NCCL", "array libraries"):
        line = next(x for x in summary if x.startswith(f"  {name} "))
        assert line.split(None, len(name.split()))[-1].startswith(("yes", "no", "numpy")), line
    assert next(x for x in summary if x.startswith("  NCCL ")).split()[1] == "no:"
    if not gpu_present():  # no GPU, not asked: NCCL's absence is one line, no "To fix" block
        assert "To fix" not in text and "Tried" not in text, text
    gpu = info("--gpu")
    assert "To fix" in gpu and "nvidia-nccl-cu12" in gpu
    as_json = json.loads(info("--gpu", "--json"))
    assert as_json["available"]["NCCL"].startswith("no:") and "To fix" in as_json["nccl"]["fix"]


def test_info_names_the_launcher_that_started_the_job():
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec")
    proc = subprocess.run(job_command(2, [sys.executable, "-m", "collectives", "info", "--json"]),
                          capture_output=True, text=True, timeout=120, env=job_environment())
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)  # rank 0 only prints
    assert info["size"] == 2 and info["backend"] == "mpi"
    assert info["launcher"]["started_by"] == kind(mpiexec) == info["launcher"]["mpiexec_kind"]


# ---- the dtype table ----

@pytest.mark.parametrize("dtype,op,ok", [
    ("bool", "max", True), ("bool", "min", True), ("bool", "sum", False), ("bool", "mean", False),
    ("int32", "mean", False), ("uint8", "prod", True), ("float16", "mean", True),
    ("complex64", "max", False), ("complex128", "mean", True), ("int64", "min", True),
])
def test_reduction_legality(dtype, op, ok):
    info = _dtypes.from_numpy(np.dtype(dtype))
    if ok:
        _dtypes.check_reduction(info, op)
    else:
        with pytest.raises(TypeError):
            _dtypes.check_reduction(info, op)


def test_opaque_and_object_dtypes():
    assert _dtypes.from_numpy(np.dtype("U3")).kind == "x"
    assert _dtypes.from_numpy(np.dtype([("a", "i4")])).kind == "x"
    with pytest.raises(TypeError, match="object arrays"):
        _dtypes.from_numpy(np.dtype(object))


def test_bfloat16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    values = np.array([1.0, 1 / 3, -2.5e-3, 3.0e38, np.inf, -np.inf, 1.00390625, 1.01171875,
                       np.nan, 0.0, -0.0, 1e-40], dtype=np.float32)
    out = np.empty(values.shape, np.uint16)
    _dtypes.f32_to_bf16(values, out)
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    same = (out == want) | (np.isnan(values))
    assert same.all(), (out, want)
    assert np.isnan(_dtypes.bf16_to_f32(out)[np.isnan(values)]).all()
    np.testing.assert_array_equal(_dtypes.bf16_to_f32(want)[~np.isnan(values)],
                                  torch.from_numpy(values).to(torch.bfloat16).float().numpy()[~np.isnan(values)])


def test_every_public_name_has_a_docstring_with_an_example():
    for name in coll.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(coll, name)
        doc = obj.__doc__ or ""
        assert ">>>" in doc, f"collectives.{name} needs a docstring with an example"


def test_open_mpi_osc_ucx_noise_is_dropped_and_nothing_else(capfd):
    """Open MPI 5.0 prints a bogus osc/ucx error at every window creation (open-mpi/ompi#14086); the
    shared-memory reducer drops exactly that line (and its trailing blank line) around its window."""
    import os

    from collectives._backends import shm  # private: the filter is what the window creation runs in

    class FakeOpenMPI:
        @staticmethod
        def Get_library_version():
            return "Open MPI v5.0.11, package: Open MPI"

    noise = f"[vm:1] /openmpi-5.0.11/ompi/mca/osc/ucx/osc_ucx_component.c:375  Error: {shm.OSC_UCX_NOISE} \n \n"
    with shm._without_osc_ucx_noise(FakeOpenMPI):
        os.write(2, noise.encode())
        os.write(2, b"a real error\n")
        os.write(2, noise.encode())
    err = capfd.readouterr().err
    assert err == "a real error\n"

    class FakeMPICH:
        @staticmethod
        def Get_library_version():
            return "MPICH Version: 5.0.2"

    with shm._without_osc_ucx_noise(FakeMPICH):  # another MPI: untouched
        os.write(2, noise.encode())
    assert capfd.readouterr().err == noise


def test_info_into_a_closed_pipe_ends_without_a_traceback():
    """``python -m collectives info | head`` (issue 38): the reader gone, no BrokenPipeError traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "collectives", "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves before anything is written
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_the_distribution_name_is_pyprojects():
    """``info`` names the distribution pyproject.toml builds (the import name stays ``collectives``)."""
    from collectives._version import DISTRIBUTION  # private: the one place the name is kept for info

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("no pyproject.toml beside the tests")
    assert re.search(r'^name = "([^"]+)"$', pyproject.read_text(), re.M).group(1) == DISTRIBUTION


def test_every_module_of_a_front_ends_package_is_that_front_end():
    """The flight recorder names the front end a call came through (its record's path) by the modules of
    the frames it passes: every module of a package that is a front end (the torch backend's,
    DistributedOptimizer's) is that front end, and a module of no front end is none."""
    from collectives._records import _front_end

    assert _front_end("collectives.torch_backend") == "torch.distributed backend"
    assert _front_end("collectives.torch_backend.group") == "torch.distributed backend"
    assert _front_end("collectives._optim.torch_optimizer") == "DistributedOptimizer"
    assert _front_end("collectives._overlap") == "DistributedOptimizer gradient bucket"
    assert _front_end("collectives._comm.communicator") is None and _front_end("__main__") is None

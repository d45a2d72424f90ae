"""The conformance suite catches a broken implementation, and passes the real one.

Each test writes a small system-under-test module into a temporary directory: ``collectives`` itself, or
``collectives`` with a bug injected. It runs the conformance suite against it in a subprocess (plain
``python`` for size 1, ``mpiexec -n 2`` otherwise), under a timeout, through ``COLLECTIVES_CONFORMANCE_SUT``
(the way a framework that wraps ``collectives`` runs the suite), and checks that the run fails and names
the right tests, or passes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from collectives._launcher import find_mpiexec, job_command, job_environment  # any launcher

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 420

HEADER = """\
import collectives as _c
from collectives import *  # noqa: F401,F403  (every public name, as a wrapping framework would)
"""

GOOD = HEADER

# Two bugs only visible with more than one rank.
BROKEN_AT_TWO = HEADER + """
def broadcast(x, root=0, *, comm=None):
    return _c.broadcast(x, root=0, comm=comm)          # BUG: ignores root


def allreduce(x, op="sum", *, comm=None):
    if op == "mean":
        return _c.allreduce(x, op="sum", comm=comm)    # BUG: forgets to divide by the size
    return _c.allreduce(x, op=op, comm=comm)
"""

# At size 1, "forgetting to divide" is invisible (x / 1 == x). This size-1 shortcut for mean is not: it
# skips validation (an integer mean must raise TypeError) and returns x itself even for arrays that cannot
# be written (array-api-strict must get a new array).
BROKEN_AT_ONE = HEADER + """
def allreduce(x, op="sum", *, comm=None):
    if op == "mean" and _c.world().size == 1:
        return x                                       # BUG: size-1 shortcut
    return _c.allreduce(x, op=op, comm=comm)
"""


# A reduce_scatter that returns the next rank's block, and an alltoall that sends block i to rank i but
# puts what it receives from rank i at the wrong place (the blocks of the whole job transposed wrongly).
BROKEN_BLOCKS = HEADER + """
import numpy as _np


def reduce_scatter(x, op="sum", *, comm=None):
    c = _c.world()
    full = _np.asarray(_c.allreduce(_np.array(x, copy=True), op=op))
    n = full.shape[0] // c.size
    r = (c.rank + 1) % c.size                          # BUG: the next rank's block
    return full[r * n:(r + 1) * n].copy()


def alltoall(x, *, comm=None):
    y = _np.asarray(_c.alltoall(x))
    n = y.shape[0] // _c.world().size
    return _np.concatenate([y[n:], y[:n]])             # BUG: block i holds rank i+1's block
"""



def _run(tmp_path: Path, source: str, ranks: int, select: str, *extra: str, libs: str = "numpy") -> tuple[int, str]:
    sut = tmp_path / "sut_under_test.py"
    sut.write_text(textwrap.dedent(source))
    (tmp_path / "xfail").mkdir(exist_ok=True)  # no expected failures: the outcome is the suite's alone
    env = job_environment(drop=("COLLECTIVES_",))
    env.update({
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "COLLECTIVES_CONFORMANCE_SUT": "sut_under_test",
        "COLLECTIVES_CONFORMANCE_LIBS": libs,
        "COLLECTIVES_CONFORMANCE_XFAIL_DIR": str(tmp_path / "xfail"),
        "COLLECTIVES_TEST_LOGS": str(tmp_path / "logs"),
    })
    # --color=no: PRRTE (Open MPI) gives each rank a terminal, and pytest would colour the lines parsed here
    cmd = [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--color=no", "--timeout", "120",
           "-k", select, *extra]
    if ranks > 1:
        launcher = find_mpiexec()
        if launcher is None:
            pytest.skip("no mpiexec: the multi-rank part of the self-test needs one")
        cmd = job_command(ranks, cmd, mpiexec=launcher)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the conformance run did not finish in {TIMEOUT}s:\n{exc.stdout}")
    return proc.returncode, proc.stdout


def _failed(output: str) -> set[str]:
    return set(re.findall(r"^FAILED \S+::(\S+)", output, flags=re.MULTILINE))


def _need_mpi():
    pytest.importorskip("mpi4py", reason="the multi-rank part of the self-test needs mpi4py")


def test_unbroken_sut_passes_at_size_1(tmp_path):
    rc, out = _run(tmp_path, GOOD, 1, "(test_allreduce and float64) or (test_illegal_dtype_op and int32)",
                   libs="numpy,strict")
    assert rc == 0, out[-4000:]
    assert re.search(r"\d+ passed", out) and "failed" not in out.splitlines()[-1], out[-2000:]


def test_unbroken_sut_passes_at_size_2(tmp_path):
    _need_mpi()
    rc, out = _run(tmp_path, GOOD, 2, "(test_broadcast or test_allreduce) and numpy and (float64 or int8)")
    assert rc == 0, out[-4000:]
    assert re.search(r"\d+ passed", out), out[-2000:]


def test_broadcast_ignoring_root_and_mean_without_division_are_caught(tmp_path):
    _need_mpi()
    rc, out = _run(tmp_path, BROKEN_AT_TWO, 2, "(test_broadcast or test_allreduce) and numpy and (float64 or int8)")
    assert rc != 0, "the suite passed an implementation whose broadcast ignores root:\n" + out[-4000:]
    failed = _failed(out)
    assert "test_broadcast[numpy-float64-nd-odd]" in failed, (failed, out[-4000:])
    assert "test_broadcast[numpy-int8-nd-odd]" in failed, failed
    assert "test_allreduce[numpy-float64-mean-nd-odd]" in failed, failed
    assert "root=1" in out, "the failure names the root that went wrong"
    assert not any("-sum-" in name or "-max-" in name for name in failed), f"only the broken calls fail: {failed}"


def test_wrong_reduce_scatter_block_and_wrong_alltoall_are_caught(tmp_path):
    _need_mpi()
    rc, out = _run(tmp_path, BROKEN_BLOCKS, 2, "(test_reduce_scatter or test_alltoall) and numpy and (float64 or int32)")
    assert rc != 0, "the suite passed a reduce_scatter returning the wrong block:\n" + out[-4000:]
    failed = _failed(out)
    assert "test_reduce_scatter[numpy-float64-sum]" in failed, (failed, out[-4000:])
    assert "test_alltoall[numpy-int32]" in failed, failed
    assert "it is block 1" in out or "it is block 0" in out, "the failure names the block it got"
    assert "it is rank" in out, "the failure names whose block it got"


def test_size_1_mean_shortcut_is_caught(tmp_path):
    rc, out = _run(tmp_path, BROKEN_AT_ONE, 1, "mean and (test_allreduce or test_illegal_dtype_op)",
                   "--conformance-full", libs="numpy,strict")
    assert rc != 0, "the suite passed an implementation whose mean skips validation at size 1:\n" + out[-4000:]
    failed = _failed(out)
    assert "test_illegal_dtype_op[numpy-allreduce-int32-mean]" in failed, (failed, out[-4000:])
    assert "test_allreduce[strict-float64-mean-nd-odd]" in failed, failed
    assert "test_illegal_dtype_op[numpy-reduce-int32-mean]" not in failed, "reduce was not broken"
    assert "test_allreduce[numpy-float64-mean-nd-odd]" not in failed, "in place, x itself is the right answer"


# ---- the expected-failure files (no subprocess) ----

def _xfail_module():
    sys.path.insert(0, str(ROOT))
    from conformance import _xfail

    return _xfail


def test_xfail_entries_need_a_reason_and_match_brackets_literally(tmp_path):
    xf = _xfail_module()
    good = tmp_path / "mpi-torch.txt"
    good.write_text("# comment\n\ntest_*reduce[torch-bfloat16-*-0d]  sizes=2,3  # a reason\n"
                    "test_broadcast[torch-int8-?d]  run=false  # another\n")
    entries = xf.load(tmp_path, "mpi", ["torch"])
    assert [e.glob for e in entries["torch"]] == ["test_*reduce[torch-bfloat16-*-0d]", "test_broadcast[torch-int8-?d]"]
    hit = xf.match(entries, "torch", "test_allreduce[torch-bfloat16-sum-0d]", "x", 2)
    assert hit is not None and hit.reason == "a reason" and hit.where == "mpi-torch.txt:3"
    assert xf.match(entries, "torch", "test_allreduce[torch-bfloat16-sum-0d]", "x", 1) is None  # sizes=2,3
    assert xf.match(entries, "torch", "test_allreduce[torch-t]", "x", 2) is None  # [..] is not a class
    assert xf.match(entries, "numpy", "test_allreduce[torch-bfloat16-sum-0d]", "x", 2) is None  # another lib
    assert entries["torch"][1].run is False
    (tmp_path / "mpi-torch.txt").write_text("test_broadcast[torch-int8-0d]\n")
    with pytest.raises(xf.XfailFileError, match="needs a reason"):
        xf.load(tmp_path, "mpi", ["torch"])
    (tmp_path / "mpi-torch.txt").write_text("test_x  when=now  # reason\n")
    with pytest.raises(xf.XfailFileError, match="unknown option"):
        xf.load(tmp_path, "mpi", ["torch"])


def test_shipped_xfail_files_parse_and_give_reasons():
    xf = _xfail_module()
    files = sorted((ROOT / "conformance" / "xfail").glob("*.txt"))
    for path in files:
        for entry in xf.parse(path):
            assert len(entry.reason) > 20, f"{entry.where}: explain the gap, not just name it"
            backends = ("all", "mpi", "self", "nccl", "host-staging", "cuda-aware-mpi")
            assert any(path.stem.startswith(b + "-") for b in backends), f"{path.name}: <backend>-<library>.txt"

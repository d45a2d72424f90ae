"""The bench's reduce_scatter and alltoall: nccl-tests' bus factors, the checked results, a real run."""

import subprocess
import sys

import numpy as np

from collectives import _bench


def test_bus_factors_follow_nccl_tests():
    assert _bench.bus_factor("reduce_scatter", 4) == 0.75 == _bench.bus_factor("alltoall", 4)
    assert _bench.bus_factor("allreduce", 4) == 1.5


def test_expected_blocks():
    n, count = 3, 6
    inputs = [_bench.check_input("alltoall", "sum", count, r, n, "f") for r in range(n)]
    want = _bench.expected("alltoall", "sum", count, 1, n, 0, "f")
    assert want.tolist() == np.concatenate([x[2:4] for x in inputs]).tolist()
    total = sum(_bench.check_input("reduce_scatter", "sum", count, r, n, "f") for r in range(n))
    assert _bench.expected("reduce_scatter", "sum", count, 2, n, 0, "f").tolist() == total[4:6].tolist()


def test_a_checked_run_passes():
    out = subprocess.run([sys.executable, "-m", "collectives", "bench", "-c", "reduce_scatter,alltoall",
                          "-o", "sum,max", "-b", "64", "-e", "4K", "-f", "8", "-n", "3", "-w", "1", "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reduce_scatter op=max" in out.stdout and "alltoall" in out.stdout

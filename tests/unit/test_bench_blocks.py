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


def test_reproducible_rows_report_the_modes_cost():
    """--reproducible: float sums and means are timed beside the ordinary call (issue 36), the others not."""
    import json

    out = subprocess.run([sys.executable, "-m", "collectives", "bench", "-c", "allreduce,broadcast", "-o", "mean,max",
                          "-b", "1K", "-e", "4K", "-f", "4", "-n", "3", "-w", "1", "--reproducible", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(out.stdout)["results"]
    costed = [r for r in rows if "cost" in r]
    assert {(r["collective"], r["op"]) for r in costed} == {("allreduce", "mean")}, rows
    assert all(r["ordinary_us"] > 0 and abs(r["cost"] - r["time_us"] / r["ordinary_us"]) <= 1e-9 * r["cost"] for r in costed)
    text = subprocess.run([sys.executable, "-m", "collectives", "bench", "-o", "sum", "-b", "1K", "-e", "1K", "-n", "3",
                           "-w", "1", "--reproducible"], capture_output=True, text=True, timeout=120).stdout
    assert "ordinary(us)" in text and "cost" in text, text

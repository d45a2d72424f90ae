"""torch's own distributed test suite (``torch/testing/_internal/distributed/distributed_test.py``, the
``DistributedTest._DistTestBase`` tests that torch runs per backend) against the backend "collectives".

torch runs that suite with ``BACKEND=<name> WORLD_SIZE=<n>``, spawning ``n`` fresh processes per test
(``TestDistBackend``, a ``MultiProcessTestCase``) that rendezvous over a file. Spawned processes are not an
MPI job, so this runner takes the suite's test class and runs it under ``mpiexec`` instead: every rank
runs every selected test in order, each test in a new default process group
(``init_process_group("collectives")``, torch's ``timeout=`` bounding every wait so a test failing on one
rank cannot hang the others), the suite's ``_barrier`` as an MPI barrier, and a test's skip exit codes
(``sys.exit(TEST_SKIPS[...].exit_code)``) read as skips. The ranks then agree on each outcome (passed on
every rank, else the first rank's failure or skip). "collectives" is declared in the suite's feature
tables for what it offers (``ddp``, ``subgroup``), so those tests run instead of being skipped by name.

    mpiexec -n 2 python tests/torch_suite/run.py [-k SUBSTRING ...] [--json out.json] [--timeout 30]

Exit status: 0 when no selected test failed (``--expected tests/torch_suite/expected_failures.txt``: the
tests that fail for a reason written there count as ``xfailed``; one of them passing is a failure). Prints one line per test on rank 0 and the counts, with
failures and skips grouped by reason.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import sys
import tempfile
import time
import unittest
from datetime import timedelta

from mpi4py import MPI


def _setup_env(world) -> None:
    os.environ["BACKEND"] = "collectives"
    os.environ["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    os.environ["WORLD_SIZE"] = str(world.size)
    tmp = tempfile.mkdtemp(prefix="collectives-torch-suite-") if world.rank == 0 else None
    tmp = world.bcast(tmp, root=0)
    if world.rank == 0:
        for sub in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(tmp, sub), exist_ok=True)
    world.Barrier()
    os.environ["TEMP_DIR"] = tmp
    os.environ["INIT_METHOD"] = "collectives://"


def _reason(exc_text: str) -> str:
    """The exception line of a traceback (the last ``Name: message`` line), shortened."""
    lines = [ln for ln in exc_text.strip().splitlines() if ln.strip() and not ln.startswith(" ")]
    found = [ln for ln in lines if re.match(r"^[A-Za-z_.]+(Error|Exception|Exit|Interrupt)\b", ln)]
    return ((found or lines or ["?"])[-1])[:300]


def _run_group_tests_from(n: int, world, skips) -> None:
    """torch skips the tests marked ``skip_if_small_worldsize`` (groups of some ranks, ``_init_group_test``)
    below 8 ranks for every backend but "mpi", which it runs at any size; "collectives" runs in an MPI job
    as "mpi" does, so here they run from ``n`` ranks (they need 3: the group [1, 2]). Before the suite is
    imported: it takes the decorator by name."""
    import functools

    from torch.testing._internal import common_distributed

    def skip_if_small_worldsize(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            if world.size < n:
                sys.exit(skips["small_worldsize"].exit_code)
            return func(*args, **kwargs)

        return wrapper

    common_distributed.skip_if_small_worldsize = skip_if_small_worldsize


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-k", action="append", default=[], help="run tests whose name contains this (repeatable)")
    ap.add_argument("--exclude", action="append", default=[], help="skip tests whose name contains this")
    ap.add_argument("--timeout", type=float, default=30.0, help="torch timeout= of each test's group (seconds)")
    ap.add_argument("--json", help="write the outcomes here (rank 0)")
    ap.add_argument("--expected", help="a file of tests expected to fail (name  # reason, one a line)")
    ap.add_argument("--tracebacks", action="store_true", help="print each failure's traceback (rank 0)")
    args = ap.parse_args()
    world = MPI.COMM_WORLD.Dup()
    _setup_env(world)

    import torch.distributed as dist
    from torch.testing._internal.common_distributed import TEST_SKIPS, DistTestCases
    from torch.testing._internal.common_utils import TestCase

    import collectives.torch_backend  # noqa: F401 - registers the backend

    for feature in ("ddp", "subgroup", "plugin"):  # before the suite is imported: its skip decorators read these
        DistTestCases.backend_feature[feature].add("collectives")
    _run_group_tests_from(4, world, TEST_SKIPS)
    from torch.testing._internal.distributed import distributed_test as dt
    skip_codes = {s.exit_code: s.message for s in TEST_SKIPS.values()}

    class Suite(dt.DistributedTest._DistTestBase, TestCase):  # torch's TestCase: tensor-aware asserts
        rank = world.rank
        world_size = str(world.size)
        file_name = os.path.join(os.environ["TEMP_DIR"], "init_dir", "unused")

        def _barrier(self, *a, **k):
            world.Barrier()

    names = sorted(n for n in dir(Suite) if n.startswith("test_"))
    if args.k:
        names = [n for n in names if any(k in n for k in args.k)]
    names = [n for n in names if not any(x in n for x in args.exclude)]
    expected = {}
    if args.expected:
        with open(args.expected) as f:
            for line in f:
                name, _, why = line.partition("#")
                if name.strip():
                    expected[name.strip()] = why.strip()
    outcomes = {}
    start = time.monotonic()
    for name in names:
        dt.Barrier.barrier_id = 0
        t0 = time.monotonic()
        result = unittest.TestResult()
        try:
            dist.init_process_group("collectives", timeout=timedelta(seconds=args.timeout))
            world.Barrier()
            Suite(name).run(result)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        if result.skipped:
            mine = ("skipped", result.skipped[0][1][:300])
        elif result.errors or result.failures:
            text = (result.errors or result.failures)[0][1]
            code = None
            if "SystemExit" in text:
                tail = _reason(text)
                code = int(tail.split(":")[-1]) if tail.split(":")[-1].strip().isdigit() else None
            if code in skip_codes:
                mine = ("skipped", skip_codes[code])
            elif "SystemExit" in text and code == 0:
                mine = ("passed", "")
            else:
                mine = ("failed", _reason(text))
                if args.tracebacks and world.rank == 0:
                    print(text, flush=True)
        else:
            mine = ("passed", "")
        every = world.allgather(mine)
        if all(o[0] == "passed" for o in every):
            outcome = ("passed", "")
        else:
            outcome = next(o for o in every if o[0] == "failed") if any(o[0] == "failed" for o in every) else \
                next(o for o in every if o[0] != "passed")
        if name in expected:  # an expected failure: failed as expected, or passed unexpectedly (a failure)
            outcome = ("xfailed", expected[name]) if outcome[0] == "failed" else \
                (("failed", f"expected to fail ({expected[name]}), but {outcome[0]}") if outcome[0] == "passed"
                 else outcome)
        outcomes[name] = outcome
        if world.rank == 0:
            print(f"{outcome[0]:8s} {time.monotonic() - t0:6.1f}s {name}  {outcome[1][:160]}", flush=True)
    if world.rank == 0:
        counts = collections.Counter(o[0] for o in outcomes.values())
        print(f"\n{world.size} ranks, {len(outcomes)} tests in {time.monotonic() - start:.0f} s: "
              + ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "xfailed", "skipped")))
        for kind in ("failed", "xfailed", "skipped"):
            by = collections.defaultdict(list)
            for n, o in outcomes.items():
                if o[0] == kind:
                    by[o[1]].append(n)
            if by:
                print(f"\n{kind} by reason:")
                for reason, tests in sorted(by.items(), key=lambda kv: -len(kv[1])):
                    print(f"  {len(tests):4d}  {reason}\n        e.g. {', '.join(tests[:4])}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"size": world.size, "outcomes": outcomes}, f, indent=1)
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(os.environ["TEMP_DIR"], ignore_errors=True)
    failed = sum(o[0] == "failed" for o in outcomes.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""COLLECTIVES_TIMELINE in one process (the self backend): what a process that ends without its exit
handlers leaves (its raw batches) is what ``python -m collectives trace PREFIX --timeline`` merges; a batch
cut short ends the reading; off, the communicator's methods are its class's own. The crash suite runs the
timeline of real jobs at 1, 2 and 3 ranks (test_the_timeline_holds_every_call_with_its_phases)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from collectives._launcher import job_environment

SCRIPT = textwrap.dedent("""
    import os, time, numpy as np, collectives as coll
    comm = coll.init()
    x = np.ones(4, np.float32)
    for _ in range(25):
        comm.allreduce(x)  # the hot path from the second call
    comm.allreduce(x, async_op=True).wait()
    comm.barrier()
    time.sleep(0.8)  # the daemon thread writes every 0.25 s
    os._exit(0)  # no exit handlers: as a rank that dies, only the raw batches remain
""")


def run(prefix: Path, extra: dict) -> subprocess.CompletedProcess:
    env = job_environment(drop=("COLLECTIVES_",), COLLECTIVES_BACKEND="self", COLLECTIVES_TIMELINE=str(prefix), **extra)
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)


def test_the_raw_batches_of_a_process_that_died_are_merged(tmp_path):
    prefix = tmp_path / "tl"
    proc = run(prefix, {})
    assert proc.returncode == 0, proc.stderr
    raw = Path(f"{prefix}.0.raw")
    assert raw.exists() and not Path(f"{prefix}.0").exists(), list(tmp_path.iterdir())
    out = tmp_path / "merged.json"
    cli = subprocess.run([sys.executable, "-m", "collectives", "trace", str(prefix), "--timeline", str(out)],
                         capture_output=True, text=True, timeout=120, env=job_environment())
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "rank 0: 27 calls" in cli.stdout, cli.stdout  # 25 + 1 allreduces, the barrier
    calls = [e for e in json.loads(out.read_text())["traceEvents"] if e.get("cat") == "call"]
    world = sorted((e["args"]["seq"], e["name"], e["args"]["path"].split(",")[0]) for e in calls)
    assert world[:3] == [(1, "allreduce", "blocking"), (2, "allreduce", "hot path"), (3, "allreduce", "hot path")]
    assert world[-2:] == [(26, "allreduce", "asynchronous"), (27, "barrier", "blocking")], world
    assert all(e["args"]["phases"] and e["args"]["late_us"] == 0 for e in calls), calls

    # a batch cut short (the process died while writing it): the batches before it are read, then no more
    whole = raw.read_bytes()
    raw.write_bytes(whole + whole[: len(whole) // 2])
    cli = subprocess.run([sys.executable, "-m", "collectives", "trace", str(prefix)], capture_output=True, text=True,
                         timeout=120, env=job_environment())
    assert cli.returncode == 0 and "rank 0: " in cli.stdout, cli.stdout + cli.stderr
    got = int(cli.stdout.split("rank 0: ")[1].split(" calls")[0])
    assert 27 <= got < 54, cli.stdout


def test_off_the_methods_are_the_class_own(tmp_path):
    """Without the variable nothing of the timeline is put in place (and no file is written)."""
    probe = textwrap.dedent("""
        import collectives as coll
        from collectives import Communicator
        comm = coll.init()
        assert "allreduce" not in vars(comm) and "barrier" not in vars(comm) and "_blocking" not in vars(comm)
        assert type(comm).allreduce is Communicator.allreduce
        print("ok")
    """)
    env = job_environment(drop=("COLLECTIVES_",), COLLECTIVES_BACKEND="self")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert not list(tmp_path.glob("*.raw")), list(tmp_path.iterdir())


def test_the_transports_own_timed_call_stamps_what_it_did_and_its_failure():
    """The MPI transport's cached allreduce and broadcast time themselves in their own frame under the
    timeline (``Operation.bind``'s ``timed``): the same MPI call as untimed, a stamp ``(kind, seq, bytes or
    root, start, end)`` after it, and ``failed(start, exc)`` before an error goes on. Reaches into the
    transport's table (a private) because nothing public can make an MPI call of the hot path fail: the
    method here is a stand-in that records its arguments and raises when asked."""
    import operator
    import time

    import numpy as np
    import pytest

    from collectives._backends.mpi.ops import OPERATIONS

    made, stamps, failures = [], [], []

    def method(*args):
        made.append(args)
        if args[-1] == "raise":
            raise RuntimeError("an MPI error")

    class Owner:
        _seq = 7

    seq = operator.attrgetter("_seq")  # (as the engine's seq_reader)
    stamp = (stamps.append, 3, seq, Owner(), lambda t0, exc: failures.append((t0, exc)))
    x = np.ones(5, np.float32)
    for name, args, mop in (("allreduce", (x,), "SUM"), ("broadcast", (x, 1), None)):
        plain = OPERATIONS[name].bind(method, "FLOAT", mop, "IN_PLACE", 1 << 30, None)
        plain(*args)
        untimed = made.pop()
        before = time.time_ns()
        plain.timed(stamp)(*args)
        assert made.pop() == untimed  # the same MPI call
        kind, n, aux, t0, t1 = stamps.pop()
        assert (kind, n, aux) == (3, 7, 20 if name == "allreduce" else 1) and before <= t0 <= t1 <= time.time_ns()
    failing = OPERATIONS["allreduce"].bind(method, "FLOAT", "raise", "IN_PLACE", 1 << 30, None).timed(stamp)
    with pytest.raises(RuntimeError, match="an MPI error"):
        failing(x)
    assert not stamps and len(failures) == 1 and str(failures[0][1]) == "an MPI error"

"""The flight recorder's record of a call, compiled (``_recorder.c``) and in Python (``record.python_begin``):
the same calls, made once through each, leave the same records (collective, op, root, dtype, shape, path,
front end, call site, state, error), whichever front end, line or depth they come from, with a site hint
set, for an argument without a dtype, and with the record off.

Which of the two ``record.begin`` is can be seen through nothing public (both make the same records: that
is the point), so this test swaps the module attribute that the engine calls.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import collectives as coll
from collectives import _records
from collectives._comm import engine_of, record


def compiled_or_skip():
    if record.begin is record.python_begin:
        if os.environ.get("COLLECTIVES_TEST_REQUIRE_KERNELS") == "1":  # CI builds it: a missing build fails
            pytest.fail("the compiled recorder (collectives/_recorder*.so) did not load")
        pytest.skip("collectives was built without its compiled recorder (no C compiler, or Python < 3.11)")
    return record.begin


def fresh(buffer: str = "64"):
    mpi = pytest.importorskip("mpi4py.MPI")
    saved = os.environ.get("COLLECTIVES_TRACE_BUFFER")
    os.environ["COLLECTIVES_TRACE_BUFFER"] = buffer
    try:
        return coll.init(comm=mpi.COMM_SELF.Dup())
    finally:  # (the caller's setting, as it was)
        if saved is None:
            os.environ.pop("COLLECTIVES_TRACE_BUFFER", None)
        else:
            os.environ["COLLECTIVES_TRACE_BUFFER"] = saved


def _deep(c, x, depth: int, function: bool):  # (float max: the general path, never the asynchronous hot path,
    if depth:                                     # whose entry keeps no site)
        return _deep(c, x, depth - 1, function)
    if function:
        return coll.allreduce(x, "max", comm=c, async_op=True).wait()
    return c.allreduce(x, "max", async_op=True).wait()


def _twin_a(c, x):
    return c.allreduce(x, "max", async_op=True).wait()


def _twin_b(c, x):  # (the same instructions as _twin_a: at the same offset, only the code object differs)
    return c.allreduce(x, "max", async_op=True).wait()


class NoDtype:
    """An argument whose ``dtype`` raises AttributeError from inside a property."""

    shape = (3,)

    @property
    def dtype(self):
        raise AttributeError("no dtype here")


def calls(c) -> list[dict]:
    """A script of calls through every kind of front end, from several lines and depths; its records
    without what differs from run to run (times, thread, sequence numbers)."""
    x = np.ones(3, np.float32)
    for i in range(4):
        c.allreduce(x, "max", async_op=True).wait()
        coll.allreduce(x, "sum", comm=c, async_op=True).wait()
        _deep(c, x, i % 3, bool(i & 1))
        _twin_a(c, x)
        _twin_b(c, x)
        c.allgather(np.arange(2.0))
        c.reduce(x, "min", root=0)
        c.broadcast_object({"a": i}, 0)
        c.allreduce_tree({"w": x, "b": np.zeros(2)}, "mean")
        with _records.site_hint(["hinted.py", 7, "jitted"], "jax.jit"):
            c.allreduce(x, "sum", async_op=True).wait()
        with pytest.raises(TypeError):
            c.allreduce(np.ones(2, object), "sum", async_op=True)
    rec = record.begin(c, "made by hand", NoDtype(), "sum", 0, "asynchronous")
    _records.finish(rec)
    keep = ("collective", "op", "root", "dtype", "shape", "nbytes", "path", "site", "state", "error")
    return [{k: e[k] for k in keep} for e in engine_of(c).trace_entries()]


def test_the_compiled_record_is_the_python_record(monkeypatch):
    compiled = compiled_or_skip()
    made = {}
    for name, begin in (("compiled", compiled), ("python", record.python_begin), ("compiled again", compiled)):
        monkeypatch.setattr(record, "begin", begin)
        c = fresh()
        try:
            made[name] = calls(c)
        finally:
            c.close()
    assert made["compiled"] == made["python"] == made["compiled again"]
    got = made["compiled"]
    here = __file__
    sites = {tuple(e["site"][::2]) if e["site"] else None for e in got}
    assert {(here, "calls"), (here, "_deep"), (here, "_twin_a"), (here, "_twin_b"), ("hinted.py", "jitted")} <= sites
    assert any(e["path"].startswith("asynchronous") and e["site"] == ["hinted.py", 7, "jitted"] for e in got)
    assert got[-1]["collective"] == "made by hand" and got[-1]["dtype"] is None and got[-1]["shape"] == [3]
    assert any(e["state"] == "failed" for e in got)


def test_the_compiled_record_is_off_with_the_ring():
    compiled = compiled_or_skip()
    c = fresh("0")
    try:
        seq = c._seq  # (the sequence number only moves with a record)
        assert compiled(c, "allreduce", np.ones(2), "sum", None, "asynchronous") is None
        assert c._seq == seq
    finally:
        c.close()


def test_the_compiled_record_fills_the_ring_as_python_does():
    compiled = compiled_or_skip()
    c = fresh("4")
    try:
        x = np.ones(2)
        made = [compiled(c, "allreduce", x, "sum", None, "asynchronous") for _ in range(6)]
        made += [record.python_begin(c, "allreduce", x, "sum", None) for _ in range(3)]
        ring = c._ring
        assert [r[_records.SEQ] for r in ring] == [8, 9, 6, 7]  # the last four, each at seq % 4
        assert ring[0] is made[-2] and ring[2] is made[5]
        assert c._last_activity == made[-1][_records.START]
        assert made[0][_records.PATH] == "asynchronous" and made[-1][_records.PATH] == "blocking"
        with pytest.raises(TypeError):
            compiled(c)
    finally:
        c.close()

"""The host rules' steps under the caller's NumPy error state (``_reduction``).

A private module, tested directly: the one pair whose steps need ``np.errstate``, a float16 sum widened to
float32 and rounded back, never reaches them through the public API on an MPI that sums float16 itself
(MPICH 5 and Open MPI 5 both do, so ``tests/crash``'s error-state scenario cannot see it), and no public
name shows which steps are quiet. A transport without a float16 sum is written here as its ``native``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from collectives import _dtypes, _reduction

STATES = [{"all": "raise"}, {"all": "warn"}]  # with warnings as errors below: either way, a raise


def no_float16(dtype, op) -> bool:
    """The ``native`` of a transport that reduces everything itself but float16."""
    return dtype != np.float16


def every_dtype(dtype, op) -> bool:
    return True


def two_equal_ranks(wire, op):
    """The collective of two ranks holding the same values, in place (its own arithmetic quiet, as MPI's)."""
    assert op == "sum"
    with np.errstate(all="ignore"):
        wire += wire


@pytest.mark.parametrize("state", STATES)
def test_a_widened_sum_rounded_back_neither_raises_nor_warns(state):
    info = _dtypes.from_numpy(np.dtype(np.float16))
    blocking, stepped = np.full(3, 60000.0, np.float16), np.full(3, 60000.0, np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(**state):
            before = np.geterr()
            _reduction.reduce_buffer(blocking, info, "sum", 2, two_equal_ranks, no_float16)
            # the asynchronous form: the steps one by one, as rules.reducing runs them
            run, quiet = _reduction.steps(stepped, info, "sum", 2, no_float16)
            assert quiet is False  # widened to float32: its steps compute
            wire, op = _reduction.advance(run, None, quiet)
            assert wire.dtype == np.float32
            two_equal_ranks(wire, op)
            assert _reduction.advance(run, None, quiet) is None
            assert np.geterr() == before  # the caller's state, as it was
    for got in (blocking, stepped):
        assert np.isposinf(got).all(), got  # 120000 rounds to float16's infinity


@pytest.mark.parametrize("state", STATES)
def test_a_pair_that_travels_as_it_is_is_quiet_and_its_mean_divides_quietly(state):
    info = _dtypes.from_numpy(np.dtype(np.float64))
    tiny = np.array([5e-324, 3.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(**state):
            run, quiet = _reduction.steps(tiny, info, "mean", 2, every_dtype)
            assert quiet is True
            wire, op = _reduction.advance(run, None, quiet)
            assert wire is tiny and op == "sum"  # in the caller's memory, as it is
            two_equal_ranks(wire, op)
            assert _reduction.advance(run, None, quiet) is None  # mean's division underflows: quietly
    assert tiny.tolist() == [5e-324, 3.0]


@pytest.mark.parametrize(("dtype", "op", "quiet"), [
    ("float32", "sum", True), ("float64", "mean", True), ("int8", "max", True), ("complex64", "prod", True),
    ("float32", "max", False), ("bool", "max", False), ("float16", "sum", False)])
def test_quiet_is_as_is(dtype, op, quiet):
    """``steps``' quiet is the rule ``as_is`` (one rule: the hot path's direct call has the same pairs)."""
    info = _dtypes.from_numpy(np.dtype(dtype))
    buf = np.ones(4, dtype)
    assert _reduction.steps(buf, info, op, 2, no_float16)[1] is quiet
    assert _reduction.as_is(info, op, no_float16) is quiet

"""The MPI library as this process finds it: importing mpi4py at the chosen thread level, the tables of
datatypes and ops, the probe of ops this MPI gets wrong, and the settings every rank agrees on when a
transport is made. Local, except :func:`_agreed_settings` (one allreduce)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

import numpy as np

from ... import _agree, _config
from .. import shm


def import_mpi():
    """Import mpi4py.MPI, choosing the thread level if MPI is not initialised yet."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        try:
            mpi4py.rc.thread_level = _config.mpi_thread_level()
        except ValueError:  # malformed: refused on every rank once MPI is up (MPITransport.__init__)
            pass
    from mpi4py import MPI

    return MPI


DEFAULT_MAX_COUNT = 2**31 - 1  # COLLECTIVES_MAX_COUNT's default: what an MPI int count holds
_OPS_CACHE: dict = {}
_TYPES_CACHE: dict = {}


def _tables(MPI):
    if not _OPS_CACHE:
        _OPS_CACHE.update(sum=MPI.SUM, prod=MPI.PROD, min=MPI.MIN, max=MPI.MAX)
        pairs = {
            np.int8: MPI.INT8_T, np.uint8: MPI.UINT8_T, np.int16: MPI.INT16_T, np.uint16: MPI.UINT16_T,
            np.int32: MPI.INT32_T, np.uint32: MPI.UINT32_T, np.int64: MPI.INT64_T, np.uint64: MPI.UINT64_T,
            np.float32: MPI.FLOAT, np.float64: MPI.DOUBLE, np.longdouble: MPI.LONG_DOUBLE,
            np.complex64: MPI.C_FLOAT_COMPLEX, np.complex128: MPI.C_DOUBLE_COMPLEX,
            np.clongdouble: MPI.C_LONG_DOUBLE_COMPLEX, np.bool_: MPI.UINT8_T,
        }
        f16 = getattr(MPI, "FLOAT16_T", MPI.DATATYPE_NULL)
        if f16 != MPI.DATATYPE_NULL and _reduces_locally(MPI, f16):
            pairs[np.float16] = f16
        for k, v in pairs.items():
            if v != MPI.DATATYPE_NULL:
                _TYPES_CACHE[np.dtype(k)] = v
    return _OPS_CACHE, _TYPES_CACHE


# The pairs :func:`faulty_ops` checks: every integer dtype and float16 with sum and prod (the ops that can
# overflow or round), and the integers with min and max too. Float min/max never reach MPI as floats (they
# travel as ordered integers, _dtypes.float_to_ordered); bool travels as uint8 0/1, which cannot overflow.
PROBED_OPS = tuple((np.dtype(t), op) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
                                               np.int64, np.uint64) for op in ("sum", "prod", "min", "max")
                   ) + ((np.dtype(np.float16), "sum"), (np.dtype(np.float16), "prod"))
PROBE_COUNT = 1031  # elements: many vector widths (AVX-512 holds 64 int8) and a ragged tail
_NUMPY_OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
_warned: set = set()  # process-wide: the MPI library is


def _probe_values(dtype: np.dtype, salt: int) -> np.ndarray:
    """PROBE_COUNT values of ``dtype`` spread over its whole range (integers wrap into it), so that sums
    and products overflow in both directions; finite and exactly representable for float16."""
    k = np.arange(PROBE_COUNT, dtype=np.int64)
    if dtype.kind == "f":
        return ((k * (37 + salt)) % 4001 / 16.0 - 125.0).astype(dtype)
    return (k * (7919 + 104_722 * salt) + 12_345 * (salt + 1)).astype(dtype)  # astype wraps


def faulty_ops(MPI, ops: dict, types: dict) -> list:
    """The ``(dtype, op)`` pairs of :data:`PROBED_OPS` that this MPI library reduces differently from
    NumPy, found (not assumed) with ``MPI_Reduce_local`` on a probe of :data:`PROBE_COUNT` overflowing
    values per pair. Local: no communication.

    An MPI may not wrap integers: Open MPI 5.0's AVX op component saturates int8/uint8/int16/uint16 sums
    past a vector width (``np.full(100, 100, np.int8)`` summed over 2 ranks gives 127, NumPy gives -56).
    The op component an allreduce uses is the one ``MPI_Reduce_local`` uses, so one local call per pair
    tells. A pair that fails is reduced in a wider dtype instead (:meth:`MPITransport.reduces`).
    """
    bad = []
    for dtype, op in PROBED_OPS:
        datatype = types.get(dtype)
        if datatype is None:
            continue
        a, b = _probe_values(dtype, 0), _probe_values(dtype, 1)
        with np.errstate(all="ignore"):
            want = _NUMPY_OPS[op](a, b)
        got = b.copy()
        try:
            ops[op].Reduce_local([a, datatype], [got, datatype])
        except Exception:  # noqa: BLE001 - an MPI that cannot reduce the pair at all fails the probe too
            bad.append((dtype, op))
            continue
        if not np.array_equal(got, want):
            bad.append((dtype, op))
    return bad


def _warn_faulty(MPI, bad: list) -> None:
    """Say once per process, on the rank that calls it, which pairs the MPI gets wrong and what to do."""
    pairs = ", ".join(f"{op} of {dtype.name}" for dtype, op in bad)
    if not pairs or pairs in _warned:
        return
    _warned.add(pairs)
    library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split(",")[0].split())
    fix = ("Open MPI's AVX op component does this: run with `mpiexec --mca op ^avx` (or set "
           "OMPI_MCA_op=^avx) to use its plain, wrapping ops. " if "Open MPI" in library else "")
    widest = [f"{op} of {dtype.name}" for dtype, op in bad if dtype.itemsize == 8]
    caveat = (f"There is no wider type for {', '.join(widest)}: those results may be wrong. " if widest else "")
    warnings.warn(
        f"collectives: this MPI ({library}) gets {pairs} wrong (checked with MPI_Reduce_local: its result "
        f"differs from NumPy's wrapping arithmetic). collectives reduces these pairs in 64-bit integers "
        f"(float32 for float16) instead: the same bits, more bytes on the wire. {caveat}{fix}"
        f"To silence this warning, filter RuntimeWarning messages starting with 'collectives: this MPI'.",
        RuntimeWarning, stacklevel=4)


def _agreed_settings(comm, local_size: int, faulty: Sequence = ()) -> tuple[int, bool, frozenset, bool]:
    """What every rank must share, agreed in one allreduce when the MPI transport is made (collective; one
    :class:`~collectives._agree.Ballot` over the start-up mpi4py communicator ``comm``):
    ``(shared-memory threshold in bytes, or shm.NEVER when the path is off; whether synchronize may use the
    point-to-point pipeline; the (dtype, op) pairs of PROBED_OPS that some rank's MPI reduces wrongly;
    whether floating reductions are checked for NaN/inf, COLLECTIVES_CHECK_NAN)``.

    A pair any rank's probe failed (:func:`faulty_ops`) is faulty on every rank: the dtype a buffer travels
    in must be the same everywhere.

    Every rank must take the same path for the same call. The shared-memory allreduce is off if any rank
    has ``COLLECTIVES_SHM=0`` or if no node holds more than one rank (nothing to share), else it starts at
    the largest threshold any rank asked for; the pipeline of ``synchronize`` is off if any rank has
    ``COLLECTIVES_SYNC_PIPELINE=0``; the NaN check is on if any rank has ``COLLECTIVES_CHECK_NAN=1`` (it is
    one more collective before each checked call: every rank must make it).
    """
    pairs = {f"faulty {dtype.name} {op}": (dtype, op) for dtype, op in PROBED_OPS}
    ballot = _agree.Ballot({"shm off": "any", "threshold": "max", "local size": "max", "pipeline off": "any",
                            "check nan": "any", **dict.fromkeys(pairs, "any")})
    got = ballot.combine(comm, {"shm off": not _config.shm(), "threshold": _config.shm_threshold(),
                                "local size": local_size, "pipeline off": not _config.sync_pipeline(),
                                "check nan": _config.check_nan(), **{k: p in faulty for k, p in pairs.items()}})
    agreed = frozenset(pair for key, pair in pairs.items() if got[key])
    shared = shm.NEVER if got["shm off"] or got["local size"] < 2 else got["threshold"]
    return shared, not got["pipeline off"], agreed, got["check nan"]


def _reduces_locally(MPI, datatype) -> bool:
    """Detect (not assume) that this MPI library can reduce float16: try it locally."""
    a = np.array([1.0, 2.0], dtype=np.float16)
    b = np.array([3.0, 4.0], dtype=np.float16)
    try:
        for op in (MPI.SUM, MPI.PROD, MPI.MAX, MPI.MIN):
            c = b.copy()
            op.Reduce_local([a, datatype], [c, datatype])
    except Exception:  # noqa: BLE001 - any failure means "cannot": the caller then widens to float32
        return False
    return True

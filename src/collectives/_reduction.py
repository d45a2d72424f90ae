"""The host reduction rules, in one place: every path that reduces host memory calls this module.

A reduction of a contiguous host buffer (the Communicator's hot and general paths, ``reduce``, the solo
leaves and the flat buckets of ``allreduce_tree``, the host-staging CUDA transport, which runs the host
path) goes through :func:`runner` or :func:`reduce_buffer`. They decide, per (dtype, op), how the values
travel, and the transport only ever sees a buffer of a dtype it reduces natively with ``sum``, ``prod``,
``min`` or ``max``:

- **value dtype** (:func:`value_dtype`): bfloat16 is accumulated in float32; float16 in float32 where the
  transport cannot reduce it; 8- to 32-bit integers in 64-bit integers where the transport's own op is not
  trusted for them (``HostTransport.reduces`` said no: a sum or product modulo 2**n is the same in a wider
  integer, cut back); bool as bytes (``max`` = any, ``min`` = all);
- **float min/max** (:func:`to_ordered`): a total order, the same on every rank and every path: values are
  mapped, in place, to signed integers of the same width with the same order (negative values get their
  magnitude bits flipped, so -0.0 < +0.0), NaN to the extreme the op picks (a NaN anywhere is a NaN in the
  result, as a canonical quiet NaN), the integers reduced, and mapped back. No path reduces floats with
  the MPI library's own MAX/MIN, whose NaN and signed-zero answers depend on the rank order. Floats wider
  than 64 bits (``longdouble``) keep their dtype and carry two byte flags per element beside them (a NaN
  anywhere; a zero of the op's preferred sign anywhere), reduced with ``max`` in a second call;
- **mean** is a sum divided by the number of ranks in the value dtype, then rounded back once
  (:func:`collectives._dtypes.divide`, which ignores the caller's NumPy error state);
- **writing back**: the value dtype is rounded (floats: to nearest) or cut (integers: modulo 2**n) back
  into the caller's storage dtype.

Everything here runs with NumPy's floating-point errors ignored: a caller's ``np.seterr(all="raise")`` or
``python -W error`` must not make one rank raise where the others do not (issue 12).
"""

from __future__ import annotations

import numpy as np

from . import _dtypes

MINMAX = ("min", "max")
_U8 = np.dtype(np.uint8)
wire_op = _dtypes.wire_op  # the op the transport runs (mean: a sum), written once, in _dtypes


def value_dtype(info: _dtypes.DType, op: str, native) -> np.dtype:
    """The dtype ``info``'s values are reduced in with ``op``; ``native(dtype, op)`` says what the
    transport reduces itself (``HostTransport.reduces``). Float min/max then go through :func:`to_ordered`.
    The rule is :func:`collectives._dtypes.value_dtype`, which the CUDA transports follow too."""
    return _dtypes.value_dtype(info, op, native)


def ordered(dtype: np.dtype) -> bool:
    """Whether float min/max of ``dtype`` go through the integer mapping (16-, 32- and 64-bit floats)."""
    return _dtypes.ordered_int(dtype) is not None


_STEP = 8192  # elements per piece of the in-place mappings: their temporaries stay under 64 KiB


def to_ordered(values: np.ndarray, op: str) -> np.ndarray:
    """Map contiguous floats, in place, to signed integers of the same order; returns the integer view.

    NaN becomes the extreme ``op`` picks (the largest integer for max, the smallest for min). Done in
    pieces, so the temporaries stay small whatever the size (the fused collectives' memory bound)."""
    itype = _dtypes.ordered_int(values.dtype)
    assert itype is not None  # a 16-, 32- or 64-bit float (see ordered)
    info = np.iinfo(itype)
    flat = values.reshape(-1)
    ints = flat.view(itype)
    extreme = _dtypes.ordered_nan(itype, op)
    for lo in range(0, flat.size, _STEP):
        v, k = flat[lo:lo + _STEP], ints[lo:lo + _STEP]
        nan = np.isnan(v)
        np.bitwise_xor(k, info.max, out=k, where=k < 0)
        k[nan] = extreme
    return ints.reshape(values.shape)


def from_ordered(ints: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Invert :func:`to_ordered` in place; returns the float view. Only NaN bit patterns map to the
    extreme integers, so a NaN result comes back as a NaN (its payload is free)."""
    top = np.iinfo(ints.dtype).max
    flat = ints.reshape(-1)
    for lo in range(0, flat.size, _STEP):
        k = flat[lo:lo + _STEP]
        np.bitwise_xor(k, top, out=k, where=k < 0)
    return ints.view(dtype)


def _minmax_flagged(values: np.ndarray, op: str):
    """min/max of floats without an integer of their width (longdouble), exactly as :func:`to_ordered`
    would: NaN and the sign of zero travel as byte flags reduced with max beside the values, which are
    reduced with NaN replaced by the identity of ``op``."""
    values = values.reshape(-1)  # contiguous: a view, written in place
    n = values.size
    flags = np.empty(2 * n, dtype=np.uint8)
    nan = np.isnan(values)
    flags[:n] = nan
    preferred = values == 0
    preferred &= np.signbit(values) == (op == "min")  # max prefers +0.0, min prefers -0.0
    flags[n:] = preferred
    values[nan] = -np.inf if op == "max" else np.inf
    yield values, op  # two collectives, in place (see steps)
    yield flags, "max"
    zero = values == 0
    values[zero] = np.copysign(0.0, -1.0 if op == "min" else 1.0)
    values[zero & ~flags[n:].astype(bool)] *= -1
    values[flags[:n].astype(bool)] = np.nan


def reduce_buffer(buf: np.ndarray, info: _dtypes.DType, op: str, size: int, collective, native, *,
                  receives: bool = True, out: np.ndarray | None = None) -> None:
    """Reduce the contiguous ``buf`` (``info``'s storage dtype) over the ranks with ``op``.

    ``collective(wire, op)`` reduces a buffer of a native dtype: in place, returning None (an allreduce,
    or a reduce to a root), or into a new array it returns (a reduce-scatter: this rank's block, with
    ``wire.size // size`` elements); ``native`` is the transport's ``reduces``. A rank with
    ``receives=False`` (not the root of a reduce) only contributes: ``buf`` is left bit for bit as it was
    (it may be read-only). With ``out`` (a contiguous array of ``info``'s storage dtype, the size of what
    ``collective`` returns) the result goes there and ``buf`` is left as it was. The decoding (ordered
    integers back to floats, mean's division, rounding back) runs on the result only.
    """
    run, quiet = steps(buf, info, op, size, native, receives=receives, out=out)
    result = None
    while (step := advance(run, result, quiet)) is not None:
        result = collective(*step)


def steps(buf: np.ndarray, info: _dtypes.DType, op: str, size: int, native, *, receives: bool = True,
          out: np.ndarray | None = None):
    """:func:`reduce_buffer` as a generator, for callers that start the collective and finish later (the
    asynchronous collectives), and whether its steps are quiet: ``(run, quiet)``. ``run`` yields
    ``(wire, op)`` for each collective it needs (one; two for the flagged floats) and is sent what the
    collective returned (None for in place, else its result) once that collective has completed. Run
    each step with :func:`advance` and ``quiet`` (as reduce_buffer does): the encoding before the first
    yield, the decoding after the last, with NumPy's floating-point errors ignored where they could
    arise. ``quiet``: the pair travels as it is (:func:`as_is`, read from the plan)."""
    plan = _dtypes.wire(info, op, native)  # the one plan of a reduction, the device transports' too
    return _reduce(buf, info, op, size, plan, receives, out), travels_as_is(info, op, plan.dtype)


def advance(run, result, quiet: bool):
    """One step of :func:`steps`' generator ``run``: ``run.send(result)``, the next ``(wire, op)``, or None
    once it has returned. The step runs with NumPy's floating-point errors ignored, whatever the
    caller's error state (a caller's ``np.seterr(all="raise")`` must not raise on some ranks only), except
    where ``quiet``: the pair travels as it is (:func:`as_is`), so its steps compute nothing that could
    raise or warn (mean's division is quiet by itself, ``_dtypes.divide``), and the cost of entering
    ``np.errstate`` (about a microsecond, each time) is saved."""
    try:
        if quiet:
            return run.send(result)
        with np.errstate(all="ignore"):
            return run.send(result)
    except StopIteration:
        return None


def scatters(info: _dtypes.DType, op: str) -> bool:
    """Whether :func:`reduce_buffer` can run a reduce-scatter (``out=``) for this pair: every pair but
    min/max of floats wider than 64 bits, whose flags travel in a second, whole-buffer call (the
    Communicator composes those from an allreduce, with the same bits)."""
    return not (op in MINMAX and info.kind == "f" and info.name != "bfloat16" and not ordered(info.storage))


def _reduce(buf, info, op, size, plan, receives, out):
    value = plan.dtype
    bf16 = info.name == "bfloat16"
    keep = not receives or out is not None  # buf must stay as it was
    if bf16:
        v = _dtypes.bf16_to_f32(buf)  # a new array
    elif value != buf.dtype or info.kind == "b":
        v = buf.view(_U8) if value == _U8 else buf.astype(value)
    else:
        v = buf
    float_minmax = op in MINMAX and v.dtype.kind == "f"
    if v is buf and keep and float_minmax:
        v = buf.copy()  # the mapping works in place: not in a buffer that must stay as it was
    if plan.ordered is not None:
        ints = to_ordered(v, op)
        r = yield ints, op
        r = ints if r is None else r
        if not receives:
            return
        r = from_ordered(r, v.dtype)
    elif float_minmax:
        if out is not None:
            raise AssertionError("reduce_buffer: a reduce-scatter of flagged floats (see scatters)")
        yield from _minmax_flagged(v, op)
        if not receives:
            return
        r = v
    else:
        r = yield v, plan.op
        r = v if r is None else r
        if not receives:
            return
        if plan.divide:
            _dtypes.divide(r, size)
    if out is None:
        if v is buf or (info.kind == "b" and value == _U8):
            return  # the result is in buf's own memory
        out = buf
    flat, r = out.reshape(-1), r.reshape(-1)  # out is contiguous: a view
    if r.dtype == flat.dtype and r.__array_interface__["data"][0] == flat.__array_interface__["data"][0]:
        return  # the collective received into out itself
    if bf16:
        _dtypes.f32_to_bf16(r, out=flat)
    elif info.kind == "b" and value == _U8:
        flat.view(_U8)[...] = r
    else:
        np.copyto(flat, r, casting="unsafe")  # round to nearest (floats), modulo 2**n (integers)


def runner(transport, info: _dtypes.DType, op: str, size: int):
    """A callable ``run(buf)`` that allreduces a contiguous, writable buffer of ``info``'s storage dtype
    in place with ``op``: the transport's direct call (:meth:`HostTransport.fast_call`) where the values
    travel as they are, else :func:`reduce_buffer`. Build once per (transport, dtype, op) and keep it."""
    if as_is(info, op, transport.reduces):
        run = transport.fast_call(op, info.storage, size)
        if run is not None:
            return run
        if op != "mean":
            return lambda buf: transport.allreduce(buf, op)
    allreduce, native = transport.allreduce, transport.reduces
    return lambda buf: reduce_buffer(buf, info, op, size, allreduce, native)


def reduce_runner(transport, info: _dtypes.DType, op: str, size: int, rank: int):
    """A callable ``run(buf, root)`` that reduces the contiguous buffer of ``info``'s storage dtype with
    ``op`` onto ``root`` (in place there, which needs ``buf`` writable; ``buf`` is left as it was on the
    other ranks): the transport's direct call (:meth:`HostTransport.fast_reduce`) where the values travel as
    they are and ``op`` is not ``mean``, else :func:`reduce_buffer` (``rank``: this rank, which receives
    where it is the root). Build once per (transport, dtype, op) and keep it."""
    if op != "mean" and as_is(info, op, transport.reduces):
        run = transport.fast_reduce(op, info.storage)
        if run is not None:
            return run
    reduce, native = transport.reduce, transport.reduces

    def run_rules(buf, root):
        reduce_buffer(buf, info, op, size, lambda wire, o: reduce(wire, o, root), native, receives=rank == root)

    return run_rules


def as_is(info: _dtypes.DType, op: str, native) -> bool:
    """Whether values of ``info`` reduced with ``op`` travel as they are (no widening, no ordered-integer
    mapping, no bool bytes): then a transport's direct call gives :func:`reduce_buffer`'s bits."""
    return travels_as_is(info, op, value_dtype(info, op, native))


def travels_as_is(info: _dtypes.DType, op: str, value: np.dtype) -> bool:
    """:func:`as_is`, given the dtype the values are reduced in (``value_dtype``, a plan's ``dtype``)."""
    return value == info.storage and info.kind != "b" and not (op in MINMAX and info.kind == "f")


def scatter_runner(transport, info: _dtypes.DType, op: str, size: int, general):
    """A callable ``run(send, out)`` that reduce-scatters the contiguous ``send`` into ``out`` (this
    rank's block) under the host rules: the transport's direct call (:meth:`HostTransport.fast_blocks`)
    where the values travel as they are and ``op`` is not ``mean``, else ``general`` (which runs
    :func:`reduce_buffer`). Build once per (transport, dtype, op) and keep it."""
    if op != "mean" and as_is(info, op, transport.reduces):
        run = transport.fast_blocks("reduce_scatter", op, info.storage, size)
        if run is not None:
            return run
    return general

"""The NaN check (``COLLECTIVES_CHECK_NAN=1``): a floating reduction of NaN or inf is refused on every rank.

The engine calls :func:`check` where a reduction has been validated and agreed, before anything moves
(``_comm.validate.prepare`` for ``allreduce``, ``reduce`` and ``reduce_scatter``, whatever front end made
them: the torch backend, the gradient buckets; the hot path's cached call of a NumPy or CPU torch array,
:func:`guarded`; ``_tree.allreduce_tree`` for trees, so also ``DistributedOptimizer(overlap=False)`` and
the optax wrapper). Each rank finds the first non-finite element
of its input (:func:`first`), the ranks exchange ``(leaf, index, kind)`` in one fixed-size allgather of 24
bytes per rank on the transport's agreement channel, and if any rank found one every rank raises the same
:class:`~collectives.NonFiniteError`, naming each such rank, and dumps its flight record.

The scan is one pass: the sum of squares (float32 and float64: BLAS's dot of the input with itself) or the
sum (float16, accumulated in float32; longdouble; complex). Either is finite only if every element is: the
square of NaN or of an infinity is NaN or inf, and NaN and inf stay NaN or inf through any addition
(``inf + -inf`` is NaN), so a finite result clears the input. Only a non-finite one (a non-finite element,
or finite ones whose squares or sum overflow) is scanned again, element by element (``isfinite``), for the
first non-finite element, which may not exist (the overflow). bfloat16 (kept as its 16 bits) is looked at
bit by bit. Measured costs are in docs/performance.md (``benchmarks/bench_nan_check.py``).
"""

from __future__ import annotations

import numpy as np

from . import _agree
from ._errors import NonFiniteError

KINDS = ("", "nan", "inf", "-inf")  # the kind codes the ranks exchange (0: nothing found)
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_BLAS = (_F32, np.dtype(np.float64))


def checks(info) -> bool:
    """Whether inputs of ``info`` (a ``_dtypes.DType``) are scanned: floats (bfloat16 too) and complex."""
    return info is not None and info.kind in "fc"


def first(view: np.ndarray, info) -> tuple[int, int] | None:
    """``(flat index, kind code)`` of the first non-finite element of ``view`` (a host view of a float or
    complex array, ``info`` its dtype entry), or None when every element is finite."""
    flat = view.reshape(-1)
    if flat.size == 0:
        return None
    if info.name == "bfloat16":  # the storage bits: exponent all ones is inf or NaN
        bad = (flat & 0x7F80) == 0x7F80
        if not bad.any():
            return None
        i = int(bad.argmax())
        bits = int(flat[i])
        return i, (1 if bits & 0x7F else 3 if bits & 0x8000 else 2)
    with np.errstate(all="ignore"):  # an overflow is expected (then the exact scan below)
        if flat.dtype in _BLAS:  # the sum of squares, BLAS's dot: the fastest pass measured
            total = np.dot(flat, flat)
        else:
            total = np.add.reduce(flat, dtype=_F32 if flat.dtype == _F16 else None)
    if np.isfinite(total):
        return None
    bad = ~np.isfinite(flat)
    if not bad.any():  # finite elements whose sum overflowed
        return None
    i = int(bad.argmax())
    value = flat[i]
    if flat.dtype.kind == "c":
        value = value.real if not np.isfinite(value.real) else value.imag
    return i, (1 if np.isnan(value) else 3 if value < 0 else 2)


def scan(parts) -> tuple[int, int, int] | None:
    """``(part number, flat index, kind code)`` of the first non-finite element among ``parts``, an
    iterable of ``(view, info)`` (None for a part that is not scanned: not in host memory, not a float),
    or None when all are finite."""
    for n, part in enumerate(parts):
        if part is not None and checks(part[1]):
            hit = first(*part)
            if hit is not None:
                return (n, *hit)
    return None


def guarded(transport, what: str, info, run, *, blocks: bool = False):
    """The hot path's cached call ``run`` of a reduction of ``info`` (``run(x)``; ``run(x, out)`` with
    ``blocks``: reduce_scatter, or reduce's ``run(x, root)``) preceded by the check of ``x`` (:func:`first`, :func:`check`): what the
    engine caches instead of ``run`` while the check is on, so that the hot path's own code is the same
    with the check on or off (and costs nothing more when it is off)."""
    if blocks:

        def checked_blocks(x, out):
            hit = first(x, info)
            check(transport, what, None if hit is None else (0, *hit))
            run(x, out)

        return checked_blocks

    def checked(x):
        hit = first(x, info)
        check(transport, what, None if hit is None else (0, *hit))
        run(x)

    return checked


def check(transport, what: str, found: tuple[int, int, int] | None, leaf_name=None) -> None:
    """Raise :class:`~collectives.NonFiniteError` on every rank of ``transport`` if any rank's input held a
    non-finite value; else return. ``found``: this rank's ``(leaf number, flat index, kind code)`` (see
    :func:`scan`) or None; ``leaf_name(n)``: the name of leaf number n (a tree's path, the same on every
    rank: the ranks agreed on the tree; None: a single array).
    Collective: every rank calls it at the same point (one allgather of 24 bytes each; none at size 1)."""
    table = _agree.gather_rows(transport, np.array(found if found is not None else (0, -1, 0), dtype=np.int64))
    bad = {r: (leaf_name(int(leaf)) if leaf_name is not None else "", int(index), KINDS[int(kind)])
           for r, (leaf, index, kind) in enumerate(table.tolist()) if kind}
    if bad:
        _agree.refuse(NonFiniteError(what, bad), dump=True)  # every rank raises (and dumps) alike

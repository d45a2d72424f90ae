"""Reproducible sums (``reproducible=True``, ``allreduce_units``) as a collective's steps.

The exponent codes allreduced with max at the call (:func:`exponents`), then the exact fixed-point words
of ``_reproducible`` reduced with the collective's operation and decoded (:func:`summing`; a large
blocking allreduce as a reduce-scatter and an allgather, :func:`summing_split`); the blocking calls reuse
their buffers (:func:`reused`). :func:`allreduce` and :func:`allreduce_steps` are the same sum, blocking
and in steps, for the tree and bucket layers (``Engine.summing``, ``Engine.summing_steps``).
"""

from __future__ import annotations

import numpy as np

from .. import _agree, _call, _dtypes, _reproducible
from . import rules, steps


# (both read through the communicator, ``comm.SPLIT_BYTES``: a test sets them on one instance)
SCRATCH_BYTES = 256 * 2**20  # the largest buffer a communicator keeps for reproducible sums
# a blocking reproducible allreduce with this many bytes of words or more: reduce-scatter of the words,
# each rank decodes its block, allgather of the results (summing_split); below it one allreduce of the
# words is faster (MPI's node-shared path: 1.3 against 6 to 10 ms at 2 MiB of words, 2 ranks)
SPLIT_BYTES = 32 * 2**20


def summing(comm, transport, operation: str, stack, info, op: str, asynchronous: bool, extra: tuple = (), *,
            receives: bool = True, out=None, calling=None, one_each: bool = False):
    """The steps of a reproducible sum or mean (``_reproducible``) of ``stack``, this rank's units
    (``(k, n)``, contiguous, ``info``'s storage dtype): the exponent codes allreduced with max at the
    call (:func:`exponents`), then the fixed-point words with ``operation`` (allreduce; reduce to
    ``extra[0]``; reduce_scatter: each rank its block), decoded into ``out`` where ``receives``.
    ``calling``: the call's description (``_call``; default: the one the validation made). A blocking
    allreduce may take the transport's one pass (``sums_in_one_pass``) where every rank holds one unit:
    ``one_each`` says so (an allreduce with ``reproducible=True``, a tree's bucket: ``out`` itself);
    else (``allreduce_units``, whose ranks may hold different numbers of units) the ranks vote first."""
    size = comm._size
    calling = comm._calling if calling is None else calling
    if operation == "allreduce" and not asynchronous and size > 1 and transport.sums_in_one_pass(out.reshape(-1)):
        # every rank on one node: the transport sums every rank's terms at once (the node-shared window),
        # the same bits as the two collectives below, no codes or words on the wire; for allreduce_units,
        # where every rank holds one unit (a vote of 8 bytes first: the ranks' counts may differ)
        src = None  # (one_each given: stack is out itself, summed in place)
        if not one_each:
            vote = _agree.Ballot({"one each": "all"})
            yield steps.Step(transport, "allreduce", (vote.fill({"one each": stack.shape[0] == 1}), "max"))
            one_each = vote.result()["one each"]
            src = stack[0]  # allreduce_units: the pass reads the one unit where it lies, the result lands in out
        if one_each:
            def kernel(terms, result):
                _reproducible.sum_terms(terms, info, op, result)

            yield steps.Step(transport, "allreduce_exact", (out.reshape(-1), f"reproducible {op}", kernel, src))
            return
    n = _reproducible.elements(stack.shape[1], info)
    codes = _reproducible.codes(stack, info, out=reused(comm, "codes", _reproducible.code_dtype(info), n,
                                                        asynchronous))
    exponents(comm, transport, codes, asynchronous, calling)
    tail = operation != "reduce_scatter"
    wire = reused(comm, "words", np.dtype(np.float64), _reproducible.wire_size(stack.shape[1], info, tail),
                  asynchronous)
    if operation == "reduce_scatter":
        _reproducible.encode(stack, info, codes, blocks=size, tail=False, out=wire)
        block = np.empty(wire.size // size, dtype=wire.dtype)
        yield steps.Step(transport, "reduce_scatter", (wire, block, "sum"))
        m = codes.size // size
        _reproducible.decode(block, info, codes[comm.rank * m:(comm.rank + 1) * m], op, out, terms=size)
        return
    if (operation == "allreduce" and not asynchronous and size > 1 and info.kind == "f"
            and stack.shape[1] % size == 0 and wire.nbytes >= comm.SPLIT_BYTES):
        yield from summing_split(comm, transport, stack, info, op, codes, out)
        return
    _reproducible.encode(stack, info, codes, out=wire)
    yield steps.Step(transport, operation, (wire, "sum", *extra))
    if not receives:
        return
    terms = int(wire[-1])
    if terms > _reproducible.MAX_TERMS:  # (allreduce_units only: every rank learns it alike)
        raise ValueError(f"allreduce_units: {terms} units on all ranks together, more than a reproducible sum "
                         f"takes ({_reproducible.MAX_TERMS}); sum the units in groups of at most "
                         f"{_reproducible.MAX_TERMS} and then the groups' results")
    _reproducible.decode(wire, info, codes, op, out)


def summing_split(comm, transport, stack, info, op: str, codes, out):
    """The words' allreduce of :func:`summing` as a reduce-scatter, each rank decoding only its block
    (every block carries the count of units in a last word), then an allgather of the decoded values
    into ``out``: the same bits on every rank (each element is decoded once, its bits moved), half the
    bytes of the words' second half on the wire, and 1/size of the decoding per rank."""
    size, n = comm._size, stack.shape[1]
    m = n // size
    per = _reproducible.wire_size(m, info)  # a block's words and its count
    wire = reused(comm, "words", np.dtype(np.float64), size * per, False)
    for b in range(size):
        _reproducible.encode(stack[:, b * m:(b + 1) * m], info, codes[b * m:(b + 1) * m],
                             out=wire[b * per:(b + 1) * per])
    block = np.empty(per, dtype=np.float64)
    yield steps.Step(transport, "reduce_scatter", (wire, block, "sum"))
    terms = int(block[-1])  # every block's count is the total: the same on every rank
    if terms > _reproducible.MAX_TERMS:
        raise ValueError(f"allreduce_units: {terms} units on all ranks together, more than a reproducible sum "
                         f"takes ({_reproducible.MAX_TERMS}); sum the units in groups of at most "
                         f"{_reproducible.MAX_TERMS} and then the groups' results")
    mine = np.empty(m, dtype=out.dtype)
    _reproducible.decode(block, info, codes[comm.rank * m:(comm.rank + 1) * m], op, mine)
    yield steps.Step(transport, "allgather", (mine, out.reshape(size, m)))


def reused(comm, what: str, dtype: np.dtype, n: int, asynchronous: bool) -> np.ndarray:
    """``n`` elements of ``dtype`` for a reproducible sum's ``what`` ("codes", "words"): a buffer the
    blocking calls reuse (writing into memory already mapped is much faster than into a new large
    array), up to :data:`SCRATCH_BYTES`; a new one for an asynchronous call (it is in use until
    ``wait()``) or a larger buffer."""
    if asynchronous or n * dtype.itemsize > comm.SCRATCH_BYTES:
        return np.empty(n, dtype=dtype)
    buf = comm._scratch.get(what)
    if buf is None or buf.dtype != dtype or buf.size < n:
        buf = comm._scratch[what] = np.empty(n, dtype=dtype)
    return buf[:n]


def exponents(comm, transport, codes, asynchronous: bool, calling) -> None:
    """The first collective of a reproducible sum: the exponent codes allreduced with max, completed at
    the call in both modes (the words' collective needs its result; a transfer started later, at a
    ``done()`` on one rank and a ``wait()`` on another, could meet the ranks' other collectives in
    another order). Asynchronous: started with its fingerprint, as every asynchronous transfer is."""
    cinfo = _dtypes.from_numpy(codes.dtype)
    if asynchronous:
        for request in rules.reducing(comm, transport, "allreduce", codes, cinfo, "max", (), steps.nothing, calling=calling):
            request.wait()
        return
    transport.caller = calling
    try:
        rules.runner(comm, transport, cinfo, "max")(codes)
    finally:
        transport.caller = None


def allreduce(comm, transport, buf, info, op: str) -> None:
    """Allreduce the contiguous host buffer ``buf`` of ``info``'s storage dtype in place with the
    reproducible ``op`` (sum or mean, ``_reproducible``), blocking."""
    calling = _call.describe("allreduce", f"reproducible {op}", info, _reproducible.elements(buf.size, info))
    for step in summing(comm, transport, "allreduce", buf.reshape(1, -1), info, op, False, out=buf,
                        calling=calling, one_each=True):
        transport.caller = calling
        try:
            getattr(transport, step.operation)(*step.args)
        finally:
            transport.caller = None


def allreduce_steps(comm, transport, buf, info, op: str, finish):
    """:func:`allreduce` as the asynchronous steps of a :class:`~collectives.Handle` (a generator of
    requests, started here up to the first), returning ``finish()``."""
    calling = _call.describe("allreduce", f"reproducible {op}", info, _reproducible.elements(buf.size, info))
    for step in summing(comm, transport, "allreduce", buf.reshape(1, -1), info, op, True, out=buf,
                        calling=calling):
        yield steps.started(transport, calling, step.operation, step.args)
    return finish()

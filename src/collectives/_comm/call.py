"""The engine's drivers: one call, from the thread guard to its result, blocking or asynchronous.

The Communicator binds these as its own ``_transport_for``, ``_blocking`` and ``_async`` (instance
attributes that the timeline and tests may replace on one communicator): :func:`transport_for`, the one
place a transport is chosen; :func:`blocking`, the blocking driver (``steps.now``) with the call's record;
:func:`asynchronous`, a :class:`~collectives.Handle` over :func:`requests`, the asynchronous driver, and
:func:`sweep`, which releases dropped handles. :func:`cache` puts a call the general path chose into the
hot path's tables (``Communicator._fast_path`` decides whether it may); :func:`close` releases what a
communicator owns.
"""

from __future__ import annotations

from .. import _arrays, _buckets, _call, _dtypes, _finite, _records, _reduction, _threads
from .._records import START, _clock, _get_ident
from .._backends import closed as _closed
from .._backends import factory
from .._backends.closed import CLOSED
from .._errors import BackendUnavailableError, CollectiveError, reraise, transport_failure
from .._handles import Handle, settle_all
from .._threads import enter as _enter, leave as _leave, refuse as _refuse_thread
from . import rules
from .steps import PLAIN, Step, described, nothing, now, started

CLOSE_WAIT_S = 30.0  # how long close() waits for handles not yet waited, without COLLECTIVES_TIMEOUT
MAX_OUTSTANDING = 64  # asynchronous calls in flight per communicator before the oldest is completed (sweep)
_P2P = ("send", "recv")  # the handles of point-to-point calls (only two ranks make each: see sweep)


def transport_for(comm, device: tuple[int, int]):
    """The transport for an array on ``device`` (a DLPack ``(type, id)`` pair).

    Host memory goes to the host transport (MPI or self), which moves NumPy buffers. CUDA memory goes
    to a device transport (NCCL, else CUDA-aware MPI, else staged through host memory), made on first
    use per device; device transports take arrays (``array_level``), since they need the library's
    stream as well as the pointer.
    """
    if comm._host is CLOSED:
        raise BackendUnavailableError(_closed.MESSAGE)
    if comm._host.failed is not None:  # a timeout or a mismatch failed it: it stays failed
        comm._host.usable()
    if device[0] in _arrays.HOST_DEVICE_TYPES:
        return comm._host
    if device[0] in (_arrays.CUDA, _arrays.CUDA_MANAGED):
        hit = comm._devices.get(device)
        if hit is None:
            hit = comm._devices[device] = factory.device_transport(comm._engine, device)
        return hit
    raise BackendUnavailableError(
        f"array on {_arrays.device_name(device)}: no transport for this device; copy it to host memory"
    )


def blocking(comm, steps):
    """Run a collective's steps to completion (``steps.now``); its record says how that ended. Dropped
    handles that have completed are released first (:func:`sweep`)."""
    if comm._outstanding:
        sweep(comm)
    comm._current = None
    try:
        result = now(steps, comm)
    except BaseException as exc:
        rec = comm._current
        if rec is not None:
            _records.finish(rec, exc)
        raise
    rec = comm._current
    if rec is not None:
        _records.finish(rec)
    return result


def asynchronous(comm, what: str, define, *args) -> Handle:
    """A :class:`Handle` running the steps ``define(*args, True)`` (see :func:`requests`): validation (and
    checked mode's agreement) runs here and a TypeError/ValueError is raised here, as is the error of a
    failed or closed communicator. Errors of the collective itself are raised by ``wait()``."""
    comm._host.usable()  # a failed (or closed) communicator refuses at the call, as the blocking calls do
    if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
        _threads.settle()
    if not _enter(False):  # another thread is inside a collective: refused (_threads)
        _refuse_thread(what)
    comm._current = rec = None
    try:
        if comm._outstanding:
            sweep(comm)
        steps = define(*args, True)
        comm._calling = None
        try:
            first = next(steps)  # validates, up to the first transfer
        finally:
            rec = comm._current
        calling = comm._calling  # (validate.prepare described it)
    except StopIteration as stop:
        if rec is not None:
            _records.finish(rec)
        return Handle.completed(what, stop.value)
    except BaseException as exc:
        if rec is not None:
            _records.finish(rec, exc)
        if isinstance(exc, BackendUnavailableError) or not isinstance(exc, Exception):
            raise  # no transport for the array, a closed communicator: nothing started
        err = exc if isinstance(exc, CollectiveError) else transport_failure(exc, what)
        if err is None:
            raise
        return Handle.completed(what, error=err)
    finally:
        _leave()
    return Handle(what, requests(comm, steps, first, calling), comm._outstanding, comm._host.fail, rec)


def staged(comm, what: str, define, *args, async_op: bool = False):
    """A device transport's call through host memory: the host collective ``what``'s steps
    ``define(comm, *args, asynchronous)`` on the transport's host copy, for the call the engine is running
    now (``Engine.staged``). That call is already validated, recorded and, in checked mode, agreed: the
    steps check and describe the host copy (the description the transport's fingerprint carries) but
    begin no record of their own and agree on nothing (``comm._staging``, ``validate.prepare``). Blocking:
    run by the blocking driver (``steps.now``); ``async_op``: in a :class:`Handle` (:func:`asynchronous`,
    without a record). An MPI error becomes the :class:`CollectiveError` of ``what``."""
    rec, calling, was = comm._current, comm._calling, comm._staging
    comm._staging = True
    try:
        if async_op:
            return asynchronous(comm, what, define, comm, *args)
        return now(define(comm, *args, False), comm)
    except Exception as exc:  # noqa: BLE001 - re-raised (MPI errors as CollectiveError)
        reraise(exc, what)
    finally:
        comm._staging = was
        comm._current, comm._calling = rec, calling


def sweep(comm) -> None:
    """Before a call (asynchronous, or blocking on the general path, a barrier, an object collective):
    move on the outstanding handles whose transfers have completed, oldest first, stopping at the first
    collective still in flight (one ``MPI_Test`` each; a message still in flight is passed over: it may
    wait for its peer's later call), so that a handle dropped without ``wait()`` is released with its
    buffers once done, not only at ``close()``; and complete the oldest collective while more than
    :data:`MAX_OUTSTANDING` are in flight (MPI moves a non-blocking collective only inside MPI calls:
    without a bound, dropped handles would pile up, each with its buffers). Every rank issues the same
    collectives in the same order, so every rank completes the same oldest call here; a wait is
    bounded as ``wait()`` is. An error stays with its handle."""
    outstanding = comm._outstanding
    for h in list(outstanding.values()):
        if not h._progress():
            if h.what in _P2P:
                continue
            if len(outstanding) <= MAX_OUTSTANDING:
                break
            try:
                h.wait()
            except Exception:  # noqa: BLE001 - the handle keeps it: its own wait() raises it
                pass
        outstanding.pop(id(h), None)  # (finishing removed it already; a handle that failed too)


def requests(comm, steps, step: Step, calling):
    """The asynchronous driver of a collective's steps: each transfer started with the transport's
    ``start`` (a device transport's on its own stream, after the caller's current stream; a reduction
    in its wire steps, ``rules.reducing``), its request yielded to the Handle, which moves this on once
    the request is complete (``_handles``). ``calling``: the call as the user made it (``_call``), which
    the transport's fingerprint beside each host transfer carries."""
    while True:
        got = None
        if step.device:
            got, request = step.transport.start(step.operation, *step.args)
            yield request
        elif step.rules is not None:
            info, op, extra, receives, out = step.rules
            yield from rules.reducing(comm, step.transport, step.operation, step.args[0], info, op, extra,
                                      nothing, receives=receives, out=out, calling=calling)
        else:
            yield started(step.transport, calling, step.operation, step.args)
        try:
            step = steps.send(got)
        except StopIteration as stop:
            return stop.value


BLOCKS = object()  # in the keys of the asynchronous allgather's and reduce_scatter's tables in ``comm._fast_async``
# (no op is such a key: only this module has BLOCKS)


def async_key(kind: str, op=None) -> tuple:
    """The key of the asynchronous ``kind`` ("allgather", or "reduce_scatter" with ``op``) in
    ``comm._fast_async``: ``(BLOCKS, kind)`` or ``(BLOCKS, kind, op)``, where :func:`_cache_start_blocks` puts
    its entries and ``Communicator.allgather``/``reduce_scatter`` look for them."""
    return (BLOCKS, kind) if op is None else (BLOCKS, kind, op)


def cache_start(comm, op, x, a, info, transport) -> None:
    """Put the asynchronous allreduce of (``op``, ``x``'s dtype) on ``transport`` in the hot path's table
    of asynchronous calls (``comm._fast_async``, read by ``Communicator.allreduce``), once a fully
    validated asynchronous call of it has completed (``Communicator._fast_path`` has checked the array):
    for a pair that travels as it is (``_reduction.travels_as_is``: no widening, no ordered integers, no
    bool bytes), where the asynchronous driver runs one transfer, ``transport.start`` of the wire op
    beside the call's description, and, for ``mean``, ``_dtypes.divide`` after it. The cached entry is a
    generator function ``steps(buf, x)`` of those same steps for a :class:`Handle` (:func:`hot_async`):
    the general path's transfer and finish for this pair, without the validation, the record and the
    plan it has already made once.

    Not where ``COLLECTIVES_CHECK_NAN`` scans this pair's inputs first (the general path's step). The
    entry is marked ``asynchronous`` (the timeline times it from the call to its completion:
    ``Engine.instrument_hot``)."""
    if op.__class__ is tuple:  # ("allgather", dtype) or ("reduce_scatter", op, dtype): the blocking hot path's keys
        _cache_start_blocks(comm, op[0], op[1] if op[0] == "reduce_scatter" else None, x, info, transport)
        return
    if comm._check_nan and _finite.checks(info):
        return
    table = comm._fast_async.setdefault(op, {})
    if x.dtype in table:
        return
    plan = _dtypes.wire(info, op, transport.reduces)
    if plan.ordered is not None or not _reduction.travels_as_is(info, op, plan.dtype):
        return
    with _call.naming():  # the entry serves calls of any naming: cache the plain head (as steps.described)
        plain = _call.head("allreduce", op, info)
    now, head, wire, divide, size = _call.naming_now, _call.head, plan.op, plan.divide, comm._size
    begin, torch = transport.fast_start(wire, info.storage), a is _arrays.TORCH
    if begin is None:  # the transport's own start, through its dispatch
        def begin(buf, start=transport.start):
            return start("allreduce", buf, wire)

    def steps(buf, x):
        transport.caller = (plain if now() is PLAIN else head("allreduce", op, info)) + (buf.size,)
        try:
            request = begin(buf)
        finally:
            transport.caller = None
        yield request
        if divide:
            _dtypes.divide(buf, size)
        if torch:
            _arrays.bump_versions((x,))  # written behind autograd's back: as under no_grad
        return x

    steps.asynchronous = True  # type: ignore[attr-defined]
    comm._hot_names.setdefault(steps, ("allreduce", op, info.name))
    table.setdefault(x.dtype, steps)


def _cache_start_blocks(comm, kind: str, op: str | None, x, info, transport) -> None:
    """Put the asynchronous allgather (``kind``; ``op`` None) or reduce_scatter with ``op`` of ``x``'s dtype on
    ``transport`` in the hot path's table of asynchronous calls (``comm._fast_async[async_key(kind, op)]``, read by
    ``Communicator.allgather`` and ``reduce_scatter``), once a fully validated asynchronous call of it has completed
    (``Communicator._fast_path`` has checked the array): a generator function ``steps(send, (out, result,
    written))`` of the general path's one transfer, ``transport.start`` of ``send`` into ``out`` beside the call's
    description (a reduce_scatter: only a pair whose values travel as they are, its wire op, and for ``mean``
    ``_dtypes.divide`` after it, as ``cache_start``'s allreduce), without the validation, the record and the plan it
    has already made once; then the result (``out``, a new tensor over it, or the caller's ``out``), the tensor
    ``written`` given a new version (as the general path's write-back). Not where ``COLLECTIVES_CHECK_NAN`` scans a
    reduction's inputs first."""
    if op is not None and comm._check_nan and _finite.checks(info):
        return
    table = comm._fast_async.setdefault(async_key(kind, op), {})
    if x.dtype in table:
        return
    wire = divide = None
    if op is not None:
        plan = _dtypes.wire(info, op, transport.reduces)
        if plan.ordered is not None or not _reduction.travels_as_is(info, op, plan.dtype):
            return
        wire, divide = plan.op, plan.divide
    with _call.naming():  # the entry serves calls of any naming: cache the plain head (as steps.described)
        plain = _call.head(kind, op, info)
    now, head, size, start = _call.naming_now, _call.head, comm._size, transport.start

    def steps(send, into):
        out, result, written = into
        transport.caller = (plain if now() is PLAIN else head(kind, op, info)) + (send.size,)
        try:
            request = (start("allgather", send, out.reshape(size, -1)) if wire is None else
                       start("reduce_scatter", send, out.reshape(-1), wire))
        finally:
            transport.caller = None
        yield request
        if divide:
            _dtypes.divide(out, size)
        if written is not None:
            _arrays.bump_versions((written,))  # written behind autograd's back: as under no_grad
        return result

    steps.asynchronous = True  # type: ignore[attr-defined]
    comm._hot_names.setdefault(steps, (kind, op, info.name))
    table.setdefault(x.dtype, steps)


HOT_ASYNC = "hot path, asynchronous"  # the path of a record made by hot_async


def hot_async(comm, steps, buf, x, op: str | None, collective: str = "allreduce", into=None):
    """The asynchronous hot path of ``allreduce(x, async_op=True)`` (``Communicator.allreduce``), and of
    ``allgather`` and ``reduce_scatter`` (``collective``; ``into``: what their steps write and return, see
    :func:`_cache_start_blocks`): a :class:`Handle` over the cached ``steps`` (:func:`cache_start`) of
    ``buf`` (``x``, or a CPU tensor's NumPy view), started at the call as the general path's are. What
    every asynchronous call has stays: the thread guard, dropped handles released first (:func:`sweep`),
    the transfer with its fingerprint, the wait's bounds, the failure of the communicator on a timeout. Its
    flight-recorder record is a record as ``record.begin`` makes them (``_records``: a list, finished by
    the handle), less the call site: the path :data:`HOT_ASYNC`, the op as given, dtype and shape, thread
    and start."""
    if _threads.settle is not None:  # a jitted JAX computation's collectives first (_threads)
        _threads.settle()
    if not _enter(False):  # another thread is inside a collective: refused (_threads)
        _refuse_thread("allreduce")
    try:
        if comm._outstanding:
            sweep(comm)
        ring = comm._ring
        rec = None
        if ring is not None:
            n = comm._seq = comm._seq + 1
            rec = ring[n & comm._mask] = [n, collective, op, None, x.dtype, x.shape, None, HOT_ASYNC, None, None,
                                          None, _get_ident(), _clock(), None, None, None]  # (_records: SEQ ... ON)
            comm._last_activity = rec[START]  # (as record.begin: the stall inspector's choice of communicator)
        return Handle(collective, steps(buf, x if into is None else into), comm._outstanding, comm._host.fail, rec)
    finally:
        _leave()


def cache(comm, op, x, a, info, run, blocks: dict | None) -> None:
    """Put ``run``, the call the general path has just chosen for a fully validated call that the hot
    path may repeat (``Communicator._fast_path`` has checked the array), in the hot path's table: with the
    call's description beside it where the transport checks its calls (``steps.described``), guarded by
    the NaN check where ``COLLECTIVES_CHECK_NAN`` asks for it, and named for the flight recorder.

    ``blocks``: the table of reduce_scatter, alltoall, allgather and reduce, keyed ``("reduce_scatter", op,
    dtype)``, ``("alltoall", dtype)``, ``("allgather", dtype)`` and ``("reduce", op, dtype)`` (``op`` is that
    key with the NumPy dtype: no op of one can find an entry of another; a torch tensor's entry has the
    tensor's dtype), taking ``run(x, out)`` (reduce: ``run(x, root)``) on NumPy arrays (a tensor's view)."""
    if blocks is not None:
        key = op if a is _arrays.NUMPY else (*op[:-1], x.dtype)  # (a torch tensor's: its own dtype)
        if key not in blocks:
            reduced = op[1] if op[0] in ("reduce_scatter", "reduce") else None
            run = described(comm._host, run, op[0], reduced, info)
            if reduced is not None and comm._check_nan and _finite.checks(info):  # COLLECTIVES_CHECK_NAN
                run = _finite.guarded(comm._host, op[0], info, run, blocks=True)
            comm._hot_names.setdefault(run, (op[0], reduced, info.name))
            blocks[key] = run
        return
    table = comm._fast_broadcast if op == "broadcast" else comm._fast.setdefault(op, {})
    if x.dtype in table:
        return
    collective, reduced = ("broadcast", None) if op == "broadcast" else ("allreduce", op)
    run = described(comm._host, run, collective, reduced, info)
    if reduced is not None and comm._check_nan and _finite.checks(info):  # COLLECTIVES_CHECK_NAN: the
        run = _finite.guarded(comm._host, collective, info, run)  # scan and the exchange, then the call
    comm._hot_names.setdefault(run, (collective, reduced, info.name))
    table.setdefault(x.dtype, run)


def close(comm) -> None:  # (Communicator.close)
    """Release this communicator's resources (its MPI duplicate, its shared-memory window, device
    communicators, the communicators :meth:`split` made). Collective: every rank calls it
    (``finalize()`` and interpreter exit do). Idempotent.

    Asynchronous collectives not yet waited are completed first (their results land where
    ``wait()`` would have put them), for at most ``COLLECTIVES_TIMEOUT`` (else 30) seconds; if some
    cannot complete (a rank never issued the matching call), the rest is released and
    :class:`CollectiveError` names them (the MPI communicator is then left to the end of the process)."""
    failure = None
    pending, comm._outstanding = list(comm._outstanding.values()), {}
    if pending and comm._host is not CLOSED:  # complete them first (their buffers are in use), bounded
        try:
            settle_all(pending, comm._host.timeout or CLOSE_WAIT_S, "close()")
        except CollectiveError as exc:
            failure = exc
    subs, comm._subs = comm._subs, []
    comm._derived = {}
    for sub in subs:  # in the order they were made: the same on every rank of each
        sub.close()
    host, comm._host = comm._host, CLOSED  # every later use raises BackendUnavailableError (_closed)
    comm._fast, comm._fast_broadcast, comm._fast_blocks, comm._fast_async, comm._runners = {}, {}, {}, {}, {}
    comm._pool = _buckets.Pool()
    comm._scratch = {}
    comm._plans.clear()
    devices, comm._devices = list(comm._devices.values()), {}
    for d in devices:  # device transports first: NCCL communicators were set up over the host one
        d.close()
    if host is not CLOSED and failure is None:  # not under a request still pending on it
        host.close()
    if failure is not None:
        raise failure

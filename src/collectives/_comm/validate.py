"""Validation: every check of a call, before any communication, and checked mode's agreement on it.

:func:`prepare` is the first step of every array collective: the array's adapter and device, the op,
root, blocks and units rules, the transport for the device (``Communicator._transport_for``), the host
view and the dtype/op pair, the reproducible-sum choice; then the call's description (``_call``), checked
mode's agreement (``_agree``) and the NaN check (``_finite``). It starts the call's record (``record``).
"""

from __future__ import annotations

import math

import numpy as np

from .. import _agree, _arrays, _call, _dtypes, _finite, _reproducible
from .._records import NBYTES, ON, SHAPE
from . import record

OUT_SHAPES = {"allgather": "(size, *x.shape)", "reduce_scatter": "(x.shape[0] // size, *x.shape[1:])"}
UNSET = object()  # "argument not part of this collective" (None is a value users may pass by mistake)


def check_root(comm, root, name: str = "root", what: str = "", also: str = "") -> int:
    """``root`` as a rank of this communicator, else TypeError/ValueError; ``name`` is the argument's
    name in the messages (a point-to-point call's ``dst``/``src``, with ``what`` the call and ``also``
    what else the argument may be)."""
    prefix = f"{what}: " if what else ""
    if isinstance(root, (bool, np.bool_)) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"{prefix}{name} must be an integer rank{also}, got {type(root).__name__} {root!r}")
    root = int(root)
    if not 0 <= root < comm.size:
        raise ValueError(f"{prefix}{name}={root} is out of range for a communicator of size {comm.size} "
                         f"(valid: 0..{comm.size - 1})")
    return root


def check_blocks(comm, collective: str, x) -> None:
    """``x``'s leading dimension must split into ``size`` equal blocks (reduce_scatter, alltoall)."""
    shape = tuple(getattr(x, "shape", ()))
    if not shape:
        raise ValueError(f"{collective} needs an array with at least one dimension (its leading dimension "
                         f"is split into {comm.size} blocks, one per rank), got a 0-d array; reshape it")
    if shape[0] % comm.size:
        raise ValueError(f"{collective}: the leading dimension of x (shape {shape}) must be divisible by the "
                         f"communicator's size {comm.size}, got {shape[0]}; pad x to a multiple of "
                         f"{comm.size} rows")


def out_shape(comm, collective: str, x) -> tuple:
    """The shape of ``collective``'s result for ``x``: allgather's ``(size, *x.shape)``, reduce_scatter's
    ``(x.shape[0] // size, *x.shape[1:])`` (its blocks checked already)."""
    shape = tuple(getattr(x, "shape", ()))
    if collective == "allgather":
        return (comm.size, *shape)
    return (shape[0] // comm.size, *shape[1:])


def check_out(comm, collective: str, x, a, on, out) -> None:
    """``out`` (allgather's and reduce_scatter's): an array of x's library that is written in place (a
    writable NumPy array, a torch tensor, a CUDA array of a library whose arrays are mutable), of x's dtype
    and device (``on``, x's), of the result's shape (:func:`out_shape`); else TypeError (what it is) or
    ValueError (its shape or device)."""
    b = _arrays.adapter(out)  # TypeError for what is not an array
    if b is not a or (b is _arrays.GENERIC and type(out) is not type(x)):
        raise TypeError(f"{collective}: out must be an array of x's library ({type(x).__module__}."
                        f"{type(x).__name__}), got {type(out).__module__}.{type(out).__name__}")
    device = b.device(out)
    if not (b.mutable or (b is _arrays.NUMPY and out.flags.writeable)
            or (b is _arrays.GENERIC and device[0] not in _arrays.HOST_DEVICE_TYPES
                and not type(out).__module__.startswith("jax"))):
        raise TypeError(f"{collective}: out must be an array the collective can write in place (a writable "
                        f"NumPy array, a torch tensor, a CUDA array), got a "
                        f"{'read-only NumPy array' if b is _arrays.NUMPY else type(out).__module__ + ' array'}; "
                        f"leave out unset to get a new array")
    if out.dtype != x.dtype and _dtypes.name_of(out) != _dtypes.name_of(x):  # (names: for the message only)
        raise TypeError(f"{collective}: out must have x's dtype ({_dtypes.name_of(x)}), got "
                        f"{_dtypes.name_of(out)}")
    want = out_shape(comm, collective, x)
    if tuple(out.shape) != want:
        raise ValueError(f"{collective}: out must have shape {OUT_SHAPES[collective]} = {want}, got "
                         f"{tuple(out.shape)}")
    if device != on:
        raise ValueError(f"{collective}: out must be on x's device ({_arrays.device_name(on)}), got "
                         f"{_arrays.device_name(device)}")


def prepare(comm, collective: str, x, op=UNSET, root=UNSET, blocks: bool = False,
            asynchronous: bool = False, reproducible=None, units: bool = False, out=None):
    """Validate a call, choose its transport and, in checked mode, agree on it with the other ranks.

    Every check runs before any communication. In checked mode a rank whose own arguments are invalid
    first tells the others (they wait in the agreement step and raise MismatchError), then raises its
    TypeError/ValueError. Returns ``(adapter, transport, view, info, op, root)``; ``view`` and
    ``info`` (the NumPy view of x's memory and its dtype entry) are None for device transports.
    ``asynchronous`` (``async_op=True``) is part of what the ranks agree on: MPI does not match a
    non-blocking collective with a blocking one. ``reproducible`` (a sum or mean: the caller's argument,
    None for the communicator's default) sets ``comm._repro`` for the call's steps; a reproducible call
    is described, and agreed, with its op named ``"reproducible sum"`` or ``"reproducible mean"``.
    ``units``: ``x`` is a stack of units (``Communicator.allreduce_units``), whose leading dimension may differ
    between ranks (described and agreed by one unit's shape). ``out``: allgather's or reduce_scatter's array
    to write the result into (:func:`check_out`), or None; a local choice, so neither described nor agreed (the ranks' transfers
    are the same either way).

    While ``comm._staging`` (:func:`call.staged`: a device transport's host copy of the call being run) the
    call already has its record and its agreement: ``x`` is checked and described, but no record is begun
    and nothing is agreed (the NaN check still runs, as it did for the host copy).
    """
    args: dict[str, object] = {"async_op": True} if asynchronous else {}
    view = info = None
    comm._repro = False
    staging = comm._staging
    if not staging:
        comm._current = record.begin(comm, collective, x, None if op is UNSET else op,
                                     None if root is UNSET else root, "asynchronous" if asynchronous else "blocking")
    try:
        a = _arrays.adapter(x)
        device = a.device(x)
        if op is not UNSET:
            op = args["op"] = _dtypes.check_op(op)
        if root is not UNSET:
            root = args["root"] = check_root(comm, root)
        if blocks:
            check_blocks(comm, collective, x)
        if units:
            check_units(x)
        if out is not None:
            check_out(comm, collective, x, a, device, out)
        if op is not UNSET and device[0] not in _arrays.HOST_DEVICE_TYPES and (
                reproducible is not False and (reproducible is not None or comm._reproducible)):
            # a reproducible sum of a device array: the host path's, on a host copy (DeviceTransport.reproducible)
            reproducing(comm, args, _dtypes.from_name(_dtypes.name_of(x)), op, reproducible)
        transport = local_transport(comm, device)
        if transport is not None and not transport.array_level:
            view, info = a.host_view(x)
            if op is not UNSET:
                reproducing(comm, args, info, op, reproducible)
    except Exception as exc:
        if comm.check and not staging:  # the others wait in the agreement step: tell them, then raise (see _agree)
            _agree.agree(comm._host, collective, (), None, exc)
        raise
    if transport is None:  # checked mode, an array outside host memory
        agree_device(comm, collective, x, device, units, **args)
        transport = comm._transport_for(device)
    elif not transport.array_level:
        # the call as the user made it (_call): what the fingerprint beside each transfer compares
        shape = view.shape[1:] if units else view.shape  # type: ignore[union-attr]
        comm._calling = _call.describe(collective, args.get("op") if isinstance(op, str) else None, info,  # type: ignore[arg-type]
                                       math.prod(shape), root if isinstance(root, int) else -1)
        if comm.check and not staging:
            agree_host(transport, collective, view, info, shape, **args)
        if comm._check_nan and op is not UNSET and _finite.checks(info):  # COLLECTIVES_CHECK_NAN
            _finite.check(transport, collective, _finite.scan([(view, info)]))
    rec = None if staging else comm._current
    if rec is not None:
        rec[ON] = transport.name if not comm._repro else f"{transport.name}, reproducible"
        if units:  # the ranks' unit counts may differ: what must agree is a unit's shape (as described)
            rec[SHAPE], rec[NBYTES] = tuple(x.shape[1:]), getattr(x, "nbytes", None)
    return a, transport, view, info, op, root


def local_transport(comm, device):
    """``_transport_for(device)``, except in checked mode for an array outside host memory: None.

    Choosing a device transport is itself collective the first time (``_backends.cuda``), so in
    checked mode it must wait until the ranks have agreed on the call (:func:`agree_device`);
    otherwise a rank with a CUDA array among ranks with host arrays would start it alone.
    """
    if comm.check and device[0] not in _arrays.HOST_DEVICE_TYPES:
        return None
    return comm._transport_for(device)


def agree_device(comm, collective, x, device, units: bool = False, **args):
    """Checked mode, an array outside host memory: agree on the call from the array's own shape (a unit's,
    for a stack of units) and dtype, before its transport is chosen."""
    dtype = _dtypes.name_of(x)
    kind = _arrays.DEVICE_NAMES.get(device[0], f"dlpack-device-{device[0]}")
    shape = tuple(getattr(x, "shape", ()))[1 if units else 0:]
    header = (*args.items(), ("shape", shape), ("dtype", dtype), ("device", kind))
    _agree.agree(comm._transport_for(_arrays.HOST), collective, header)


def agree_host(transport, collective, view, info, shape, **args):
    """Checked mode, a host array: agree on the call as the user made it (the op as a front end named it,
    a bucket's structure), its shape and dtype (``_agree``)."""
    named, structure = _call.naming_now()  # the op as the caller named it (_call), as the fingerprint has it
    if named is not None and "op" in args:
        args["op"] = named
    if structure:
        args["structure"] = structure
    header = (*args.items(), ("shape", tuple(shape)), ("dtype", info.name), ("device", "host"))
    _agree.agree(transport, collective, header)


def wants_reproducible(reproducible, default: bool, info, op: str) -> bool:
    """Whether a reduction of ``info`` with ``op`` runs reproducibly: the caller's ``reproducible`` (True:
    validated, TypeError/ValueError for a pair without a reproducible sum), else the communicator's
    ``default`` where it applies (float and complex sums and means)."""
    if reproducible is None:
        return default and _reproducible.applies(info, op)
    if not isinstance(reproducible, (bool, np.bool_)):
        raise TypeError(f"reproducible must be True, False or None (the communicator's default), got "
                        f"{type(reproducible).__name__} {reproducible!r}")
    if reproducible:
        _reproducible.check(info, op)
    return bool(reproducible)


def reproducing(comm, args: dict, info, op: str, reproducible) -> None:
    """Set ``comm._repro``, whether this reduction of ``info`` with ``op`` is a reproducible sum
    (:func:`wants_reproducible`), and then name the op in ``args`` (what the ranks agree on) as
    ``"reproducible sum"`` or ``"reproducible mean"``. The same for a host array and a device array (whose
    ``info`` comes from its dtype's name), so both refuse the same pairs with the same words."""
    _dtypes.check_reduction(info, op)
    comm._repro = wants_reproducible(reproducible, comm._reproducible, info, op)
    if comm._repro:
        args["op"] = f"reproducible {op}"
        if comm._size > _reproducible.MAX_TERMS:
            raise ValueError(f"reproducible sums take at most {_reproducible.MAX_TERMS} terms per "
                             f"element, and this communicator has {comm._size} ranks")


def check_units(x) -> None:
    """A stack of units (:meth:`Communicator.allreduce_units`): at least one dimension, the leading one
    counting this rank's units (0 or more, at most ``MAX_TERMS``)."""
    shape = tuple(getattr(x, "shape", ()))
    if not shape:
        raise ValueError("allreduce_units needs a stack of units: an array whose leading dimension counts this "
                         "rank's units (0 or more), got a 0-d array; pass x[None] for one unit")
    if shape[0] > _reproducible.MAX_TERMS:
        raise ValueError(f"allreduce_units: {shape[0]} units on this rank, more than a reproducible sum takes "
                         f"({_reproducible.MAX_TERMS} on all ranks together)")

"""``Engine``: what the layers built on a Communicator, and the device transports, may use of it.

The Communicator's call engine seen from above: trees and buckets, sharding, the optimizers and the device
transports get an Engine (``engine_of(comm)``, or as an argument) and reach no private attribute of the
Communicator (``tests/unit/test_layers.py`` checks it); the timeline and the flight recorder read the
communicator's record through it.
"""

from __future__ import annotations

import operator

from .. import _arrays
from . import call, movement, p2p, record, reductions, rules, summing, validate

# The host collectives a device transport may run on its host copy (Engine.staged): their steps, and
# whether they take ``reproducible`` (Engine.staged's: False, the host rules, unless the device call is a
# reproducible sum; allreduce_units is always one)
STAGED = {"allreduce": (reductions.allreduce, True), "reduce": (reductions.reduce, True),
          "reduce_scatter": (reductions.reduce_scatter, True), "allreduce_units": (reductions.allreduce_units, False),
          "broadcast": (movement.broadcast, False),
          "allgather": (movement.allgather, False), "alltoall": (movement.alltoall, False),
          "send": (p2p.send, False), "recv": (p2p.recv, False)}


class Engine:
    """The call engine of one :class:`Communicator`, as the layers built on it see it: trees and buckets
    (``_tree``, ``_buckets``), sharding (``_shard``), ``DistributedOptimizer`` and its gradient buckets
    (``_optim``, ``_overlap``) and the device transports (``_backends``) get this object, with public
    methods only, and reach no private attribute of the Communicator (``tests/unit/test_layers.py`` checks
    it). Everything else the layers above need is the Communicator's public API (:attr:`communicator`);
    the device transports, below it, never use that (a call upward: a second record, a second
    agreement): they run their copies in host memory through :meth:`staged`.

    Example:
        >>> import collectives as coll
        >>> from collectives._comm import engine_of
        >>> e = engine_of(coll.world())
        >>> e.communicator is coll.world() and e.size == coll.world().size
        True
        >>> e.host is e.transport_for((1, 0))     # host memory (DLPack kDLCPU) goes to the host transport
        True
    """

    __slots__ = ("__weakref__", "communicator")  # weakly held by the flight recorder (_trace)

    def __init__(self, comm):  # (a Communicator: ``communicator`` imports this module)
        self.communicator = comm

    @property
    def rank(self) -> int:
        return self.communicator.rank

    @property
    def size(self) -> int:
        return self.communicator.size

    @property
    def local_rank(self) -> int:
        return self.communicator.local_rank

    @property
    def local_size(self) -> int:
        return self.communicator.local_size

    @property
    def check(self) -> bool:
        return self.communicator.check

    @property
    def check_nan(self) -> bool:
        """Whether floating reductions' inputs are checked for NaN and inf (``COLLECTIVES_CHECK_NAN``)."""
        return self.communicator._check_nan

    def check_root(self, root) -> int:
        """``root`` as a valid rank of the communicator, or the TypeError/ValueError of the collectives."""
        return validate.check_root(self.communicator, root)

    def check_blocks(self, collective: str, x) -> None:
        """The ValueError of reduce_scatter and alltoall when ``x`` (anything with a ``shape``) has no
        leading dimension that splits into ``size`` equal blocks."""
        validate.check_blocks(self.communicator, collective, x)

    @property
    def host(self):
        """The host transport (MPI or self): raises if the communicator is closed or failed."""
        return self.communicator._transport_for(_arrays.HOST)

    def transport_for(self, device: tuple[int, int]):
        """The transport for arrays on DLPack ``device`` (made on first use: collective for CUDA)."""
        return self.communicator._transport_for(device)

    def device_transports(self) -> dict:
        """The device transports made so far: ``{(dlpack type, id): transport}`` (a copy)."""
        return dict(self.communicator._devices)

    def staged(self, collective: str, x, *args, async_op: bool = False, reproducible: bool = False):
        """Run ``collective`` (a name in :data:`STAGED`) on ``x``, a device transport's copy in host memory,
        with ``args`` as the Communicator's method takes them (``op``, ``root``; ``dst``/``src``, ``tag``),
        as part of the device call this engine is running now, which is already validated, recorded and
        (checked mode) agreed: the host collective's own steps (the host rules, a message's header and the
        receive's check, the deadline transport's bound) driven by the blocking driver, or with
        ``async_op`` in a :class:`~collectives.Handle`; no record of its own, no second agreement
        (``call.staged``). ``reproducible``: a reduction is the host path's reproducible sum (the device
        call is one: ``DeviceTransport.reproducible``), else the host rules. Returns what the
        Communicator's method would (a reduction's result in ``x``, a new array, the sender's rank)."""
        define, reduces = STAGED[collective]
        if reduces:
            args = (*args, reproducible)
        return call.staged(self.communicator, collective, define, x, *args, async_op=async_op)

    def runner(self, transport, info, op: str):
        """The call that allreduces a contiguous host buffer of ``info``'s dtype with ``op`` in place under
        the host rules (the one the general path and the hot path use)."""
        return rules.runner(self.communicator, transport, info, op)

    def reducing(self, transport, operation: str, buf, info, op: str, extra: tuple, finish, **kwargs):
        """The asynchronous steps of a reduction of ``buf`` under the host rules (a generator of requests,
        for a :class:`~collectives.Handle`), returning ``finish()``."""
        return rules.reducing(self.communicator, transport, operation, buf, info, op, extra, finish, **kwargs)

    @property
    def reproducible(self) -> bool:
        """The communicator's default of ``reproducible=`` (:attr:`Communicator.reproducible`)."""
        return self.communicator.reproducible

    def summing(self, transport, buf, info, op: str) -> None:
        """Allreduce the contiguous host buffer ``buf`` of ``info``'s storage dtype in place with the
        reproducible ``op`` (sum or mean, ``_reproducible``), blocking."""
        summing.allreduce(self.communicator, transport, buf, info, op)

    def summing_steps(self, transport, buf, info, op: str, finish):
        """:meth:`summing` as the asynchronous steps of a :class:`~collectives.Handle` (a generator of
        requests, started here up to the first), returning ``finish()``."""
        return summing.allreduce_steps(self.communicator, transport, buf, info, op, finish)

    def reduces_on_the_callers_cpus(self) -> bool:
        """Whether a blocking host allreduce is computed by the ranks' own CPUs (every rank on one node):
        then it is the faster choice for a gradient bucket than an asynchronous one."""
        return self.host.reduces_on_the_callers_cpus()

    @property
    def pool(self):
        """The fused collectives' flat buffers (a ``_buckets.Pool``), released by ``close()``."""
        return self.communicator._pool

    @property
    def plans(self):
        """The tree plan cache (structure -> description, digest, plan), emptied by ``close()``."""
        return self.communicator._plans

    def derived(self, key, make):
        """The communicator ``make()`` made from this one for ``key`` (made on first use, again after it
        was closed): kept, and closed, with this communicator (the gradient collectives' split)."""
        table = self.communicator._derived
        hit = table.get(key)
        if hit is None or hit.closed:
            hit = table[key] = make()
        return hit

    # ---- the timeline's view (_timeline: COLLECTIVES_TIMELINE) ----
    def name(self) -> str | None:
        """The communicator's name (``world``, ``world.1``, ``comm1``)."""
        return self.communicator._name

    def seq_reader(self):
        """A callable of the communicator giving the sequence number of its last call (a C-level read: the
        timeline's entries read it after every call)."""
        return operator.attrgetter("_seq")

    def trace_entry(self, p2p: bool = False) -> tuple:
        """``(sequence number, the flight recorder's entry)`` of the last call (the last point-to-point call
        with ``p2p``): a record (``_records``: a list), a hot-path entry, or None (record off)."""
        c = self.communicator
        if p2p:
            return c._p2p_seq, (c._p2p_ring[-1] if c._p2p_ring else None)
        return c._seq, (c._ring[c._seq & c._mask] if c._ring is not None else None)

    def trace_ring(self) -> tuple:
        """``(ring, mask, roots)``: the flight recorder's ring of entries (None when off), indexed by the
        sequence number ``& mask``, and the roots of the hot path's broadcasts beside it."""
        c = self.communicator
        return c._ring, c._mask, c._roots

    def hot_name(self, run) -> tuple:
        """``(collective, op, dtype name)`` of a hot-path entry's cached call (Nones if unknown)."""
        return self.communicator._hot_names.get(run, (None, None, None))

    def host_transport(self):
        """The host transport, as it is (the timeline wraps some of its methods on the instance)."""
        return self.communicator._host

    def instrument(self, name: str, wrap) -> None:
        """Replace the communicator's ``_blocking`` (the blocking driver of a call's steps) or ``_async``
        (the asynchronous call) with ``wrap(method)``, on the instance."""
        if name not in ("_blocking", "_async"):
            raise ValueError(f"instrument: {name!r} is not one of _blocking, _async")
        c = self.communicator
        setattr(c, name, wrap(getattr(c, name)))

    def instrument_hot(self, make) -> None:
        """From now on, every call the hot path caches (``_fast_path``) is replaced in its table by
        ``make((collective, op, dtype name), run)``, which the flight recorder names as ``run`` (the
        asynchronous allreduce's steps too: marked ``asynchronous``, a generator function of a Handle's
        steps, for which ``make`` makes one alike)."""
        c = self.communicator
        fast_path = c._fast_path

        def caching(*args, **kwargs):
            fast_path(*args, **kwargs)
            for table in (*c._fast.values(), c._fast_broadcast, c._fast_blocks, *c._fast_async.values()):
                for key, run in list(table.items()):
                    if not getattr(run, "instrumented", False):
                        names = c._hot_names.get(run, (None, None, None))
                        made = table[key] = make(names, run)
                        made.instrumented = True
                        c._hot_names[made] = names

        c._fast_path = caching  # type: ignore[method-assign]

    # ---- the flight recorder's view (_trace) ----
    def trace_name(self) -> str | None:
        """The communicator's name in dumps (``world``, ``world.0``, ...), or None when not recorded."""
        return record.name(self.communicator)

    def trace_seq(self) -> int:
        """The sequence number of the communicator's last call."""
        return self.communicator._seq

    def trace_p2p_seq(self) -> int:
        """The number of the communicator's last point-to-point call (numbered apart from the collectives)."""
        return self.communicator._p2p_seq

    def trace_entries(self, inside: bool = False) -> list[dict]:
        """The record's entries, oldest first, as dicts (``record.entries``)."""
        return record.entries(self.communicator, inside)

    def trace_snapshot(self, inside: bool = False) -> dict:
        """The communicator's part of a dump: its name, ranks, sequence number and record."""
        return record.snapshot(self.communicator, inside)

    def trace_last(self) -> tuple:
        """``(name, last entry as a dict, when the sequence number last moved on the general path)``
        (``record.last``)."""
        return record.last(self.communicator)



def engine_of(comm) -> Engine:
    """The :class:`Engine` of ``comm`` (for the layers built on the Communicator)."""
    return comm._engine

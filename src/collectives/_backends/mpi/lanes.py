"""The lanes of an MPI transport: one MPI communicator per kind of collective, each made at its first use
after every rank has shown, in a fingerprint, that it is making the same one; and the fingerprint beside
each non-blocking call, reduced on a lane of its own, which every rank checks alike."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ... import _call, _trace
from ..._errors import MismatchError
from ..base import HostTransport
from .._fingerprint import EAGER_LANES, FIELDS, LANE_CODE as _LANE_CODE, LANES, NO_CALLER as _NO_CALLER
from .._fingerprint import fingerprint_message as _fingerprint_message, making_what as _making_what
from .._fingerprint import wire_fields as _wire_fields

if TYPE_CHECKING:
    from .requests import _FirstCall


class _Lanes(dict):
    """A transport's lanes (MPI communicators) by name, each kind's made at its first use.

    Making a lane (``MPI_Comm_dup``) is collective, and MPI matches the duplications of one communicator
    by their order alone: if one rank made its allreduce lane at the same time as another made its barrier
    lane, the two would be one communicator, and the two collectives would meet on it (what the lanes
    exist to prevent). A program whose ranks make the same calls in the same order reaches the first use of
    a kind at the same call on every rank; so that a program whose ranks do not is caught there, every
    rank first reduces a fingerprint of the lane it is about to make on the fingerprint lane, in the order
    of the calls, as the non-blocking calls reduce theirs (``MPITransport._begin_making``): a rank making
    another lane, or calling a collective whose lane it has, meets it there, and every rank raises
    :class:`MismatchError` before anything is duplicated."""

    __slots__ = ("_make",)

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, name):
        lane = self[name] = self._make(name)
        return lane



class _Making:
    """A lane being made (``MPITransport._begin_making``): its name, the fingerprint of its making
    (``(request, (buffer, this rank's bytes))``, None once checked or at one rank), the new communicator
    and its ``MPI_Comm_idup`` request (None until begun; usable once it completes), the non-blocking
    calls waiting for it (:class:`_FirstCall`), and what a timeout of the making names (the caller's call
    it is made for, where the engine described one: :func:`_making_what`)."""

    __slots__ = ("check", "dup", "lane", "name", "waiting", "what")

    def __init__(self, name, check, what: tuple):
        self.name, self.check, self.what = name, check, what
        self.lane: Any = None
        self.dup: Any = None
        self.waiting: list[_FirstCall] = []



class LaneMaking(HostTransport):
    """The part of :class:`~collectives._backends.mpi.transport.MPITransport` that makes its lanes and
    reduces the fingerprints beside its calls (the state is the transport's, set in its ``__init__``)."""

    _lanes: dict
    _making: dict
    _fingerprints: dict
    _reduce_fingerprint: Any  # Iallreduce(IN_PLACE, v, MAX) on the fingerprint lane, from its row (bound once)
    fingerprints: bool
    _wait: Any

    def _fingerprint(self, operation, *args):
        """Start the fingerprint of a call: ``(request, buffer)``. The fields (:data:`FIELDS`: the
        caller's call as the engine described it in ``self.caller``, then the MPI call's collective, element
        count, wire dtype, wire op and root) travel with their negations in one ``MPI_Iallreduce`` with
        ``MPI_MAX`` of 22 int64: every rank gets each field's largest and smallest value, so every rank
        knows alike whether the ranks agree, without a second step. It runs on a lane of its own, in the
        order of the calls: the fingerprints of ranks that called different collectives meet each other,
        so a different collective is a MismatchError too, not a hang."""
        caller = self.caller
        if args:
            buf, extra = args[0], args[1:]
            if extra and extra[0].__class__ is np.ndarray:  # a receive buffer: the send buffer says it all
                extra = extra[1:]
            key = (operation, buf.size, buf.dtype, caller) + extra
        else:
            key = (operation, caller)
        hit = self._fingerprints.get(key)
        if hit is None:
            v = np.zeros(2 * len(FIELDS), dtype=np.int64)
            v[:len(FIELDS)] = (caller or _NO_CALLER) + _wire_fields(operation, args)
            v[len(FIELDS):] = -v[:len(FIELDS)]
            hit = (v, v.tobytes())
            if len(self._fingerprints) < 4096:  # a few per (collective, count, dtype, op, root) in use
                self._fingerprints[key] = hit
        v = hit[0].copy()
        return self._reduce_fingerprint(v), (v, hit[1])

    def _fingerprint_beside(self, operation, *args):
        """:meth:`_fingerprint` of a non-blocking call, or None where none is reduced: one rank alone, or
        ``fingerprints`` off (benchmarks only). The one rule for every start (``MPITransport._begin``, a
        kind's first call, the asynchronous hot path's ``fast_start``)."""
        return self._fingerprint(operation, *args) if self.size > 1 and self.fingerprints else None

    def _make_lane(self, name: str, wait=None):
        """The lane ``name`` at its first use (``_Lanes``), made now: its making (:meth:`_begin_making`, or
        the one a non-blocking call began) completed with ``wait(what, request)`` (default: this transport's
        wait, under the deadline of a :class:`DeadlineMPITransport`)."""
        making = self._making.get(name) or self._begin_making(name)
        self._advance(making, wait or self._wait)
        return making.lane

    def _begin_making(self, name: str) -> _Making:
        """Begin making the lane ``name``: the fingerprint of its making reduced on the fingerprint lane (in
        the order of the calls: it meets whatever the other ranks reduce there now); ``_advance`` begins its
        duplicate. The lane is used only once the fingerprint shows every rank making it."""
        if name in EAGER_LANES or name not in LANES:
            raise KeyError(name)  # closed (its lanes are gone), or not a lane
        self.usable()
        check = None
        if self.size > 1:
            v = np.zeros(2 * len(FIELDS), dtype=np.int64)
            # the caller's call (as in _fingerprint: a mismatch names both calls), else the lane's collective
            caller = self.caller or (_call.COLLECTIVES.index(name) if name in _call.COLLECTIVES else -1,) + _NO_CALLER[1:]
            v[:len(FIELDS)] = caller + (_LANE_CODE + LANES.index(name), 0, 0, -1, -1)
            v[len(FIELDS):] = -v[:len(FIELDS)]
            mine = v.tobytes()
            check = (self._reduce_fingerprint(v), (v, mine))
        making = self._making[name] = _Making(name, check, _making_what(name, self.caller))
        return making

    def _advance(self, making: _Making, wait=None) -> bool:
        """Move the making of a lane on, those begun before it first: with ``wait`` until complete, else as far
        as it goes without blocking; True once complete. Each duplicate (``MPI_Comm_idup`` of the "lanes"
        communicator) is begun once the one before it is made, the same order on every rank (several in flight,
        waited in another order, hung Open MPI 5.0.11: test_async.py's many-outstanding test)."""
        for earlier in list(self._making.values()):
            if not self._advance_one(earlier, wait):
                return False
            if earlier is making:
                break
        return True

    def _advance_one(self, making: _Making, wait) -> bool:
        """:meth:`_advance` for one making. Complete: the fingerprint checked (MismatchError on every rank
        if the ranks are not all making this lane), the duplicate made, the lane in use, and the calls that
        waited for it started, in the order they were made."""
        what = making.what
        try:
            if making.check is not None:
                if wait is not None:
                    wait(what, making.check[0])
                elif not making.check[0].Test():
                    return False
                check, making.check = making.check, None
                self._verify(check[1], what)
            if making.dup is None:
                making.lane, making.dup = self._lanes["lanes"].Idup()
            if wait is not None:
                wait(what, making.dup)
            elif not making.dup.Test():
                return False
        except BaseException:
            self.abandon(making)  # pending for good (its duplicate, its fingerprint): MPI may still write
            raise
        del self._making[making.name]
        self._lanes[making.name] = making.lane
        waiting, making.waiting = making.waiting, []
        for call in waiting:
            call.start()
        return True

    def _verify(self, check, what) -> None:
        """Raise :class:`MismatchError` (and fail this transport) unless the reduced fingerprint shows
        every rank with the same fields: this rank's fields are then the largest and the smallest of all
        (``check``: the reduced buffer and this rank's own, as bytes). ``what``: the call, for the message, or a
        function that makes it (called only for a mismatch)."""
        v, mine = check
        if v.tobytes() == mine:
            return
        n = len(FIELDS)
        try:
            what = what() if callable(what) else what
            message = _fingerprint_message(what, np.frombuffer(mine, np.int64)[:n], v[:n], -v[n:], self.rank,
                                           self.size)
        except Exception as exc:  # noqa: BLE001 - values no rank sends must still end in the MismatchError
            fields = np.frombuffer(mine, np.int64)[:n].tolist()
            message = (f"the fingerprint of a call differs across the ranks in values no rank sends (largest "
                       f"{v[:n].tolist()}, smallest {(-v[n:]).tolist()}, this rank's {fields}; describing it "
                       f"failed: {exc!r}): memory corrupted on the way, or an MPI that read a buffer after it "
                       f"was freed. The communicator cannot be used further")
        self.fail(message)
        _trace.dump(f"MismatchError: {message}")  # every rank raises (and dumps) alike
        raise MismatchError(message)

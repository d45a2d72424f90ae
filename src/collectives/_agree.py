"""The one agreement protocol: every rank describes its call, the ranks compare, every rank raises alike.

Used by checked mode (``init(check=True)`` or ``COLLECTIVES_CHECK=1``: every collective agrees before it
moves data) and, always, by the tree collectives (``synchronize``, ``allreduce_tree``: their trees'
structures). A call is described by

- ``what``: the collective (``"allreduce"``, ``"barrier"``, ``"synchronize"``, ...);
- ``header``: ``((name, value), ...)``, the arguments that must match (op, root, shape, dtype, device
  kind, bucket_bytes); values are plain str, int and tuple, so their ``repr`` is the same on every rank;
- ``entries``: for a tree, ``((path, description), ...)``, one per leaf; ``()`` for a single array.

Round one: every rank contributes a 16-byte fingerprint of its description (:func:`fingerprint`) and one
byte saying whether it refused the call (one fixed-size ``allgather`` of 17 bytes). Only if the
fingerprints differ or a rank refused is there a round two: the ranks gather the descriptions themselves
and every rank, from the same table, takes the same branch:

- the descriptions differ (different collectives, arguments or trees): :class:`MismatchError` on every
  rank, naming each difference and which ranks hold which value (:func:`mismatch_message`);
- some rank refused (its own arguments were invalid: an integer array with ``op="mean"``, a root out of
  range, a leaf that is not an array): that rank raises its own ``TypeError``/``ValueError``, every other
  rank a :class:`MismatchError` naming it and its error.

Nothing has moved on any rank in either case, and the communicator stays usable. Without checked mode a
single-array collective does not agree: an invalid call raises on the ranks that made it, and the others
block in the collective (``COLLECTIVES_TIMEOUT`` and the abort on uncaught exceptions end such a job).

The same module holds the vocabulary of every other exchange whose result every rank must act on alike
(settings combined at start-up, votes, "some rank lacks X", "some rank's input is not finite"); no other
module gathers for agreement by hand (``tests/unit/test_agreement_sites.py`` holds it to that):

- :func:`gather`: one picklable value per rank, through the transport, Communicator or (at start-up,
  before a transport exists) mpi4py communicator it is given;
- :func:`gather_rows`: one fixed-size row of numbers per rank, in one fixed-size allgather (the agreement
  exchange of a transport: ``agree_allgather``);
- :class:`Ballot`: flags and settings combined (``max``, ``min``, ``any``, ``all``, ``same``) in one
  fixed-size int64 allreduce (MAX), blocking or started asynchronously;
- :func:`refuse`: raise, on every rank, the error every rank built from the same table; its messages name
  ranks with :func:`ranks` (``rank 2``, ``ranks 0,1``) and :func:`holding` (``rank 2 has X, ranks 0,1 have
  Y``), the one formatter of the library.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from typing import NoReturn

import numpy as np

from . import _trace
from ._errors import CollectiveTimeoutError, MismatchError

DIGEST = 16  # bytes of a fingerprint; one more byte says "this rank refused the call"
ADVICE = ("Every rank must make the same calls in the same order, with the same arguments and trees of the "
          "same structure (keys, shapes, dtypes, device kinds); nothing was sent or changed on any rank")


def fingerprint(what: str, header: tuple, entries=()) -> bytes:
    """16 bytes identifying a description (blake2b of its text: stable across processes and runs)."""
    text = repr((what, header)) + "\n" + "\n".join(map("\t".join, entries))
    return hashlib.blake2b(text.encode(), digest_size=DIGEST).digest()


def agree(transport, what: str, header: tuple = (), entries=(), error: BaseException | None = None, *,
          digest: bytes | None = None, checked: bool = True) -> None:
    """Return if every rank of ``transport`` made the same call; else raise on every rank (see above).

    ``error`` is this rank's own validation error, held until now: it is raised here, after the others
    were told. ``entries`` may be ``None`` when this rank could not describe its tree (then ``error`` is
    set). ``digest`` is :func:`fingerprint` of the description, if the caller has it already (the tree
    collectives keep it with a structure they have seen). ``checked`` says whether the agreement is that
    of checked mode (it is named in the messages).
    """
    if transport is None or transport.size == 1:
        if error is not None:
            raise error
        return
    mine = np.zeros(DIGEST + 1, dtype=np.uint8)
    if entries is not None:
        mine[:DIGEST] = np.frombuffer(digest or fingerprint(what, header, entries), dtype=np.uint8)
    mine[DIGEST] = error is not None
    try:
        table = gather_rows(transport, mine)
        if not table[:, DIGEST].any() and (table == table[0]).all():
            return
        note = None if error is None else f"{type(error).__name__}: {error}"
        described = None if entries is None else (what, header, tuple(entries))
        gathered = gather(transport, (what, described, note))
    except CollectiveTimeoutError as exc:
        step = "the agreement step of checked mode" if checked else "the agreement step"
        raise CollectiveTimeoutError(f"in {step} before {what}: {exc}") from exc
    descriptions = [d for _, d, _ in gathered]
    tag = " (checked mode)" if checked else ""
    if all(d is not None for d in descriptions) and any(d != descriptions[0] for d in descriptions[1:]):
        refuse(MismatchError(mismatch_message(descriptions, tag)), dump=True)
    if error is not None:
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(f"collectives{tag}: rank {transport.rank} refused this {what} call; the other "
                           f"ranks were told and raise MismatchError; nothing was sent or changed on any rank")
        raise error
    refuse(MismatchError(refusal_message(gathered, tag)), dump=True)


def mismatch_message(descriptions: list, tag: str = "") -> str:
    """The message of a MismatchError for ``descriptions``: one ``(what, header, entries)`` per rank."""
    whats = [d[0] for d in descriptions]
    first = whats[0]
    if any(w != first for w in whats[1:]):
        called = holding([f"called {w}" for w in whats]).replace(" has called", " called").replace(
            " have called", " called")
        return f"ranks called different collectives{tag}: {called}. {ADVICE}."
    parts = []
    names: list = []
    for _, header, _ in descriptions:
        names.extend(n for n, _ in header if n not in names)
    for name in names:
        values = [repr(dict(h).get(name, "<absent>")) for _, h, _ in descriptions]
        if any(v != values[0] for v in values[1:]):
            parts.append(f"{name}: {holding(values)}")
    tables = [dict(e) for _, _, e in descriptions]
    paths: list = []
    for _, _, entries in descriptions:
        paths.extend(p for p, _ in entries if p not in tables[0] or p not in paths)
    leaves = []
    seen = set()
    for path in paths:
        if path in seen:
            continue
        seen.add(path)
        values = [t.get(path) or "no such leaf" for t in tables]
        if any(v != values[0] for v in values[1:]):
            leaves.append(f"leaf {render_path(path)}: {holding(values)}")
    parts.extend(leaves[:3])
    if len(leaves) > 3:
        parts.append(f"and {len(leaves) - 3} more leaves")
    differing = [r for r, d in enumerate(descriptions) if d != descriptions[0]]
    others = f" (ranks differing from rank 0: {', '.join(map(str, differing))})"
    return f"ranks disagree about {first}{tag}: " + "; ".join(parts) + f"{others}. {ADVICE}."


def refusal_message(gathered: list, tag: str = "") -> str:
    """The message of the MismatchError the other ranks raise when some ranks refused a call;
    ``gathered`` holds one ``(what, description or None, error text or None)`` per rank."""
    refused = [(rank, note) for rank, (_, _, note) in enumerate(gathered) if note is not None]
    what = gathered[refused[0][0]][0]
    who = "; ".join(f"rank {rank} raised {note}" for rank, note in refused)
    others = sorted({w for w, _, note in gathered if note is None} - {what})
    also = f" (other ranks called {', '.join(others)})" if others else ""
    ranks = ",".join(str(r) for r, _ in refused)
    one = len(refused) == 1
    return (f"{what} refused by {'rank' if one else 'ranks'} {ranks}{tag}: {who}{also}. Nothing was sent "
            f"or changed on any rank; fix the arguments on {'that rank' if one else 'those ranks'} (see its "
            f"traceback).")


def render_path(path: str) -> str:
    """A leaf's path as users write it: ``['layers'][0]['w']`` (``"<root>"`` for the tree itself)."""
    return path or "<the tree itself>"


# ---- the vocabulary of every other exchange that must agree ----------------------------------------------

def _mpi_comm(via) -> bool:
    """Whether ``via`` is an mpi4py communicator (looked up in ``sys.modules``, never imported: without
    mpi4py loaded no object can be one)."""
    MPI = sys.modules.get("mpi4py.MPI")
    return MPI is not None and isinstance(via, MPI.Comm)


def gather(via, value) -> list:
    """Every rank's picklable ``value``, in rank order, the same list on every rank (collective: every rank
    of ``via`` calls it at the same point).

    ``via`` is what carries it, and the exchange is that object's own, unchanged: a transport (its
    ``allgather_object``: the library's metadata, apart from the data), a Communicator (its public
    ``allgather_object``: recorded, and agreed first in checked mode, as any call of the user's), an mpi4py
    communicator at start-up, before any transport exists (its pickled ``allgather``), or ``None``: this
    process alone (``[value]``, nothing sent).

    Example:
        >>> from collectives._backends.self import SelfTransport
        >>> gather(SelfTransport(), {"nccl": True}), gather(None, 3)
        ([{'nccl': True}], [3])
    """
    if via is None:
        return [value]
    if _mpi_comm(via):
        return via.allgather(value)
    return via.allgather_object(value)


def gather_rows(transport, row: np.ndarray) -> np.ndarray:
    """Every rank's ``row`` (a 1-d array of numbers, the same length and dtype on every rank) as a
    ``(size, len(row))`` table, the same on every rank: one fixed-size allgather, the transport's agreement
    exchange (``agree_allgather``: apart from the data where the transport can keep it apart). Alone
    (``transport`` None or of size 1): ``row`` as a table of one row, nothing sent.

    Example:
        >>> gather_rows(None, np.array([0, -1, 0])).tolist()
        [[0, -1, 0]]
    """
    row = np.ascontiguousarray(row)
    if transport is None or transport.size == 1:
        return row.reshape(1, -1)
    table = np.empty((transport.size, row.size), dtype=row.dtype)
    transport.agree_allgather(row.view(np.uint8), table.view(np.uint8))
    return table


HOW = ("max", "min", "any", "all", "same")  # how a Ballot field's values combine across the ranks


class Ballot:
    """Flags and settings every rank contributes, combined in ONE fixed-size exchange: a single int64
    allreduce with MAX over one buffer of one slot per field (two for ``same``), whatever the fields.

    ``fields``: name -> how its values combine: ``"max"``/``"min"`` (an int: the largest/smallest any rank
    gave), ``"any"``/``"all"`` (a truth value: whether any/every rank said yes), ``"same"`` (an int: whether
    every rank gave the same one; travels as ``x, -x``, equal everywhere iff ``max(x) == -max(-x)``). The
    buffer is the ballot's own and is reused by every exchange: one exchange at a time per ballot.

    Example:
        >>> b = Ballot({"off": "any", "threshold": "max", "digest": "same"})
        >>> b.fill({"off": False, "threshold": 4096, "digest": 7}).tolist()
        [0, 4096, 7, -7]
        >>> b.combine(None, {"off": True, "threshold": 1, "digest": 3})
        {'off': True, 'threshold': 1, 'digest': True}
    """

    def __init__(self, fields: dict[str, str]):
        wrong = {name: how for name, how in fields.items() if how not in HOW}
        if wrong:
            raise ValueError(f"Ballot: each field combines by one of {HOW}, got {wrong}")
        self.fields = dict(fields)
        self.buf = np.zeros(sum(2 if how == "same" else 1 for how in self.fields.values()), dtype=np.int64)

    def fill(self, values: dict) -> np.ndarray:
        """This rank's ``values`` (one per field) written into the buffer, which is returned."""
        i = 0
        for name, how in self.fields.items():
            v = values[name]
            if how == "same":
                self.buf[i], self.buf[i + 1] = int(v), -int(v)
                i += 2
                continue
            self.buf[i] = -int(v) if how == "min" else int(not v) if how == "all" else int(bool(v)) if how == "any" \
                else int(v)
            i += 1
        return self.buf

    def result(self) -> dict:
        """The combined values (once the exchange is complete): ints for max/min, bools for the others."""
        out: dict = {}
        i = 0
        for name, how in self.fields.items():
            v = int(self.buf[i])
            if how == "same":
                out[name] = v == -int(self.buf[i + 1])
                i += 2
                continue
            out[name] = -v if how == "min" else not v if how == "all" else bool(v) if how == "any" else v
            i += 1
        return out

    def combine(self, via, values: dict) -> dict:
        """Every rank's ``values`` combined (collective, blocking): ``via`` a Communicator (its public
        ``allreduce(buf, "max")``), an mpi4py communicator at start-up (``Allreduce(IN_PLACE, buf, MAX)``),
        or ``None`` (this process alone: its own values, nothing sent)."""
        buf = self.fill(values)
        if _mpi_comm(via):
            MPI = sys.modules["mpi4py.MPI"]
            via.Allreduce(MPI.IN_PLACE, buf, MPI.MAX)
        elif via is not None:
            via.allreduce(buf, "max")
        return self.result()

    def start(self, comm, values: dict):
        """Start combining every rank's ``values`` over Communicator ``comm`` (its non-blocking
        ``allreduce(buf, "max", async_op=True)``) and return its handle: :meth:`result` once it is waited for."""
        return comm.allreduce(self.fill(values), "max", async_op=True)


def refuse(error: BaseException, *, dump: bool = False) -> NoReturn:
    """Raise ``error``: every rank calls this with the error it built from the same gathered table, so every
    rank raises alike (and none waits for the others). ``dump``: write the flight recorder's dump first
    (where recording is on; the protocol's own refusals and the NaN check do)."""
    if dump:
        _trace.dump(f"{type(error).__name__}: {error}")
    raise error


def refuse_together(via, problem, error: Callable[[dict], BaseException], *, dump: bool = False) -> None:
    """Every rank's ``problem`` (anything falsy: none) gathered (:func:`gather` through ``via``); where some
    rank has one, every rank raises ``error({rank: problem, ...})`` (the ranks with one, in rank order)."""
    bad = {r: p for r, p in enumerate(gather(via, problem)) if p}
    if bad:
        refuse(error(bad), dump=dump)


def ranks(numbers) -> str:
    """``rank 2`` or ``ranks 0,1``: the one way the library's messages name ranks."""
    numbers = list(numbers)
    return ("rank " if len(numbers) == 1 else "ranks ") + ",".join(map(str, numbers))


def holding(values: list) -> str:
    """``ranks 0,1 have X, rank 2 has Y`` for ``values``, one per rank in rank order (grouped by value, in
    order of first appearance; each shown as ``str`` gives it: pass reprs where that is clearer).

    Example:
        >>> holding(["1", "1", "unset"])
        'ranks 0,1 have 1, rank 2 has unset'
    """
    groups: dict = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    return ", ".join(f"{ranks(r)} {'has' if len(r) == 1 else 'have'} {v}" for v, r in groups.items())

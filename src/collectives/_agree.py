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
"""

from __future__ import annotations

import hashlib

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
    table = np.empty((transport.size, DIGEST + 1), dtype=np.uint8)
    try:
        transport.agree_allgather(mine, table)
        if not table[:, DIGEST].any() and (table == table[0]).all():
            return
        note = None if error is None else f"{type(error).__name__}: {error}"
        described = None if entries is None else (what, header, tuple(entries))
        gathered = transport.allgather_object((what, described, note))
    except CollectiveTimeoutError as exc:
        step = "the agreement step of checked mode" if checked else "the agreement step"
        raise CollectiveTimeoutError(f"in {step} before {what}: {exc}") from exc
    descriptions = [d for _, d, _ in gathered]
    tag = " (checked mode)" if checked else ""
    if all(d is not None for d in descriptions) and any(d != descriptions[0] for d in descriptions[1:]):
        message = mismatch_message(descriptions, tag)
        _trace.dump(f"MismatchError: {message}")  # every rank raises (and dumps) alike
        raise MismatchError(message)
    if error is not None:
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(f"collectives{tag}: rank {transport.rank} refused this {what} call; the other "
                           f"ranks were told and raise MismatchError; nothing was sent or changed on any rank")
        raise error
    message = refusal_message(gathered, tag)
    _trace.dump(f"MismatchError: {message}")
    raise MismatchError(message)


def _groups(values: list) -> str:
    """``ranks 0,1 have X, rank 2 has Y`` (values by their repr, in order of first appearance)."""
    groups: dict = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    return ", ".join(f"{_ranks(r)} {v}" for v, r in groups.items())


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} has"
    return "ranks " + ",".join(map(str, ranks)) + " have"


def mismatch_message(descriptions: list, tag: str = "") -> str:
    """The message of a MismatchError for ``descriptions``: one ``(what, header, entries)`` per rank."""
    whats = [d[0] for d in descriptions]
    first = whats[0]
    if any(w != first for w in whats[1:]):
        called = _groups([f"called {w}" for w in whats]).replace(" has called", " called").replace(
            " have called", " called")
        return f"ranks called different collectives{tag}: {called}. {ADVICE}."
    parts = []
    names: list = []
    for _, header, _ in descriptions:
        names.extend(n for n, _ in header if n not in names)
    for name in names:
        values = [repr(dict(h).get(name, "<absent>")) for _, h, _ in descriptions]
        if any(v != values[0] for v in values[1:]):
            parts.append(f"{name}: {_groups(values)}")
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
            leaves.append(f"leaf {render_path(path)}: {_groups(values)}")
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

"""The cross-rank agreement check (``init(check=True)`` or ``COLLECTIVES_CHECK=1``).

Before a collective moves data, every rank describes the call it is making (operation, op, root, shape,
dtype, device kind) and the ranks compare 16-byte fingerprints of their descriptions (one fixed-size
allgather). If they differ, the ranks gather the descriptions themselves and every rank raises the same
:class:`MismatchError`, naming each rank's values; no data has moved. (The tree collectives of ``_tree``
compare fingerprints of whole trees the same way, always.)

A rank whose own arguments are invalid (an integer array with ``op="mean"``, a root out of range, a list
where an array belongs) must not simply raise: the other ranks are already waiting in the agreement step
and would wait forever. In checked mode it contributes its error instead (:func:`refuse`); then it raises
its own ``TypeError``/``ValueError`` and every other rank raises :class:`MismatchError` naming that rank
and its error. Without checked mode nothing of this runs: an invalid call raises on the ranks that made it,
and the others block in the collective (the deadline, ``COLLECTIVES_TIMEOUT``, and the abort on uncaught
exceptions end such a job; see ``docs/troubleshooting.md``).
"""

from __future__ import annotations

import hashlib

import numpy as np

from ._errors import CollectiveTimeoutError, MismatchError

ERROR = "error"  # the key of a refused call: {"collective": ..., "error": "TypeError: ..."}
_DIGEST = 16  # bytes of a call's fingerprint; one more byte says "this rank refused the call"


def agree(transport, call: dict) -> None:
    """Raise MismatchError on every rank unless all ranks made the same ``call``.

    Two rounds, the second only when needed: every rank contributes a 16-byte fingerprint of its call
    (one fixed-size ``allgather``); only if the fingerprints differ, or a rank refused (:func:`refuse`),
    do the ranks gather the calls themselves to name every side's values. Every rank sees the same table,
    so every rank takes the same branch.
    """
    if transport.size == 1:
        return
    try:
        if _round_one(transport, call, refused=False):
            return
        calls = transport.allgather_object(call)
    except CollectiveTimeoutError as exc:
        raise _in_agreement(exc, call) from exc
    first = calls[0]
    if all(c == first for c in calls[1:]):  # (a fingerprint collision: as good as agreeing)
        return
    raise MismatchError(describe_mismatch(calls))


def _round_one(transport, call: dict, refused: bool) -> bool:
    """Gather every rank's fingerprint of ``call``; True if all are equal and nobody refused."""
    mine = fingerprint(call) + (b"\x01" if refused else b"\x00")
    table = np.empty((transport.size, _DIGEST + 1), dtype=np.uint8)
    transport.allgather(np.frombuffer(mine, dtype=np.uint8), table)
    return not refused and table.tobytes() == mine * transport.size  # (then nobody's flag is set)


def _in_agreement(exc: CollectiveTimeoutError, call: dict) -> CollectiveTimeoutError:
    what = call.get("collective")
    return CollectiveTimeoutError(f"in the agreement step of checked mode before {what}: {exc}")


def fingerprint(call: dict) -> bytes:
    """16 bytes identifying a call description (its repr: plain str, int and tuple values, same order)."""
    return hashlib.blake2b(repr(call).encode(), digest_size=_DIGEST).digest()


def refuse(transport, collective: str, error: BaseException) -> None:
    """Contribute this rank's validation ``error`` to the agreement step of ``collective``, then return.

    Called (in checked mode only) by a rank that found its own arguments invalid, *before* it raises its
    error: the other ranks, inside :func:`agree` for the same call, then raise :class:`MismatchError`
    naming this rank and its error, instead of waiting for it. ``transport`` is the host transport (the
    agreement always travels over it), or ``None`` when the communicator is closed.
    """
    if transport is None or transport.size == 1:
        return
    text = f"{type(error).__name__}: {error}"
    refused = {"collective": collective, ERROR: text}
    try:
        _round_one(transport, refused, refused=True)  # the others, in agree(), see the flag ...
        transport.allgather_object(refused)  # ... and gather the calls in a second round, naming it
    except CollectiveTimeoutError as exc:
        raise _in_agreement(exc, refused) from exc
    note = (f"collectives (checked mode): rank {transport.rank} refused this {collective} call; the other "
            f"ranks were told and raise MismatchError; nothing was sent or changed on any rank")
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(note)


def describe_mismatch(calls: list[dict]) -> str:
    """The message of the MismatchError for ``calls`` (one dict per rank, in rank order)."""
    refused = [(rank, c[ERROR]) for rank, c in enumerate(calls) if ERROR in c]
    if refused:
        what = calls[refused[0][0]].get("collective", "a collective")
        who = "; ".join(f"rank {rank} raised {text}" for rank, text in refused)
        others = sorted({c.get("collective") for c in calls if ERROR not in c} - {what})
        also = f" (other ranks called {', '.join(others)})" if others else ""
        ranks = ",".join(str(r) for r, _ in refused)
        return (f"{what} refused by {'rank' if len(refused) == 1 else 'ranks'} {ranks} (checked mode): "
                f"{who}{also}. Nothing was sent or changed on any rank; fix the arguments on "
                f"{'that rank' if len(refused) == 1 else 'those ranks'} (see its traceback).")
    keys = []
    for c in calls:
        keys.extend(k for k in c if k not in keys)
    parts = []
    for key in keys:
        values = [c.get(key, "<absent>") for c in calls]
        if any(v != values[0] for v in values[1:]):
            groups: dict = {}
            for rank, v in enumerate(values):
                groups.setdefault(repr(v), []).append(rank)
            parts.append(f"{key}: " + ", ".join(f"{_ranks(r)} {v}" for v, r in groups.items()))
    what = calls[0].get("collective", "a collective")
    return (f"ranks disagree about {what} (checked mode): " + "; ".join(parts)
            + ". Every rank must make the same calls in the same order with the same arguments.")


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} has"
    return "ranks " + ",".join(map(str, ranks)) + " have"

"""The cross-rank agreement check (``init(check=True)`` or ``COLLECTIVES_CHECK=1``).

Before a collective moves data, every rank contributes a small description of the call it is making
(operation, op, root, shape, dtype, device kind, tree fingerprint). If the descriptions differ, every
rank raises the same :class:`MismatchError`, naming each rank's values; no data has moved.
"""

from __future__ import annotations

from ._errors import MismatchError


def agree(transport, call: dict) -> None:
    """Raise MismatchError on every rank unless all ranks made the same ``call``."""
    if transport.size == 1:
        return
    calls = transport.allgather_object(call)
    first = calls[0]
    if all(c == first for c in calls[1:]):
        return
    raise MismatchError(describe_mismatch(calls))


def describe_mismatch(calls: list[dict]) -> str:
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

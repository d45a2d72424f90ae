"""What a closed Communicator holds instead of its host transport: one guard for every use.

After :meth:`Communicator.close` (or :func:`collectives.finalize`) the communicator's transport is
:data:`CLOSED`. Reading any attribute of it (``rank``, ``size``, ``allreduce``, ...) raises
:class:`BackendUnavailableError`, so every method and property of the communicator, and every function that
reaches its transport (the tree collectives, ``shard``, ``DistributedOptimizer``), fails the same
documented way instead of with ``AttributeError: 'NoneType' ...``; no method needs its own check.
"""

from __future__ import annotations

from typing import Any

from .._errors import BackendUnavailableError

MESSAGE = ("this communicator was closed (close() or collectives.finalize()); make a new one with "
           "collectives.init() (or collectives.world())")


class ClosedTransport:
    """Stands for the transport of a closed communicator; every attribute read raises."""

    __slots__ = ()

    def __getattr__(self, name):
        if name.startswith("__"):  # introspection (hasattr(x, "__wrapped__"), copy, pickle): not a use
            raise AttributeError(name)
        raise BackendUnavailableError(f"{MESSAGE}; it has no {name!r} any more")

    def __repr__(self) -> str:
        return "<closed transport>"

    def __bool__(self) -> bool:
        return False


CLOSED: Any = ClosedTransport()  # typed Any: it stands where any transport stood (every use raises)

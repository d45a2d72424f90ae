"""The meeting before a collective call of ``DistributedOptimizer(shard_state=True)`` (``state_dict()``,
``add_param_group()``): every rank must call it, and a rank that calls it alone is told so."""

from __future__ import annotations

import contextlib
import warnings

import numpy as np

from .. import _call, _config
from .._errors import CollectiveTimeoutError
from .._gradients import MEETING, meeting_named
from .._poll import poll


class Meeting:
    """The meeting of a torch optimizer with ``shard_state=True``: :meth:`meet` waits until every rank has
    called the same collective method, before any of its transfers; a meeting given up on (a timeout) is
    kept, and a later call on every rank completes it."""

    def __init__(self):
        self.waiting = None  # the meeting a call gave up on (a retry on every rank completes it)

    def meet(self, what: str, engine, comm) -> None:
        """Wait until every rank of ``comm`` has called ``what``: a non-blocking one-byte broadcast on the
        gradient communicator of ``engine`` (the optimizer's gradient buckets), described as the meeting
        (``_gradients.MEETING``), polled. The rank-0-only checkpoint of Horovod is what this catches: the other
        ranks are then in their next step's gradient collectives on that communicator, whose fingerprint
        (beside every non-blocking call) differs from the meeting's, so every rank raises MismatchError
        naming the fix (:func:`told_apart`). Ranks that are elsewhere (not in a gradient collective): after
        ``COLLECTIVES_STALL_WARN_S`` (default 60 s) this rank warns once and waits on; after
        ``COLLECTIVES_TIMEOUT`` (when set), :class:`CollectiveTimeoutError`; either names the fix."""
        if engine is None or comm.size == 1:
            return
        handle = self.waiting
        if handle is None:
            with _call.naming(structure=MEETING), meeting_named():
                # a broadcast: the one collective the gradient communicator carries nothing else on, so that
                # a meeting among ranks in their gradient collectives never shares an MPI call with them
                # (only the fingerprints meet: MPICH asserts on an allreduce of 1 byte against one of 24)
                handle = engine.comm.broadcast(np.zeros(1, np.int8), root=0, async_op=True)
        warn_s, limit = _config.stall_warn_s(), _config.timeout()
        waited = 0.0
        for bound in sorted({b for b in (warn_s, limit) if b is not None}):
            with meeting_named():
                if poll(handle.done, bound - waited):
                    break
            waited = bound
            text = (f"DistributedOptimizer.{what} with shard_state=True is collective: every rank must call it, "
                    f"and rank {comm.rank} of {comm.size} has waited {waited:g} s for the others. "
                    "Gathering the sharded state needs every rank's share, so Horovod's rank-0 checkpoint "
                    "(`if rank == 0: torch.save(opt.state_dict())`) cannot work: call `sd = opt.state_dict()` on "
                    "every rank, then save `sd` on rank 0 only")
            if bound == limit:
                self.waiting = handle  # kept: a call on every rank after this error completes it
                raise CollectiveTimeoutError(f"{text} (COLLECTIVES_TIMEOUT={limit:g})")
            warnings.warn(f"{text} (a warning, waiting on; COLLECTIVES_STALL_WARN_S sets when it is given, "
                          "COLLECTIVES_TIMEOUT turns it into an error)", RuntimeWarning, stacklevel=3)
        self.waiting = None
        with meeting_named():
            handle.wait()


def told_apart(sharded: bool):
    """:func:`_gradients.meeting_named` where the state is sharded (a meeting of some ranks can meet the
    others' gradient collectives there), else nothing to tell apart."""
    return meeting_named() if sharded else contextlib.nullcontext()

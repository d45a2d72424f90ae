"""The system under test, as the suite sees it: the default adapter, ``collectives`` itself.

The suite reaches the library only through a module like this one. To run the suite against something
else (a wrapper around ``collectives``, another implementation of the same API), write a module that
exposes the same names and point ``COLLECTIVES_CONFORMANCE_SUT`` (or ``--conformance-sut``) at it:

    COLLECTIVES_CONFORMANCE_SUT=myframework.collectives mpiexec -n 2 python -m pytest conformance

Required names (the suite fails at start-up without them):

- ``init(backend="auto")`` -> a communicator with ``rank`` and ``size`` (also the default one of the
  function forms below); ``backend`` is ``"auto"``, ``"mpi"`` or ``"self"``;
- ``broadcast(x, root=0)``, ``allreduce(x, op="sum")``, ``reduce(x, op="sum", root=0)``,
  ``allgather(x)``, ``barrier()``.

Optional names (their tests are skipped, with the reason, when a name is missing):

- ``synchronize``, ``allreduce_tree`` (trees), ``DistributedOptimizer``, ``shard``;
- ``MismatchError`` (what trees raise when ranks disagree; default: any ``Exception``);
- ``reduce_scatter(x, op="sum")``, ``alltoall(x)``, ``gather(x, root=0)``, ``broadcast_object(obj, root=0)``,
  ``allgather_object(obj)``;
- ``allreduce_units(units, op="sum", comm=None)`` (reproducible sums: the suite checks ``reproducible=True``
  against it where the collectives take that keyword).
"""

import collectives as _collectives

REQUIRED = ("init", "broadcast", "allreduce", "reduce", "allgather", "barrier")
OPTIONAL = ("synchronize", "allreduce_tree", "DistributedOptimizer", "shard", "MismatchError", "reduce_scatter",
            "alltoall", "gather", "broadcast_object", "allgather_object", "allreduce_units")

# Re-export what the installed collectives has: an older one without trees still runs the suite.
for _name in REQUIRED + OPTIONAL:
    if hasattr(_collectives, _name):
        globals()[_name] = getattr(_collectives, _name)
del _name

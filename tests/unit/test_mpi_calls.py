"""Every MPI communication call is made from a row of ``_backends.mpi.ops`` (issue 33: each MPI operation
written once).

The rows (``OPERATIONS``, ``ALLGATHERV``, ``MESSAGES``) name mpi4py's methods; every other module makes its
calls through them (``row.method(comm)``, ``row.call(comm, ...)``, ``row.bind(...)``). This scans
``src/collectives`` (AST) for a use of an mpi4py communication method by name, called or bound
(``comm.Allreduce(...)``, ``isend = comm.Isend``), outside ops.py; a new one fails here: add a row (or use
one), or add the place to ``ALLOWED`` with why. The pickled object collectives of mpi4py (lowercase) are
listed apart, in ``OBJECT_CALLS``, each with why it is no row (those of ``_backends``: elsewhere a
``self.comm`` is a Communicator, whose methods are the library's own).
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_layers import module_name  # (one module name per file, as the layer rules name them)

SRC = Path(__file__).resolve().parents[2] / "src" / "collectives"
TABLE = "_backends.mpi.ops"

# mpi4py's buffer-based communication methods (point-to-point and collectives, blocking and not)
METHODS = {
    "Send", "Recv", "Isend", "Irecv", "Ssend", "Issend", "Bsend", "Rsend", "Sendrecv", "Sendrecv_replace",
    "Bcast", "Ibcast", "Allreduce", "Iallreduce", "Reduce", "Ireduce", "Allgather", "Iallgather", "Allgatherv",
    "Iallgatherv", "Gather", "Igather", "Gatherv", "Igatherv", "Scatter", "Iscatter", "Scatterv", "Iscatterv",
    "Reduce_scatter_block", "Ireduce_scatter_block", "Reduce_scatter", "Ireduce_scatter", "Alltoall",
    "Ialltoall", "Alltoallv", "Ialltoallv", "Alltoallw", "Ialltoallw", "Scan", "Iscan", "Exscan", "Iexscan",
    "Barrier", "Ibarrier",
}

# (module, function, method) -> why that call is not made from a row
ALLOWED = {
    ("_agree", "combine", "Allreduce"): "Ballot.combine over an mpi4py communicator at start-up, before a transport "
                                        "exists: _agree is the bottom layer and may not import the transports' "
                                        "table (tests/unit/test_layers.py); one call, written once, there",
}

# mpi4py's pickled object collectives (lowercase), on a transport's own communicators, and why each is no row:
# they take Python objects, not buffers (no datatype, count, op or in-place rule for a row to say), only
# their blocking form is used (the deadline transport replaces all four with buffer calls made from the
# rows: the allgather row and ALLGATHERV, the broadcast row), and each is one line, written once.
OBJECT_METHODS = {"allgather", "bcast", "gather", "scatter", "alltoall", "allreduce", "reduce", "send", "recv",
                  "sendrecv", "isend", "irecv", "barrier", "ibarrier"}
MPI_COMMS = ("self.comm", "self._lanes[", "self.node", "self.leaders")  # mpi4py communicators (in _backends)
OBJECT_CALLS = {
    ("_backends.mpi.transport", "allgather_object", "allgather"): "the library's metadata allgather (pickled)",
    ("_backends.mpi.transport", "broadcast_object", "bcast"): "the library's metadata broadcast (pickled)",
    ("_backends.mpi.transport", "objects_allgather", "allgather"): "the public allgather_object, on its lane",
    ("_backends.mpi.transport", "objects_broadcast", "bcast"): "the public broadcast_object, on its lane",
}


def uses(name: str, source: str) -> tuple[list, list]:
    """``(mpi_calls, object_calls)`` in module ``name``'s ``source``, each ``(module, function, line, method)``:
    a read of an attribute named as one of :data:`METHODS` (called or bound; a string in a docstring is not),
    and a call of one of :data:`OBJECT_METHODS` on one of :data:`MPI_COMMS`; the innermost enclosing function
    names the place (``""`` at module level)."""
    calls, objects = [], []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Load) and child.attr in METHODS:
                calls.append((name, function, child.lineno, child.attr))
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) \
                    and child.func.attr in OBJECT_METHODS \
                    and ast.unparse(child.func.value).startswith(MPI_COMMS):
                objects.append((name, function, child.lineno, child.func.attr))
            visit(child, inner)

    visit(ast.parse(source), "")
    return calls, objects


def scan() -> tuple[list, list]:
    calls, objects = [], []
    for path in sorted(SRC.rglob("*.py")):
        name = module_name(path)
        if name != TABLE:
            found = uses(name, path.read_text())
            calls += found[0]
            if name.startswith("_backends."):  # (elsewhere self.comm is a Communicator: its public methods)
                objects += found[1]
    return calls, objects


def test_every_mpi_call_is_made_from_a_row():
    calls, _ = scan()
    wrong = [f"{m}:{line} in {f or '<module>'}(): .{method}" for m, f, line, method in calls
             if (m, f, method) not in ALLOWED]
    assert not wrong, ("an MPI communication call written outside _backends/mpi/ops.py (make it from its row: "
                       "row.method(comm), row.call(comm, ...); add a row for a new call; or, if it cannot be, add "
                       "it to ALLOWED with why):\n" + "\n".join(wrong))


def test_the_object_collectives_are_the_listed_ones():
    """The pickled object collectives on the transports' communicators are exactly those listed (a new one
    is a call to make from a row, or one more entry with its reason)."""
    _, objects = scan()
    assert {(m, f, method) for m, f, _, method in objects} == set(OBJECT_CALLS)
    assert len(objects) == len(OBJECT_CALLS)


def test_every_allowed_place_still_calls():
    """An entry of ALLOWED whose call is gone is removed with it (the list stays short and true)."""
    calls, _ = scan()
    stale = sorted(set(ALLOWED) - {(m, f, method) for m, f, _, method in calls})
    assert not stale, f"ALLOWED names places that no longer call MPI: {stale}"
    assert all(len(why) > 20 for why in [*ALLOWED.values(), *OBJECT_CALLS.values()])


def test_the_rows_name_every_method_the_library_calls():
    """What the rows name are mpi4py's methods of :data:`METHODS` (the scan looks for the right names)."""
    from collectives._backends.mpi.ops import ALLGATHERV, MESSAGES, OPERATIONS

    rows = [*OPERATIONS.values(), ALLGATHERV, *MESSAGES.values()]
    named = {m for row in rows for m in (row.blocking, row.nonblocking)}
    assert named <= METHODS
    assert {"Allreduce", "Iallreduce", "Allgather", "Iallgather", "Iallgatherv", "Ibcast", "Barrier", "Ibarrier",
            "Send", "Recv", "Isend", "Irecv"} <= named


def test_the_scanner_sees_every_form():
    """The checker itself: a call, a bound method, a call on a subscript, a pickled collective on a
    transport's communicator are found, each in its function; a row's call, a docstring, a Communicator's
    lowercase method and a local reduction (``Reduce_local``) are not."""
    probe = ("def a(comm, MPI, x):\n    comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)\n"
             "def b(comm):\n    isend = comm.Isend\n    return isend\n"
             "class C:\n    def c(self, x):\n        return self._lanes['p2p'].Irecv(x, 0, 1)\n"
             "    def d(self, obj):\n        return self.comm.bcast(obj, 0)\n"
             "def e(row, comm, c, op, x):\n    '''comm.Bcast(x, 0)'''\n    row.call(comm, [x])\n"
             "    c.allgather(x)\n    op.Reduce_local(x, x)\n")
    calls, objects = uses("probe", probe)
    assert [(f, line, m) for _, f, line, m in calls] == [("a", 2, "Allreduce"), ("b", 4, "Isend"),
                                                           ("c", 8, "Irecv")], calls
    assert [(f, line, m) for _, f, line, m in objects] == [("d", 10, "bcast")], objects

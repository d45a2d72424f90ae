"""Every exchange whose result the ranks must act on alike goes through ``_agree`` (issue 33).

An object allgather (``allgather_object``), the agreement exchange of a transport (``agree_allgather``)
and an allreduce with ``max`` or ``min`` (flags, votes, settings) are called only in ``_agree``, whose
vocabulary (``gather``, ``gather_rows``, ``Ballot``, ``refuse``) every such site uses, and at the few places
below, each of which is not an agreement and says why. A new hand-written agreement fails here: use the
vocabulary, or add the place to ``ALLOWED`` with its reason (docs/architecture.md, "One agreement protocol").
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_layers import module_name  # (one module name per file, as the layer rules name them)

SRC = Path(__file__).resolve().parents[2] / "src" / "collectives"

OBJECT_EXCHANGES = {"allgather_object", "agree_allgather"}
REDUCTIONS = {"allreduce", "Allreduce", "Iallreduce"}
ROW_CALLS = {"call", "bind_in_place", "bind"}  # an MPI call made from a row of _backends.mpi.ops (its allreduce row)
ORDERS = {"max", "min", "MAX", "MIN", "_max_op", "_min_op"}  # "max" / MPI.MAX / a transport's cached MPI.MAX

# (module, function) -> why that exchange is not an agreement (or is the transport's own protocol)
ALLOWED = {
    ("_comm.functions", "allgather_object"): "the public allgather_object: the user's own objects are the data",
    ("_backends.base", "objects_allgather"): "a transport's default for the public allgather_object (the data)",
    ("_tree", "_exact"): "allreduce_tree's Python-int leaves: the user's data, reduced exactly",
    ("torch_backend.group", "barrier"): "torch's dist.barrier, asked for by the user: a one-byte allreduce",
    ("_backends.mpi.transport", "__init__"): "the MPI transport's own fingerprint beside each non-blocking call and "
                                             "each lane's making, bound once from the allreduce row on its own "
                                             "lane (lanes.py calls it: the protocol, not a user)",
}


def orders(call: ast.Call) -> bool:
    """Whether ``call`` names max or min as its op (a string, ``MPI.MAX``, a cached ``self._max_op``)."""
    for arg in [*call.args, *(k.value for k in call.keywords)]:
        if isinstance(arg, ast.Constant) and arg.value in ORDERS:
            return True
        if isinstance(arg, ast.Attribute) and arg.attr in ORDERS:
            return True
    return False


def exchanges(name: str, source: str) -> list[tuple[str, str, int, str]]:
    """``(module, function, line, call)`` of every agreement-shaped exchange in ``source``: a call of
    ``.allgather_object``/``.agree_allgather``, or of ``.allreduce``/``.Allreduce``/``.Iallreduce`` with max
    or min, also one made from the allreduce row of ``_backends.mpi.ops`` (``OPERATIONS["allreduce"].call``,
    ``.bind_in_place``: where every MPI call is made) and one handed to a starter with its op
    (``start(opts, comm.allreduce, flag, "max")``); the
    innermost enclosing function names the place (``""`` at module level)."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                attr = child.func.attr
                passed = any(isinstance(a, ast.Attribute) and a.attr in REDUCTIONS for a in child.args)
                if attr in ROW_CALLS and "allreduce" in ast.unparse(child.func.value):
                    attr = "Allreduce"  # OPERATIONS["allreduce"].call(comm, specs, MPI.MAX), a row bound so
                if attr in OBJECT_EXCHANGES or ((attr in REDUCTIONS or passed) and orders(child)):
                    found.append((name, function, child.lineno, ast.unparse(child.func)))
            visit(child, inner)

    visit(ast.parse(source), "")
    return found


def scan() -> list[tuple[str, str, int, str]]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        name = module_name(path)
        if name != "_agree":
            found += exchanges(name, path.read_text())
    return found


def test_every_agreement_goes_through_agree():
    wrong = [f"{m}:{line} in {f or '<module>'}(): {call}(...)" for m, f, line, call in scan() if (m, f) not in ALLOWED]
    assert not wrong, ("an exchange the ranks must act on alike, written by hand (use _agree.gather, gather_rows, "
                       "Ballot and refuse; or, if it is not an agreement, add it to ALLOWED with why):\n"
                       + "\n".join(wrong))


def test_every_allowed_place_still_exchanges():
    """An entry of ALLOWED whose exchange is gone is removed with it (the list stays short and true)."""
    places = {(m, f) for m, f, _, _ in scan()}
    stale = sorted(set(ALLOWED) - places)
    assert not stale, f"ALLOWED names places that no longer exchange: {stale}"
    assert all(len(why) > 20 for why in ALLOWED.values())


def test_the_scanner_sees_every_form():
    """The checker itself: an object allgather, the agreement allgather and max/min allreduces (a string op,
    MPI.MAX, a keyword op=MPI.MIN, async, one handed to a starter) are found, each in its function; a sum
    allreduce is not."""
    probe = ("def a(comm, x):\n    return comm.allgather_object(x)\n"
             "def b(t, s, r):\n    t.agree_allgather(s, r)\n"
             "def c(comm, f):\n    comm.allreduce(f, 'max', async_op=True)\n"
             "def d(comm, MPI, f):\n    comm.Allreduce(MPI.IN_PLACE, f, MPI.MAX)\n"
             "class E:\n    def e(self, comm, MPI):\n        return comm.allreduce(3, op=MPI.MIN)\n"
             "def f(comm, x):\n    comm.allreduce(x, 'sum')\n"
             "def g(self, flag):\n    return self._start(None, self._comm.allreduce, flag, 'max')\n"
             "def h(comm, MPI, f):\n    OPERATIONS['allreduce'].call(comm, [f], MPI.MAX, in_place=MPI.IN_PLACE)\n")
    got = [(f, line, call) for _, f, line, call in exchanges("probe", probe)]
    assert got == [("a", 2, "comm.allgather_object"), ("b", 4, "t.agree_allgather"), ("c", 6, "comm.allreduce"),
                   ("d", 8, "comm.Allreduce"), ("e", 11, "comm.allreduce"), ("g", 15, "self._start"),
                   ("h", 17, "OPERATIONS['allreduce'].call")], got

"""The layers of ``src/collectives`` import downward only, and there are no import cycles.

Every import counts, also one inside a function (a deferred import of a module above is still an upward
dependency). The layers are written down in docs/architecture.md; this test is their definition.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "collectives"

# module -> layer; a module may import modules of its own layer's lower layers (and, for the two
# multi-module layers below, the listed siblings of the same layer)
LAYERS = {
    # 0: the bottom: no library module above it
    "_version": 0, "_errors": 0, "_ops": 0, "_config": 0, "_dtypes": 0, "_arrays": 0, "_agree": 0,
    "_threads": 0, "_registry": 0, "_launcher": 0, "_handles": 0, "_poll": 0, "_trace": 0, "_p2p": 0, "_call": 0,
    "_finite": 0, "_trace_torch": 0, "_records": 0, "_native": 0,
    # 1: transports
    "_backends._libnccl": 1, "_backends.base": 1, "_backends.self": 1, "_backends.shm": 1,
    "_backends.mpi": 1, "_backends.mpi.ops": 1, "_backends.mpi.library": 1, "_backends.mpi.lanes": 1,
    "_backends.mpi.requests": 1, "_backends.mpi.p2p": 1, "_backends.mpi.pipeline": 1, "_backends.mpi.fast": 1,
    "_backends.mpi.shared": 1,    "_backends.mpi.transport": 1, "_backends.mpi.deadline": 1, "_backends._fingerprint": 1, "_backends.device": 1, "_backends.cuda": 1, "_backends.nccl": 1,
    "_backends.factory": 1, "_backends.closed": 1, "_backends": 1,
    # 2: reduction rules
    "_reduction": 2, "_reproducible": 2,
    # 3: trees and buckets
    "_buckets": 3, "_tree": 3, "_structure": 3, "_timeline": 3,
    # 4: the call engine (the package _comm): the Communicator, init and the public functions
    "_comm": 4, "_comm.steps": 4, "_comm.record": 4, "_comm.validate": 4, "_comm.rules": 4, "_comm.summing": 4,
    "_comm.call": 4, "_comm.reductions": 4, "_comm.movement": 4, "_comm.p2p": 4, "_comm.objects": 4,
    "_comm.split": 4, "_comm.trees": 4, "_comm.engine": 4, "_comm.communicator": 4, "_comm.functions": 4,
    "_failure": 0,
    # 5: what stands on the public functions (DistributedOptimizer: the package _optim, WITHIN_OPTIM)
    "_shard": 5, "_optim": 5, "_optim.torch_optimizer": 5, "_optim.fused": 5, "_optim.meeting": 5,
    "_optim.transformation": 5, "_overlap": 5, "_gradients": 5, "_shards": 5, "_units": 5,
    # 6: the public names, the tools, and the front ends that import a framework (the torch backend: the
    # package torch_backend, WITHIN_TORCH_BACKEND)
    "__init__": 6, "_bench": 6, "_tracetool": 6, "__main__": 6, "jax": 6,
    "torch_backend": 6, "torch_backend.work": 6, "torch_backend.checks": 6, "torch_backend.uneven": 6,
    "torch_backend.group": 6, "torch_backend.rendezvous": 6, "torch_backend.creator": 6,
    "torch_backend.excepthook": 6,
}
# within the transport layer: who may import whom (the factory knows every transport; the others know only
# their bases and the shared memory allreduce)
MPI_PARTS = {"_backends.base", "_backends.shm", "_backends._fingerprint"}  # what the MPI package's modules know
TRANSPORT_IMPORTS = {
    # the MPI package: from the table and the library up to the two transports, then the package's re-exports
    "_backends.mpi.ops": set(),
    "_backends.mpi.library": {"_backends.shm"},
    "_backends.mpi.requests": {"_backends.base", "_backends._fingerprint"},
    "_backends.mpi.lanes": {"_backends.base", "_backends._fingerprint", "_backends.mpi.requests"},
    "_backends.mpi.p2p": {"_backends.base", "_backends.mpi.ops"},
    "_backends.mpi.pipeline": {"_backends.base", "_backends.mpi.ops"},
    "_backends.mpi.shared": {"_backends.base", "_backends.shm", "_backends.mpi.ops"},
    "_backends.mpi.fast": {"_backends.base", "_backends.mpi.library", "_backends.mpi.ops", "_backends.mpi.requests"},
    "_backends.mpi.transport": MPI_PARTS | {"_backends.mpi." + m for m in (
        "fast", "lanes", "library", "ops", "p2p", "pipeline", "requests", "shared")},
    "_backends.mpi.deadline": {"_backends.mpi.ops", "_backends.mpi.p2p", "_backends.mpi.transport"},
    "_backends.mpi": {"_backends.mpi." + m for m in ("deadline", "library", "ops", "pipeline", "transport")},
    "_backends._fingerprint": set(),
    "_backends.self": {"_backends.base"},
    "_backends.device": set(),
    "_backends.cuda": {"_backends.device", "_backends._libnccl"},
    "_backends.nccl": {"_backends.device", "_backends._libnccl"},
    "_backends.factory": {"_backends.base", "_backends.cuda", "_backends.device", "_backends.self",
                          "_backends.mpi", "_backends.nccl", "_backends._libnccl"},
    "_backends.shm": {"_backends.mpi.ops"},  # the node barriers and the leaders' allreduce, from their rows
    "_backends.closed": set(),
    "_backends.base": set(),
    "_backends._libnccl": set(),
    "_backends": set(),
}
WITHIN_TREES = {"_tree": {"_buckets", "_structure"}, "_buckets": set(), "_structure": set()}
# within the call engine: who may import whom, from the bottom (the steps' vocabulary) to the top (the
# functions, then the package's re-exports)
WITHIN_COMM = {
    "_comm.steps": set(),
    "_comm.record": set(),
    "_comm.validate": {"_comm.record"},
    "_comm.rules": {"_comm.steps"},
    "_comm.summing": {"_comm.rules", "_comm.steps"},
    "_comm.call": {"_comm.rules", "_comm.steps"},
    "_comm.reductions": {"_comm.rules", "_comm.summing", "_comm.validate", "_comm.steps"},
    "_comm.movement": {"_comm.call", "_comm.record", "_comm.validate", "_comm.steps"},
    "_comm.p2p": {"_comm.record", "_comm.validate", "_comm.steps"},
    "_comm.objects": {"_comm.record", "_comm.validate"},
    "_comm.split": {"_comm.record"},
    "_comm.trees": {"_comm.record"},
    "_comm.engine": {"_comm.call", "_comm.movement", "_comm.p2p", "_comm.record", "_comm.reductions", "_comm.rules",
                     "_comm.summing", "_comm.validate"},
    "_comm.communicator": {"_comm.call", "_comm.engine", "_comm.movement", "_comm.objects", "_comm.p2p",
                           "_comm.record", "_comm.reductions", "_comm.split", "_comm.summing", "_comm.trees"},
    "_comm.functions": {"_comm.communicator"},
    "_comm": {"_comm.communicator", "_comm.engine", "_comm.functions"},
}

# within DistributedOptimizer (the package _optim): its __init__ (the function) makes one of the two wrappers
WITHIN_OPTIM = {
    "_optim.fused": set(),
    "_optim.meeting": set(),
    "_optim.transformation": set(),
    "_optim.torch_optimizer": {"_optim.fused", "_optim.meeting"},
    "_optim": {"_optim.torch_optimizer", "_optim.transformation"},
}
# within the torch backend: who may import whom, from the bottom (the Work, torch's arguments read, the
# rendezvous) to the top (the package: register())
WITHIN_TORCH_BACKEND = {
    "torch_backend.work": set(),
    "torch_backend.checks": set(),
    "torch_backend.rendezvous": set(),
    "torch_backend.excepthook": set(),
    "torch_backend.uneven": {"torch_backend.checks", "torch_backend.work"},
    "torch_backend.group": {"torch_backend.checks", "torch_backend.uneven", "torch_backend.work"},
    "torch_backend.creator": {"torch_backend.group", "torch_backend.rendezvous", "torch_backend.work"},
    "torch_backend": {"torch_backend.creator", "torch_backend.excepthook", "torch_backend.group",
                      "torch_backend.rendezvous", "torch_backend.work"},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """The library modules ``path`` imports (anywhere in the file), as names relative to the package."""
    name = module_name(path)
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    if name == "__init__":
        package = []
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module and node.module.startswith("collectives."):
                    base = node.module.split(".")[1:]
                elif node.module == "collectives":
                    base = []
                else:
                    continue
            else:
                base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            for alias in node.names:
                candidate = ".".join([*base, alias.name])
                found.add(candidate if candidate in LAYERS else ".".join(base))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("collectives."):
                    found.add(".".join(alias.name.split(".")[1:]))
    return {m for m in found if m and m != name}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in SRC.rglob("*.py")}


def test_every_module_has_a_layer():
    assert set(graph()) <= set(LAYERS), f"add to LAYERS: {sorted(set(graph()) - set(LAYERS))}"


def test_imports_go_downward_only():
    wrong = []
    for mod, deps in graph().items():
        for dep in deps:
            if dep not in LAYERS:
                wrong.append(f"{mod} imports unknown {dep}")
            elif LAYERS[dep] > LAYERS[mod]:
                wrong.append(f"{mod} (layer {LAYERS[mod]}) imports {dep} (layer {LAYERS[dep]})")
            elif LAYERS[dep] == LAYERS[mod] == 1 and dep not in TRANSPORT_IMPORTS[mod]:
                wrong.append(f"transport {mod} imports {dep}")
            elif LAYERS[dep] == LAYERS[mod] == 3 and dep not in WITHIN_TREES[mod]:
                wrong.append(f"{mod} imports {dep}")
            elif LAYERS[dep] == LAYERS[mod] == 4 and dep not in WITHIN_COMM[mod]:
                wrong.append(f"call engine module {mod} imports {dep}")
            elif mod in WITHIN_OPTIM and dep.split(".")[0] == "_optim" and dep not in WITHIN_OPTIM[mod]:
                wrong.append(f"DistributedOptimizer module {mod} imports {dep}")
            elif mod in WITHIN_TORCH_BACKEND and LAYERS[dep] == 6 and dep not in WITHIN_TORCH_BACKEND[mod]:
                wrong.append(f"torch backend module {mod} imports {dep}")
            elif LAYERS[dep] == LAYERS[mod] == 0 and mod != "_failure" and dep not in ("_errors", "_ops", "_dtypes", "_threads", "_poll",
                                                                                    "_trace", "_trace_torch", "_records", "_config",
                                                                                    "_agree"):
                wrong.append(f"bottom-layer {mod} imports {dep}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for d in g.get(m, ()):
            if state.get(d) == 1:
                raise AssertionError(" -> ".join([*stack, m, d]))
            if d not in state:
                visit(d, [*stack, m])
        state[m] = 2

    for m in g:
        if m not in state:
            visit(m, [])


def test_the_checker_sees_deferred_and_relative_imports(tmp_path):
    """The checker itself: an import inside a function, relative or absolute, is found."""
    assert "_timeline" in imports(SRC / "_comm" / "communicator.py")  # imported inside __init__, from ..
    assert {"_comm.steps", "_call"} <= imports(SRC / "_comm" / "rules.py")  # from . and from ..
    assert "_backends.nccl" in imports(SRC / "_backends" / "factory.py")  # imported inside a function
    assert {"_errors", "_dtypes"} <= imports(SRC / "_reduction.py") | {"_errors"}


# ---- attribute reaches: the layers built on the Communicator use its Engine, never its privates ----

def in_the_engine(name: str) -> bool:
    """Whether module ``name`` is part of the call engine (the package ``_comm``)."""
    return name == "_comm" or name.startswith("_comm.")


def communicator_privates() -> set[str]:
    """Every private name of ``Communicator``: its ``_methods`` (written in the class or bound there from
    a module of the engine) and the ``_attributes`` set on it: ``self._x`` in the class, ``comm._x`` (or
    ``c._x``, ``child._x``) in the engine's modules."""
    tree = ast.parse((SRC / "_comm" / "communicator.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Communicator")
    names = set()
    for node in cls.body:  # the bound entries: _transport_for = call.transport_for
        if isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name) and t.id.startswith("_")
                         and not t.id.startswith("__"))
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_") \
                and not node.name.startswith("__"):
            names.add(node.name)
    owners = ("self", "comm", "c", "child")
    for path in (SRC / "_comm").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in owners and node.attr.startswith("_") \
                    and (path.name == "communicator.py" or node.value.id != "self"):
                names.add(node.attr)
    return names


def reaches(name: str, source: str, privates: set[str]) -> list[str]:
    """``x._name`` in module ``name``'s ``source``, ``_name`` a private of the Communicator, ``x`` anything
    but ``self``/``cls`` (a class's own attributes may share a name: a device transport's ``self._host``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in privates:
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue  # the class's own attribute (a transport's _host, a bucket's _pool ...)
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue  # its base class's
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def test_no_layer_reaches_into_the_communicator():
    """Outside the engine (``_comm``), no module reads a private attribute of a Communicator (it gets the Engine: public
    methods; ``engine_of(comm)`` hands it over) — the import rule above, for calls at run time."""
    privates = communicator_privates()
    assert {"_transport_for", "_blocking", "_async", "_fast_path", "_runners", "_seq", "_plans", "_pool",
            "_devices", "_engine"} <= privates
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if not in_the_engine(module_name(path)):
            found += reaches(module_name(path), path.read_text(), privates - {"_engine"})
    assert not found, "reaches into Communicator privates (use the Engine):\n" + "\n".join(found)


def test_the_reach_checker_sees_a_reach():
    """The checker itself: ``comm._transport_for(...)`` and ``self._comm._devices`` are found; a class's own
    ``self._pool`` is not."""
    probe = ("def f(comm):\n    return comm._transport_for(1), comm._plans\n"
             "class T:\n    def g(self):\n        return self._comm._devices, self._pool\n")
    got = reaches("probe", probe, communicator_privates())
    assert got == ["probe:2: comm._plans", "probe:2: comm._transport_for", "probe:5: self._comm._devices"], got


def engine_api() -> set[str]:
    """The public methods and properties of ``Engine`` (``_comm/engine.py``), less ``communicator``: what a
    layer below the Communicator may use of it."""
    tree = ast.parse((SRC / "_comm" / "engine.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def holders(source: str) -> set[str]:
    """What ``source`` stores a ``.communicator`` in (``self._comm = engine.communicator``: ``self._comm``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and any(
                isinstance(n, ast.Attribute) and n.attr == "communicator" for n in ast.walk(node.value)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(ast.unparse(t) for t in targets)
    return found


def upward_calls(name: str, source: str, api: set[str], held: set[str] = frozenset()) -> list[str]:
    """In a transport module's ``source``: a read of ``.communicator`` (of an engine, or of anything: the
    Communicator is reached only that way), a call of a method on what one was stored in (``held``, from
    :func:`holders` of every transport module: a subclass calls what its base stored), a name
    ``Communicator`` or ``engine_of``, and a use of an engine (``engine.x``, ``self._engine.x``) that is not
    one of the Engine's public members ``api``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value
            engine = (isinstance(owner, ast.Name) and owner.id == "engine") or (
                isinstance(owner, ast.Attribute) and owner.attr == "_engine")
            if node.attr == "communicator" or (engine and node.attr not in api) or ast.unparse(owner) in held:
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Name) and node.id in ("Communicator", "engine_of"):
            found.append(f"{name}:{node.lineno}: {node.id}")
    return sorted(found)


def test_no_transport_calls_the_communicator():
    """docs/architecture.md, "The engine interface": calls run downward. No module under ``_backends`` holds
    or calls a Communicator: none reads ``.communicator`` (an Engine's, or anything's) or uses what it was
    stored in, names ``Communicator`` or ``engine_of``, or imports ``_registry`` (which holds
    Communicators), and an engine is used only through the Engine's public methods (a device transport
    runs its copies in host memory through ``Engine.staged``: the host collective's steps inside the
    running call, not a second call with its own record and agreement)."""
    api = engine_api()
    assert {"staged", "host", "check", "transport_for"} <= api and "communicator" not in api
    paths = sorted((SRC / "_backends").rglob("*.py"))
    held = set().union(*(holders(p.read_text()) for p in paths))
    found = []
    for path in paths:
        name = module_name(path)
        found += upward_calls(name, path.read_text(), api, held)
        found += [f"{name} imports {m}" for m in imports(path) if m == "_registry" or in_the_engine(m)]
    assert not found, "a transport calls upward (give the Engine what it needs):\n" + "\n".join(found)


def test_the_upward_call_checker_sees_an_upward_call():
    """The checker itself: holding ``engine.communicator`` and calling its collective (also from a
    subclass), an Engine private, a member the Engine lacks and ``engine_of`` are found; ``Engine.staged``
    and a class's own attributes are not."""
    base = ("class T:\n    def __init__(self, engine):\n        self._comm = engine.communicator\n"
            "        self._engine, self._host = engine, engine.host\n"
            "    def f(self, x):\n        self._comm.allreduce(x, 'sum')\n        self._engine.staged('allreduce', x, 'sum')\n"
            "        self._engine._x, self._engine.allreduce(x), self._host.allreduce(x, 'sum')\n"
            "        return engine_of(x)\n")
    sub = "class U(T):\n    def g(self, x):\n        return self._comm.check, self._host.check\n"
    held = holders(base) | holders(sub)
    assert held == {"self._comm"}, held
    got = upward_calls("base", base, engine_api(), held) + upward_calls("sub", sub, engine_api(), held)
    assert got == ["base:3: engine.communicator", "base:6: self._comm.allreduce", "base:8: self._engine._x",
                   "base:8: self._engine.allreduce", "base:9: engine_of", "sub:3: self._comm.check"], got


def test_the_architecture_page_names_every_module_in_its_layer():
    """docs/architecture.md's module table names exactly the modules of src/collectives, each in the layer
    this file gives it: a module added, removed or moved is a change of the page too."""
    import re

    page = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    table = page.split("## Modules", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d) \| `([\w.]+)` \|", table, re.M)
    documented = {name: int(layer) for layer, name in rows}
    assert len(rows) == len(documented), "a module is listed twice"
    assert set(documented) == set(graph()), (f"missing from the page: {sorted(set(graph()) - set(documented))}; "
                                             f"not a module: {sorted(set(documented) - set(graph()))}")
    wrong = {m: (documented[m], LAYERS[m]) for m in documented if documented[m] != LAYERS[m]}
    assert not wrong, f"module: (layer on the page, layer here): {wrong}"


def mpi_transport_privates() -> set[str]:
    """The private attributes and methods of the MPI transports (``self._x = ...`` and ``def _x``): their
    classes and every base class of theirs written in the package ``_backends/mpi`` (its parts)."""
    classes = {n.name: n for p in (SRC / "_backends" / "mpi").glob("*.py") for n in ast.parse(p.read_text()).body
               if isinstance(n, ast.ClassDef)}
    todo, seen = ["MPITransport", "DeadlineMPITransport"], set()
    while todo:
        name = todo.pop()
        if name in classes and name not in seen:
            seen.add(name)
            todo += [b.id for b in classes[name].bases if isinstance(b, ast.Name)]
    assert {"MPITransport", "DeadlineMPITransport", "LaneMaking", "HotPath"} <= seen, seen
    names = set()
    for cls in (classes[name] for name in seen):
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_") and not node.name.startswith("__"):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr.startswith("_"):
                names.add(node.attr)
    return names


def test_no_module_reaches_into_the_mpi_transport():
    """No other transport, and not the torch backend (the modules that hold an MPI transport), reads a
    private of the MPI transport: CUDA-aware MPI makes its MPI calls through ``call`` (a row of
    ``ops.OPERATIONS`` on its buffers) and takes lanes and datatypes through ``lane`` and ``mpi_type``; the torch backend makes its groups through ``create_group``. (By name, as
    above: the engine's own ``_progress`` or ``_p2p_seq`` would read as a reach, so ``_comm`` is not
    scanned; test_no_layer_reaches_into_the_communicator keeps the Communicator's side.)"""
    privates = mpi_transport_privates()
    assert {"_lanes", "_types", "_ops", "_make_lane", "_begin"} <= privates
    found = []
    for path in sorted(SRC.rglob("*.py")):
        name = module_name(path)
        if (name.startswith("_backends") and not name.startswith("_backends.mpi")) or name.split(".")[0] == "torch_backend":
            found += reaches(name, path.read_text(), privates)
    assert not found, "reaches into MPITransport privates (give it a public method):\n" + "\n".join(found)


def test_the_reduction_rules_are_written_once():
    """docs/architecture.md, "One rule, every path": the op on the wire (mean travels as a sum) and
    bfloat16's widening are written once, in ``_dtypes``, and used from everywhere else."""
    import re

    texts = {module_name(p): p.read_text() for p in SRC.rglob("*.py")}
    wire_op = {m for m, t in texts.items() if re.search(r"""["']sum["'] if op == ["']mean["']""", t)}
    widen = {m for m, t in texts.items() if "<<= 16" in t}
    assert wire_op == {"_dtypes"} and texts["_dtypes"].count("if op == \"mean\" else") == 1, wire_op
    assert widen == {"_dtypes"} and texts["_dtypes"].count("<<= 16") == 1, widen

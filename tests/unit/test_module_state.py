"""Module-level state is only what is process-wide (docs/architecture.md, "State belongs to its owner").

A communicator owns its tables, pools, plans and transports (``close()`` releases them); what a module
keeps at its top level is shared by every communicator of the process. This test finds every such store,
a top-level name that the module's code changes at run time (rebinds through ``global``, assigns an item
or an attribute of, or calls a mutating method on: ``append``, ``add``, ``setdefault``, ...), and holds
each to :data:`PROCESS_WIDE`, which says why it is the process's and not a communicator's. A new store
must be listed with its reason (or belong to its owner instead); an entry whose store is gone must leave.

(A store changed only through a local alias, ``kinds = _KINDS; kinds[k] = v``, is not seen: the scan is
by name. Upper-case tables that are never changed are constants, not state, and are not listed.)
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "collectives"
MUTATORS = {"append", "appendleft", "insert", "add", "update", "pop", "popitem", "popleft", "clear", "setdefault",
            "remove", "discard", "extend", "__setitem__"}

LOADED = "a memo of what the process has loaded or looked up once (the same for every communicator)"
PROCESS_WIDE = {  # "module:name" -> why the process holds it, not a communicator
    "_arrays:_BY_TYPE": LOADED + ": the array adapter of each array type",
    "_arrays:bump_versions": "torch's entry point that bumps a tensor's version, bound at its first call",
    "_backends._libnccl:_CDLLS": "the loaded libnccl (one per process, whatever the communicators)",
    "_backends._libnccl:_LIBRARIES": "the loaded libnccl's bindings, by path",
    "_backends.cuda:_warned": "a warning said once per process",
    "_backends.device:_APIS": LOADED + ": the CUDA adapter of each array library (torch, CuPy)",
    "_backends.mpi.library:_OPS_CACHE": LOADED + ": the MPI library's ops, made once",
    "_backends.mpi.library:_TYPES_CACHE": LOADED + ": the MPI library's datatypes, made once",
    "_backends.mpi.library:_warned": "a warning said once per process",
    "_reproducible:_compiled": "the loaded compiled float32 passes (_kernels.c: one library per process)",
    "_native:_library": "the loaded compiled passes (_kernels.c: one library per process)",
    "_native:_adders": LOADED + ": the compiled sum pass of each dtype, bound once",
    "_bench:_printed_header": "the bench command's output: its header printed once per process",
    "_call:_codes": LOADED + ": the code of each dtype in use (a call description's field)",
    "_call:_heads": LOADED + ": the head of a call description, by (collective, op, dtype, root, naming)",
    "_call:_names": LOADED + ": the name of each dtype code met, for messages",
    "_comm.communicator:_strided": "NumPy's strided-array check, bound once a hot path is first cached",
    "_comm.communicator:_torch_tensor": "torch.Tensor once torch is imported (the hot path compares classes)",
    "_comm.communicator:_from_numpy": "torch.from_numpy, bound with _torch_tensor (the tensors' hot paths wrap results)",
    "_comm.functions:_atexit_registered": "the world communicator's finalize at exit, registered once",
    "_comm.functions:_named": "the counter that names the process's communicators (world.0, world.1, ...)",
    "_comm.functions:_world": "the world communicator: one per process",
    "_dtypes:_CACHE": LOADED + ": the reduction plan of each (dtype, op)",
    "_dtypes:_quiet_state": "NumPy's error state is per thread of the process: the memo of dividing quietly",
    "_failure:_installed": "the process's excepthook (the abort on an uncaught exception), installed once",
    "_failure:_previous": "the excepthook that was there before ours, called after it",
    "_handles:ABANDONED": "MPI requests of handles dropped unfinished, kept alive until MPI completes them "
                          "(MPI owns their buffers meanwhile, whichever communicator made them)",
    "_records:_LINES": LOADED + ": the line of each (code, instruction) call site",
    "_records:_DTYPE_NAMES": LOADED + ": the name in the dumps of each dtype a record held",
    "_records:_PATHS": "the last few stack paths to a user's call site, shared by every record",
    "_records:_hinting": "how many call-site hint blocks are under way, on any thread (records read the "
                         "thread's hint only then)",
    "_records:_site_hint": "the call site hint of the running thread (a thread-local)",
    "_registry:_keyval": "the MPI attribute key that maps an mpi4py communicator to ours, made once",
    "_registry:_made": "our communicator of each mpi4py communicator the process wraps",
    "_structure:_KIND": LOADED + ": how each container type of a tree is walked",
    "_timeline:_collect": "the general-path calls under way in the process (only they collect phases)",
    "_timeline:_depth": "the nesting of timed calls in the running thread",
    "_timeline:_jobs": "the process's timeline writer, by path prefix (COLLECTIVES_TIMELINE: one per process)",
    "_timeline:_marks": "the phases of the call in progress (one thread at a time is inside a collective)",
    "_trace:_LIVE": "the communicators' engines a dump of this process covers (a dump is per process)",
    "_trace:_dumping": "whether the process is writing a dump (a signal may ask for one meanwhile)",
    "_trace:_ending": "the process's exit in progress (no dump then)",
    "_trace:_job": "the job and rank the process's dumps are named by",
    "_trace:_reasons": "why the process dumps (every reason of a dump)",
    "_trace:_served_at": "when the process last served a dump request (SIGUSR1)",
    "_trace:_signalled": "whether SIGUSR1 arrived (the handler only notes it)",
    "_trace:_wakeup": "the wakeup pipe of the process's signal handler",
    "_trace:_watcher": "the process's one stall watcher thread",
    "_trace_torch:OPS": "torch's numbering of the torch backend's operations, by communicator name, bounded "
                        "(KEPT each): read when the process writes a dump in torch's format, which may be "
                        "after the communicator is closed",
    "_trace_torch:_tmp": "a counter for the process's temporary dump files",
    "jax:_inside": "whether the running thread is inside a jitted program's callback (a thread-local)",
    "torch_backend.creator:_groups": "the world's MPI transport that makes torch's groups: torch's default "
                                     "group is the process's",
    "torch_backend.rendezvous:_OPEN": "the FileStore's open file, kept for the life of the process",
    "torch_backend.rendezvous:_PMI_SERVERS": "the PMI server rank 0 of a torchrun job started, kept until exit",
}


def stores(text: str) -> dict[str, int]:
    """The top-level names of module ``text`` that its code changes at run time -> the first line that does."""
    tree = ast.parse(text)
    top = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if (
            isinstance(node, ast.AnnAssign) and node.value is not None) else []
        top.update(t.id for t in targets if isinstance(t, ast.Name))
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            for name in node.names:
                found.setdefault(name, node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name) and t.value.id in top:
                    found.setdefault(t.value.id, node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
              and isinstance(node.func.value, ast.Name) and node.func.value.id in top):
            found.setdefault(node.func.value.id, node.lineno)
    return found


def all_stores() -> dict[str, int]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        out.update({f"{module}:{name}": line for name, line in stores(path.read_text()).items()})
    return out


def test_every_module_level_store_is_process_wide():
    found = all_stores()
    unlisted = [f"{key} (line {line})" for key, line in found.items() if key not in PROCESS_WIDE]
    assert not unlisted, ("module-level state not listed as process-wide: give it to its owner (a communicator, "
                          "a transport) or list it in PROCESS_WIDE with why:\n" + "\n".join(unlisted))
    stale = sorted(set(PROCESS_WIDE) - set(found))
    assert not stale, f"listed, but no longer module-level state (remove from PROCESS_WIDE): {stale}"


def test_the_scan_sees_each_way_of_changing_a_store():
    text = ("A = {}\nB = []\nC = [0]\nD = None\nE = {}\nF = (1, 2)\n\n\ndef f():\n    global D\n    D = 1\n"
            "    A['k'] = 1\n    B.append(2)\n    C[0] += 1\n    x = F[0]\n    return E.get(x)\n")
    assert sorted(stores(text)) == ["A", "B", "C", "D"]

"""Only ``_config`` reads the environment (docs/architecture.md): every other module of ``src/collectives``
asks ``_config``, so that every variable is read, validated and documented in one place.

A read is any use of ``os.environ``/``os.environb``/``os.getenv``/``os.getenvb``/``os.putenv``/``os.unsetenv``
(under any name ``os`` is imported as) or an import of one of them from ``os``.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "collectives"
ENVIRONMENT = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
ALLOWED = {"_config.py"}  # the one module that reads the environment


def environment_reads(source: str) -> list[int]:
    """The line numbers in ``source`` that read (or write) the environment other than through ``_config``."""
    tree = ast.parse(source)
    os_names = {"os"}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for a in node.names if a.name in ENVIRONMENT or a.name == "*"]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in ENVIRONMENT and isinstance(node.value, ast.Name)
                and node.value.id in os_names):
            lines.append(node.lineno)
    return sorted(lines)


def test_only_config_reads_the_environment():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).as_posix() in ALLOWED:
            continue
        found += [f"{path.relative_to(SRC)}:{line}" for line in environment_reads(path.read_text())]
    assert not found, "read through a function of _config instead: " + ", ".join(found)


def test_the_config_module_does_read_it():
    # the checker is pointed at the right files: the one allowed module is there and reads the environment
    assert environment_reads((SRC / "_config.py").read_text())


def test_the_checker_sees_every_form_of_read():
    assert environment_reads("import os\nx = os.environ.get('A')\n") == [2]
    assert environment_reads("import os as o\n\ndef f():\n    return o.getenv('A')\n") == [4]
    assert environment_reads("from os import environ\n") == [1]
    assert environment_reads("from os import getenv as g, path\n") == [1]
    assert environment_reads("import os\nos.putenv('A', '1')\nos.environb\n") == [2, 3]
    assert environment_reads("import os\nos.path.join('a', 'b')\nd = {}\nd.environ = 1\n") == []

"""Expected failures, one file per (backend, array library), each entry with its reason.

A file is ``<backend>-<lib>.txt`` in the xfail directory; either part may be ``all``. A line is

    <test-id-glob> [sizes=2,3] [run=false]  # reason

The glob is matched against the test's name (``test_allreduce[torch-complex32-sum-nd-odd]``) and against its
node id within the suite (``test_values.py::test_allreduce[...]``); only ``*`` and ``?`` are wildcards,
brackets are literal. ``sizes=`` limits the entry to those world sizes; ``run=false`` does not even run the
test (for a crash or a hang). A line without a reason is an error. Matching tests are marked
``xfail(strict=True)``: a test that passes although it is listed fails the run, so a fixed gap shows up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path


class XfailFileError(ValueError):
    pass


@dataclass
class Entry:
    file: str
    line: int
    glob: str
    reason: str
    sizes: tuple[int, ...] | None = None
    run: bool = True
    regex: re.Pattern = field(init=False, repr=False)
    used: int = 0

    def __post_init__(self):
        parts = [".*" if c == "*" else "." if c == "?" else re.escape(c) for c in self.glob]
        self.regex = re.compile("".join(parts) + r"\Z")

    def matches(self, name: str, nodeid: str, size: int) -> bool:
        if self.sizes is not None and size not in self.sizes:
            return False
        return bool(self.regex.match(name) or self.regex.match(nodeid))

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def parse(path: Path) -> list[Entry]:
    entries = []
    for lineno, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        body, sep, reason = line.partition("#")
        reason = reason.strip()
        if not sep or not reason:
            raise XfailFileError(f"{path}:{lineno}: an expected failure needs a reason after '#': {raw!r}")
        fields = body.split()
        if not fields:
            raise XfailFileError(f"{path}:{lineno}: no test id glob before the reason: {raw!r}")
        entry = Entry(path.name, lineno, fields[0], reason)
        for opt in fields[1:]:
            key, _, value = opt.partition("=")
            if key == "sizes":
                try:
                    entry.sizes = tuple(int(s) for s in value.split(",") if s)
                except ValueError:
                    raise XfailFileError(f"{path}:{lineno}: sizes= takes integers, got {value!r}") from None
            elif key == "run" and value.lower() in ("false", "true", "0", "1", "no", "yes"):
                entry.run = value.lower() in ("true", "1", "yes")
            else:
                raise XfailFileError(f"{path}:{lineno}: unknown option {opt!r} (expected sizes=... or run=false)")
        entries.append(entry)
    return entries


def load(directory: Path, backend: str, libs: list[str]) -> dict[str, list[Entry]]:
    """Entries by library ('all' for the ones that apply to every library) for this backend."""
    found: dict[str, list[Entry]] = {}
    if not directory.is_dir():
        return found
    for b in (backend, "all"):
        for lib in [*libs, "all"]:
            path = directory / f"{b}-{lib}.txt"
            if path.is_file():
                found.setdefault(lib, []).extend(parse(path))
    return found


def match(entries: dict[str, list[Entry]], lib: str | None, name: str, nodeid: str, size: int) -> Entry | None:
    for key in ([lib] if lib else []) + ["all"]:
        for entry in entries.get(key, []):
            if entry.matches(name, nodeid, size):
                entry.used += 1
                return entry
    return None

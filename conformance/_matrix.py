"""The parameter matrices, built from the options: every library x dtype x op x layout, full or sampled.

Sampling (the default) keeps every library x dtype x op on the canonical layout (``nd-odd``, every root)
and adds one more layout per combination, chosen round-robin (offset by the seed) so that every layout is
exercised for every collective and library; ``--full`` runs every layout with every root. The choice
depends only on the options, never on the rank or the world size, so every rank collects the same tests
and a test id means the same test at every world size.
"""

from __future__ import annotations

import pytest

from . import _dtypes, _libs, _options

COLLECTIVES = ("broadcast", "allreduce", "reduce", "allgather")
REDUCTIONS = ("allreduce", "reduce")


def options() -> _options.Options:
    return _options.get()


def lib_status(name: str) -> str | None:
    """None if the library can be used with the chosen backend, else why not."""
    lib = _libs.get(name)
    kind = options().device_kind
    if lib.device != kind:
        where = "host memory" if lib.device == "host" else "CUDA memory"
        return (f"{name} arrays live in {where}, and backend {options().backend!r} serves "
                f"{'host' if kind == 'host' else 'CUDA'} arrays")
    return lib.unavailable()


_usable_cache: dict = {}


def usable_libs() -> list[str]:
    key = tuple(options().libs), options().backend
    if key not in _usable_cache:
        _usable_cache[key] = [n for n in options().libs if lib_status(n) is None]
    return _usable_cache[key]


def meta(**kw):
    return pytest.mark.conformance(**kw)


def layouts_for(lib: _libs.Lib, group: str, index: int) -> list[str]:
    """The layouts one combination runs on: all (full) or the canonical one plus one more."""
    if options().full:
        return list(lib.layouts)
    others = [name for name in lib.layouts if name != _libs.CANONICAL]
    return [_libs.CANONICAL, others[(index + options().seed + _dtypes.seed_of(group)) % len(others)]]


def every_root_op(lib_name: str, spec) -> str:
    """In the sampled suite, the one op per (library, dtype) whose reduce runs every root (rotating)."""
    legal = [op for op in _dtypes.OPS if _dtypes.legal(op, spec.kind)]
    return legal[(_dtypes.seed_of(lib_name, spec.name) + options().seed) % len(legal)]


def value_cases(collective: str) -> list:
    """(lib, dtype, op, layout) for the reductions; (lib, dtype, None, layout) for the others."""
    cases = []
    for name in usable_libs():
        lib = _libs.get(name)
        index = 0
        for spec in lib.dtypes():
            ops = [op for op in _dtypes.OPS if _dtypes.legal(op, spec.kind)] if collective in REDUCTIONS else [None]
            for op in ops:
                for layout in layouts_for(lib, f"{collective}-{name}", index):
                    pid = "-".join(p for p in (name, spec.name, op, layout) if p)
                    cases.append(pytest.param(name, spec.name, op, layout, id=pid, marks=meta(
                        collective=collective, lib=name, dtype=spec.name, op=op, layout=layout)))
                index += 1
    return cases


def illegal_cases() -> list:
    """(lib, collective, dtype, op) for every pair the docs call a TypeError."""
    cases = []
    for name in usable_libs():
        for spec in _libs.get(name).dtypes():
            for op in _dtypes.OPS:
                if _dtypes.legal(op, spec.kind):
                    continue
                for collective in REDUCTIONS:
                    cases.append(pytest.param(name, collective, spec.name, op,
                                              id=f"{name}-{collective}-{spec.name}-{op}",
                                              marks=meta(collective=collective, lib=name, dtype=spec.name,
                                                         op=op, aspect="dtype/op legality")))
    return cases


def lib_cases(aspect: str, collectives=COLLECTIVES, layouts: bool = False, dtype: str | None = None) -> list:
    """(lib, collective[, layout]) for contract tests that do not depend on the dtype."""
    cases = []
    for name in usable_libs():
        lib = _libs.get(name)
        for collective in collectives:
            for layout in (lib.layouts if layouts else [None]):
                pid = "-".join(p for p in (name, collective, layout) if p)
                values = (name, collective, layout) if layouts else (name, collective)
                cases.append(pytest.param(*values, id=pid, marks=meta(
                    collective=collective, lib=name, dtype=dtype, layout=layout, aspect=aspect)))
    return cases


def libs_param(aspect: str, collective: str, only=None) -> list:
    names = [n for n in usable_libs() if only is None or n in only]
    return [pytest.param(n, id=n, marks=meta(collective=collective, lib=n, aspect=aspect)) for n in names]

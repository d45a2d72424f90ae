"""What the benchmark scripts share: size arguments, formatting, and the interleaved timing loop.

The scripts run as ``python benchmarks/<name>.py``, so this folder is on ``sys.path`` and they import it
as ``_common``.
"""

from __future__ import annotations

import argparse
import re
import time

import numpy as np

UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
         "g": 2**30, "gb": 2**30, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``8B``, ``4KiB``, ``64MiB`` ... -> bytes (an argparse type)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 8B, 4KiB, 64MiB")
    return int(m.group(1)) * UNITS[m.group(2).lower()]


def parse_sizes(text: str, factor: int) -> list[int]:
    """``8B..64MiB`` (the top, top/factor, ... and the bottom) or a comma list ``8B,1MiB``."""
    if ".." in text:
        lo, hi = sorted(parse_bytes(t) for t in text.split("..", 1))
        sizes, s = [], hi
        while s > lo:
            sizes.append(s)
            s //= factor
        sizes.append(lo)
    else:
        sizes = [parse_bytes(t) for t in text.split(",") if t.strip()]
    sizes = sorted(set(sizes))
    for s in sizes:
        if s < 4 or s % 4:
            raise SystemExit(f"size {s} B is not a whole number of float32 elements (a multiple of 4 B)")
    return sizes


def human(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def fmt_time(seconds: float, width: int = 8) -> str:
    """Microseconds below 1 ms, else milliseconds; NaN (nothing measured) as a dash."""
    if seconds != seconds:
        return f"{'-':>{width + 3}}"
    if seconds < 1e-3:
        return f"{seconds * 1e6:{width}.2f} us"
    return f"{seconds * 1e3:{width}.3f} ms"


def plan(nbytes: int, iters: int | None, *, budget: int = 160 * 2**20, min_calls: int = 31,
         max_calls: int = 20000, max_rounds: int = 61) -> tuple[int, int]:
    """(rounds, calls per round) for one side at this size: about ``budget`` bytes moved per side,
    between ``min_calls`` and ``max_calls`` calls, in at most ``max_rounds`` rounds; or ``iters`` calls."""
    if iters is not None:
        rounds = max(1, min(iters, max_rounds))
        return rounds, -(-iters // rounds)  # at least iters calls in all
    total = int(min(max_calls, max(min_calls, budget // max(nbytes, 1))))
    rounds = min(total, max_rounds)
    return rounds, -(-total // rounds)


def measure(barrier, sides, rounds: int, k: int, warmup: tuple[int, int] = (2, 50)) -> np.ndarray:
    """Time of one call (block time / k), shape (rounds, len(sides)), for this rank.

    The sides alternate within each round, in reversed order every other round, each block starting
    after ``barrier()``, so the machine's slow and fast phases hit every side alike. Each side is first
    called ``max(lo, min(k, hi))`` times (``warmup = (lo, hi)``): first calls allocate and set up paths.
    """
    lo, hi = warmup
    times = np.empty((rounds, len(sides)))
    for f in sides:
        for _ in range(max(lo, min(k, hi))):
            f()
    perf = time.perf_counter
    for r in range(rounds):
        order = range(len(sides)) if r % 2 == 0 else reversed(range(len(sides)))
        for i in order:
            f = sides[i]
            barrier()
            t0 = perf()
            for _ in range(k):
                f()
            times[r, i] = (perf() - t0) / k
    return times


def finish(start: float, results: dict, json_path: str | None) -> None:
    """Rank 0's end of a benchmark: the elapsed seconds since ``start`` (``time.perf_counter()``), and
    ``results`` written to ``json_path`` when one was given."""
    import json
    import time

    print(f"\n({time.perf_counter() - start:.0f} s)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)


def communicator_with(variable: str, value: str):
    """A new communicator of every rank (a duplicate of ``MPI.COMM_WORLD``) made with the environment
    variable ``variable`` set to ``value`` (unset again afterwards): the benchmarks' "on" and "off" sides."""
    import os

    from mpi4py import MPI

    import collectives

    os.environ[variable] = value
    try:
        return collectives.init(comm=MPI.COMM_WORLD.Dup())
    finally:
        os.environ.pop(variable, None)

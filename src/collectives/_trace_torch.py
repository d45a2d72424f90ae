"""The flight recorder's dumps in torch's own format, for ``python -m torch.distributed.flight_recorder.fr_trace``.

With ``COLLECTIVES_TRACE_FORMAT=torch`` or ``both`` each rank's dump (``_trace.dump``) is also written as
torch's flight recorder writes its own (``FlightRecorder::dump`` in c10d, format version 2.10): a pickle of
``{"version", "pg_config", "pg_status", "entries"}``, one file per rank named ``<prefix><rank>``, in a
directory of its own per job (``<dir>/<job>.torch/collectives_trace_rank_<R>``: the analyzer reads every
file of the directory it is given and takes the rank from the end of each name). Written with the standard
library only: torch is not needed to write it, only to read it.

How our record maps onto torch's:

- a communicator is a process group: its name (``world``, ``world.1``, ``comm1``) is the group's name, its
  ranks (as the job numbers them) the group's ranks;
- a collective's sequence number on its communicator is the entry's ``collective_seq_id`` and
  ``record_id`` (the entries of one rank ordered by it), ``op_id`` too;
- the collective is ``profiling_name`` ``nccl:<torch's name>`` (the analyzer accepts only the prefixes
  of torch's own backends: ``nccl`` stands for whichever transport ran it), e.g. ``allreduce`` is
  ``nccl:all_reduce``, ``allgather_object`` ``nccl:all_gather``, ``allreduce_tree`` ``nccl:allreduce_coalesced``;
- the array's shape and dtype are ``input_sizes``/``input_dtypes`` (torch's names: ``Float``, ``Double``)
  and the output's as torch records them (``all_gather``: ``size`` times the rows, ``reduce_scatter``: one
  block); a call whose shape the record does not keep (a completed hot-path call, a tree) has ``[[]]``;
- the state: ``completed``, else ``started`` (a call in progress, or one that failed: it never completed);
- ``frames``: the user's call site, where the record has one (else, for the call in progress, where the
  stack shows the thread).

Point-to-point calls are left out: torch numbers them with the collectives' sequence beside their own,
which our record does not keep.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading

VERSION = "2.10"  # torch's FlightRecorder format version this writes (c10d/FlightRecorder.hpp: version_val)
BACKEND = "nccl"
PREFIX = "collectives_trace_rank_"

# our collective -> torch's profiling name (after "nccl:")
NAMES = {"allreduce": "all_reduce", "broadcast": "broadcast", "reduce": "reduce", "allgather": "all_gather",
         "gather": "gather", "reduce_scatter": "reduce_scatter", "alltoall": "all_to_all", "barrier": "barrier",
         "broadcast_object": "broadcast", "allgather_object": "all_gather", "synchronize": "broadcast",
         "allreduce_tree": "allreduce_coalesced", "split": "split"}
# NumPy's dtype names -> c10::toString(ScalarType)
DTYPES = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16", "int64": "Long",
          "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte", "bool": "Bool", "uint16": "UInt16",
          "uint32": "UInt32", "uint64": "UInt64", "complex64": "ComplexFloat", "complex128": "ComplexDouble"}


def directory(trace_dir: str, job: str) -> str:
    """The directory of one job's torch-format dumps (give it to ``fr_trace``)."""
    return os.path.join(trace_dir, f"{job}.torch")


def path(trace_dir: str, job: str, rank: int) -> str:
    return os.path.join(directory(trace_dir, job), f"{PREFIX}{rank}")


def _sizes(entry: dict, size: int) -> tuple[list, list]:
    """``(input_sizes, output_sizes)`` of an entry as torch records them (one list per tensor)."""
    collective, shape = entry.get("collective"), entry.get("shape")
    if collective in ("broadcast_object", "synchronize", "allreduce_tree", "split", "barrier"):
        return [[]], [[]]
    if collective == "allgather_object":
        return [[]], [[size]]
    if shape is None:
        return ([[]], [[size]]) if collective in ("allgather", "gather") else ([[]], [[]])
    shape = [int(n) for n in shape]
    if collective in ("allgather", "gather"):
        return [shape], [[size, *shape]]
    if collective == "reduce_scatter" and shape:
        return [shape], [[shape[0] // max(size, 1), *shape[1:]]]
    return [shape], [shape]


def entry(e: dict, pg: tuple[str, str], pg_id: int, size: int, frame=None) -> dict:
    """One of our records (a dict of ``Engine.trace_entries``) as one of torch's entries."""
    collective = e.get("collective") or "unknown"
    dtype = e.get("dtype")
    dtypes = [] if dtype is None or collective in ("broadcast_object", "allgather_object", "allreduce_tree",
                                                   "synchronize") else [DTYPES.get(str(dtype), str(dtype))]
    inputs, outputs = _sizes(e, size)
    site = e.get("site") or frame
    start, end = e.get("start"), e.get("end")
    done = e.get("state") == "completed"
    return {
        "record_id": int(e["seq"]), "pg_id": pg_id, "process_group": pg, "collective_seq_id": int(e["seq"]),
        "p2p_seq_id": 0, "op_id": int(e["seq"]), "is_p2p": False,
        "profiling_name": f"{BACKEND}:{NAMES.get(collective, collective)}",
        "time_created_ns": int(start * 1e9) if start else 0,
        "input_sizes": inputs, "input_dtypes": dtypes, "output_sizes": outputs, "output_dtypes": list(dtypes),
        "state": "completed" if done else "started",
        "time_discovered_started_ns": int(start * 1e9) if start else None,
        "time_discovered_completed_ns": int(end * 1e9) if done and end else None,
        "duration_ms": (end - start) * 1e3 if done and start and end else None,
        "retired": done, "timeout_ms": 0, "thread_name": str(e.get("thread") or ""), "thread_id": "",
        "frames": [{"name": str(site[2]), "filename": str(site[0]), "line": int(site[1])}] if site else [],
    }


def convert(snapshot: dict, where=None) -> dict:
    """Torch's dump of one rank from our snapshot (``_trace.snapshot``); ``where``: the user's frame the
    rank's stack shows (for a call in progress whose record keeps no call site)."""
    pg_config, pg_status, entries = {}, {}, []
    for pg_id, c in enumerate(c for c in snapshot.get("communicators", []) if c.get("seq") is not None):
        name = str(c["name"])
        size = int(c.get("size") or 1)
        ranks = c.get("world_ranks") or list(range(size))
        pg = (name, "default_pg" if name == "world" else "undefined")
        pg_config[name] = {"name": name, "desc": pg[1], "ranks": "[" + ", ".join(str(int(r)) for r in ranks) + "]"}
        records = c.get("records", [])
        completed = [int(e["seq"]) for e in records if e.get("state") == "completed"]
        pg_status[str(pg_id)] = {"last_enqueued_collective": int(c["seq"]), "last_started_collective": int(c["seq"]),
                                 "last_completed_collective": max(completed) if completed else -1}
        last = records[-1]["seq"] if records else None
        for e in records:
            frame = where if e["seq"] == last and e.get("state") != "completed" else None
            entries.append(entry(e, pg, pg_id, size, frame))
    entries.sort(key=lambda e: (e["record_id"], e["pg_id"]))
    return {"version": VERSION, "comm_lib_version": "collectives", "pg_config": pg_config, "pg_status": pg_status,
            "entries": entries}


_tmp = [0]


def write(target: str, dump: dict) -> None:
    """Pickle ``dump`` to ``target`` whole (a file of its own first, renamed over it)."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    _tmp[0] += 1
    # the file of its own beside the directory, not in it: the analyzer reads every file of the directory
    tmp = f"{os.path.dirname(target)}.{os.path.basename(target)}.{os.getpid()}.{threading.get_ident()}.{_tmp[0]}.tmp"
    try:
        with open(tmp, "wb") as f:
            pickle.dump(dump, f, protocol=2)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

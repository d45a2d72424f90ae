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

The torch backend's calls are numbered as torch numbers them (:func:`note`, called by the backend for
each of its operations): a communicator that is a torch process group of the backend ``collectives`` is
that group in the dump (its name and description as torch set them, ``pg_id`` its name's number), each
torch operation one entry (made of the records of the calls it made: a torch ``all_gather`` of uneven
sizes is two of ours) with torch's ``collective_seq_id``, ``p2p_seq_id`` and ``op_id`` (each counted from
1 on the group, as ``ProcessGroupNCCL`` counts them) and torch's name (``nccl:all_reduce``,
``nccl:_reduce_scatter_base``, ``nccl:send 0->1``, ``nccl:recv 1<-0``); calls made on that communicator
outside torch's operations (its set-up) are left out: they are not torch's. So a job that mixes this
backend with torch's NCCL backend analyses as one. Other point-to-point calls (``collectives.send`` and
``recv``) are entries too (``p2p_seq_id``: their number on the communicator), except a receive from any
rank (torch's format names its peer). Torch's analyzer takes a collective numbered K followed on its group
by a point-to-point call numbered K for one coalesced group (and then stops at an entry that is not a
send or receive): torch's counts, which these are, make that pattern whenever the two counts meet.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import threading
import zlib

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


# the torch backend's operations: communicator name -> {(p2p, our sequence number): torch's numbering of
# the operation that call belongs to, (pg name, pg desc, collective_seq_id, p2p_seq_id, op_id, name)}
OPS: dict = {}
OWN_PG_IDS = 10000  # the pg_id of our communicators that are not torch's groups: from here
KEPT = 4096  # operations kept per communicator (the flight recorder's ring keeps 2000 calls by default)


def note(comm: str, p2p: bool, seqs: range, numbering: tuple) -> None:
    """The calls ``seqs`` of ``comm`` (its p2p calls with ``p2p``) were the torch operation ``numbering``."""
    ops = OPS.setdefault(comm, {})
    for n in seqs:
        ops[(p2p, n)] = numbering
    if len(ops) > 2 * KEPT:
        for key in list(ops)[:len(ops) - KEPT]:
            del ops[key]


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


_PEER = re.compile(r"\b(src|dst)=(\d+)\b")


def _p2p_entry(e: dict, pg: tuple, pg_id: int, size: int, rank: int, numbering=None) -> dict | None:
    """One of our point-to-point records as torch's entry (``numbering``: the torch backend's operation),
    or None for a receive from any rank (torch's name holds the peer)."""
    m = _PEER.search(e.get("path") or "")
    if m is None:
        return None
    peer = int(m[2])
    what = "send" if e.get("collective") == "send" else "recv"
    out = entry(dict(e, collective=what), pg, pg_id, size)
    out["profiling_name"] = f"{BACKEND}:send {rank}->{peer}" if what == "send" else f"{BACKEND}:recv {rank}<-{peer}"
    shape = [int(n) for n in e["shape"]] if e.get("shape") is not None else []
    out["input_sizes"], out["output_sizes"] = ([shape], [shape])
    out["is_p2p"], out["p2p_seq_id"], out["collective_seq_id"] = True, int(e["seq"]), 0
    if numbering is not None:
        out["collective_seq_id"], out["p2p_seq_id"], out["op_id"] = numbering[2], numbering[3], numbering[4]
    return out


def _torch_ops(c: dict, ops: dict, pg_id: int, size: int, where) -> tuple[tuple, list]:
    """A communicator that is a torch process group of the backend: one entry per torch operation."""
    rank = int(c.get("rank") or 0)
    calls = [(False, e) for e in c.get("records", [])] + [(True, e) for e in c.get("p2p", [])]
    grouped: dict = {}
    for p2p, e in calls:
        numbering = ops.get((p2p, int(e["seq"])))
        if numbering is not None:
            grouped.setdefault(numbering, []).append((p2p, e))
    pg = (str(next(iter(grouped))[0]), str(next(iter(grouped))[1])) if grouped else (str(c["name"]), "undefined")
    out = []
    for numbering, members in grouped.items():
        p2p, first = members[-1]  # (the last call of an operation moves its data: an uneven all_gather's
        # first call agrees the sizes)
        done = all(e.get("state") == "completed" for _, e in members)
        merged = dict(first, state="completed" if done else "started",
                      start=min((e["start"] for _, e in members if e.get("start")), default=None),
                      end=max((e["end"] for _, e in members if e.get("end")), default=None))
        if p2p:
            got = _p2p_entry(merged, pg, pg_id, size, rank, numbering)
            if got is None:
                continue
        else:
            last = members[-1][1]
            got = entry(merged, pg, pg_id, size, where if last.get("state") != "completed" else None)
            got["collective_seq_id"], got["p2p_seq_id"], got["op_id"] = numbering[2], numbering[3], numbering[4]
        got["profiling_name"] = f"{BACKEND}:{numbering[5]}" if not p2p else got["profiling_name"]
        out.append(got)
    return pg, out


def convert(snapshot: dict, where=None) -> dict:
    """Torch's dump of one rank from our snapshot (``_trace.snapshot``); ``where``: the user's frame the
    rank's stack shows (for a call in progress whose record keeps no call site)."""
    pg_config, pg_status, entries = {}, {}, []
    for index, c in enumerate(c for c in snapshot.get("communicators", []) if c.get("seq") is not None):
        name = str(c["name"])
        size = int(c.get("size") or 1)
        ranks = c.get("world_ranks") or list(range(size))
        records = c.get("records", [])
        ops = OPS.get(name)
        last = records[-1]["seq"] if records else None
        if ops:  # a torch process group of the backend "collectives": torch's operations, numbered as torch does
            pg_id = index
            pg, mine = _torch_ops(c, ops, pg_id, size, where)
            if pg[0].isdigit():
                pg_id = int(pg[0])
                for e in mine:
                    e["pg_id"] = pg_id
            mine.sort(key=lambda e: e["op_id"])
            done = [e["collective_seq_id"] for e in mine if e["state"] == "completed" and not e["is_p2p"]]
            top = max((e["collective_seq_id"] for e in mine if not e["is_p2p"]), default=0)
        else:
            pg_id = OWN_PG_IDS + zlib.crc32(name.encode()) % OWN_PG_IDS  # (the same on every rank, apart
            # from torch's groups, which are numbered by their names)
            pg = (name, "default_pg" if name == "world" and not any(OPS.get(str(o.get("name")))
                                                                     for o in snapshot["communicators"])
                  else "collectives" if name == "world" else "undefined")
            mine = []
            for e in records:
                frame = where if e["seq"] == last and e.get("state") != "completed" else None
                mine.append(entry(e, pg, pg_id, size, frame))
            for e in c.get("p2p", []):  # after the collectives (their order between them is not kept)
                got = _p2p_entry(e, pg, pg_id, size, int(c.get("rank") or 0))
                if got is not None:
                    got["op_id"] = int(c["seq"]) + int(e["seq"])
                    mine.append(got)
            done = [int(e["seq"]) for e in records if e.get("state") == "completed"]
            top = int(c["seq"])
        pg_config[pg[0]] = {"name": pg[0], "desc": pg[1], "ranks": "[" + ", ".join(str(int(r)) for r in ranks) + "]"}
        pg_status[str(pg_id)] = {"last_enqueued_collective": top, "last_started_collective": top,
                                 "last_completed_collective": max(done) if done else -1}
        entries.extend(mine)
    for n, e in enumerate(entries):  # unique and ordered on the rank, as torch's record ids are
        e["record_id"] = n
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

"""``python -m collectives trace DIR``: read the flight recorder's dumps and say where the ranks diverged.

Reads every ``<job>.trace-rank<R>.json`` in ``DIR`` (the newest job's, or ``--job``), and prints a verdict
first: for each communicator, the first sequence number at which the ranks' records disagree, either
because some ranks never entered that call (their record ends before it) or because they called a
different collective, op, root, dtype or shape there; the ranks on each side with their call sites; for a
rank that never entered it, where its stack shows it was. Without a divergence: "no divergence" and the
last call every rank completed. A call that the NaN check refused (``COLLECTIVES_CHECK_NAN=1``) is named
first, with the ranks whose input held NaN or inf. Missing dumps are named, not fatal; where a communicator's dumps agree but
some of its ranks wrote none, the verdict is "INCOMPLETE" (never "no divergence": the missing rank may be
the one that diverged), with the call the others wait in.

``--stragglers`` ranks each communicator's ranks by how late they arrive at its calls (from the start
times of the records that keep one: not the hot path's), most late first: how many calls each was the last
to arrive at, and its mean, median and largest lateness behind the first rank to arrive.

``--timeline FILE`` writes a Chrome trace (the ``traceEvents`` JSON that chrome://tracing and Perfetto
open): one lane per rank (a process) and communicator (a thread), one event per recorded call with its
start and end (hot-path calls carry no times and are left out). ``--plot FILE.png`` draws the same with
matplotlib.
"""

from __future__ import annotations

import glob
import json
import os
import re

from . import _trace

_NAME = re.compile(r"^(?P<job>.+)\.trace-rank(?P<rank>\d+)\.json$")
_KEY = ("collective", "op", "root", "dtype", "shape")


def load(directory: str, job: str | None = None) -> tuple[str | None, dict[int, dict]]:
    """``(job, {rank: dump})`` of the newest job in ``directory`` (or of ``job``)."""
    found: dict[str, dict[int, str]] = {}
    for path in glob.glob(os.path.join(directory, "*.trace-rank*.json")):
        m = _NAME.match(os.path.basename(path))
        if m:
            found.setdefault(m["job"], {})[int(m["rank"])] = path
    if not found:
        return None, {}
    if job is None:
        job = max(found, key=lambda j: max(os.path.getmtime(p) for p in found[j].values()))
    dumps = {}
    for rank, path in found.get(job, {}).items():
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if data.get("format") == _trace.FORMAT:
            dumps[rank] = data
    return job, dumps


def _key(entry: dict, shape=None) -> tuple:
    """What must agree between the ranks' records of one call; ``shape`` stands in for a shape the record
    does not keep (a hot-path call's)."""
    got = {k: tuple(entry[k]) if isinstance(entry.get(k), list) else entry.get(k) for k in _KEY}
    if got["shape"] is None:
        got["shape"] = shape
    return tuple(got[k] for k in _KEY)


def _groups(entered: dict[int, dict]) -> dict[tuple, list[int]]:
    """The ranks of one sequence number grouped by what they called. A record without a shape (the hot
    path keeps none) agrees with the one shape the others recorded, when they recorded one."""
    shapes = {tuple(e["shape"]) for e in entered.values() if e.get("shape") is not None}
    shape = next(iter(shapes)) if len(shapes) == 1 else None
    groups: dict[tuple, list[int]] = {}
    for r, e in entered.items():
        groups.setdefault(_key(e, shape), []).append(r)
    return groups


def _where(dump: dict) -> str:
    """Where a rank's stack shows it is (see :func:`collectives._trace.user_frame`)."""
    frame, what = _trace.user_frame(dump)
    if frame is None:
        return "no stack outside the library in its dump"
    return f"{frame[0]}:{frame[1]} in {frame[2]}" + (f": {frame[3]}" if frame[3] else "") + what


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


def verdict(dumps: dict[int, dict]) -> list[str]:
    """The verdict's lines (the first says it all)."""
    comms: dict[str, dict[int, dict]] = {}
    for rank, dump in dumps.items():
        for c in dump.get("communicators", []):
            if c.get("name") is None or c.get("seq") is None:
                continue
            comms.setdefault(c["name"], {})[rank] = c
    order = sorted(comms, key=lambda n: (n != "world", n))
    findings = []
    for name in order:
        per_rank = comms[name]
        records = {r: {e["seq"]: e for e in c.get("records", [])} for r, c in per_rank.items()}
        for r, rec in records.items():  # a hot-path call keeps no site: the one in progress is in the stack
            last = rec.get(per_rank[r]["seq"])
            if last is not None and last.get("site") is None and last.get("state") != "completed":
                frame, _ = _trace.user_frame(dumps[r])
                if frame is not None:
                    last["site"] = frame[:3]
        seqs = {r: c["seq"] for r, c in per_rank.items()}
        first = max((min(rec) if rec else seqs[r] + 1) for r, rec in records.items())  # all ranks still hold it
        top = max(seqs.values())
        for s in range(first, top + 1):
            entered = {r: rec[s] for r, rec in records.items() if s in rec}
            never = [r for r in per_rank if seqs[r] < s]
            groups = _groups(entered)
            waiting = any(e.get("state") != "completed" for e in entered.values())
            # ranks behind whose peers completed the call were only dumped earlier (a SIGUSR1 of a healthy
            # job): a divergence is a different call, or ranks absent from a call others wait in
            if len(groups) > 1 or (never and entered and waiting):
                findings.append((s, name, entered, never, groups))
                break
    if not findings:
        lines = []
        for name in order:
            per_rank = comms[name]
            done = []
            for c in per_rank.values():
                completed = [e["seq"] for e in c.get("records", []) if e.get("state") == "completed"]
                done.append(max(completed) if completed else 0)
            absent = _absent(per_rank)
            if absent:  # what the missing ranks did is unknown: no verdict either way
                lines.append(_incomplete(name, per_rank, absent))
                continue
            lines.append(f"no divergence on {name}: every rank's record agrees; the last call every rank completed "
                         f"is #{min(done)} (of up to #{max(c['seq'] for c in per_rank.values())})")
        lines.sort(key=lambda line: not line.startswith("INCOMPLETE"))  # the first line says it all
        return _refused(comms, order) + lines or ["no records in the dumps (COLLECTIVES_TRACE_BUFFER=0?)"]
    s, name, entered, never, groups = findings[0]
    sides = []
    for ranks in sorted(groups.values()):
        e = entered[ranks[0]]
        sites = sorted({_trace.site_text(entered[r].get("site")) for r in ranks})
        sides.append(f"{_ranks(ranks)} called {_trace.describe(e)} at {'; '.join(sites)}")
    line = f"DIVERGENCE on {name} at call #{s}: " + "; ".join(sides)
    if never:
        where = "; ".join(f"rank {r} was at {_where(dumps[r])}" for r in sorted(never) if r in dumps)
        line += f"; {_ranks(never)} never entered it ({where})"
    lines = [line]
    for r in sorted(never):
        c = comms[name][r]
        recs = c.get("records", [])
        if recs:
            lines.append(f"  rank {r}'s last call on {name}: {_trace.describe(recs[-1])} ({recs[-1].get('state')})")
    return lines


def _refused(comms: dict[str, dict[int, dict]], order: list[str]) -> list[str]:
    """The calls the NaN check refused (``COLLECTIVES_CHECK_NAN``: every rank's record of the call failed
    with the same NonFiniteError), the last one of each communicator: which call, where, and the ranks
    whose input held NaN or inf (the error names them)."""
    lines = []
    for name in order:
        refused: dict[int, dict] = {}
        for c in comms[name].values():
            for e in c.get("records", []):
                if (e.get("error") or "").startswith("NonFiniteError"):
                    refused[e["seq"]] = e
        if refused:
            e = refused[max(refused)]
            found = e["error"].split(" the input holds a non-finite value on ", 1)[-1].split(" (COLLECTIVES_CHECK_NAN", 1)[0]
            lines.append(f"NON-FINITE INPUT on {name} at call #{e['seq']}: {_trace.describe(e)} at "
                         f"{_trace.site_text(e.get('site'))} was refused on every rank: {found}")
    return lines


def _absent(per_rank: dict[int, dict]) -> list[str]:
    """The ranks of a communicator that have no dump here (``per_rank``: job rank -> its part of a dump),
    as the job numbers them where the dumps say (``world_ranks``), else as the communicator does."""
    members: set[int] = set()
    for c in per_rank.values():
        members.update(c.get("world_ranks") or ())
    if members:
        return [str(r) for r in sorted(members - set(per_rank))]
    size = max(c.get("size") or 1 for c in per_rank.values())
    present = {c.get("rank") for c in per_rank.values()}
    return [f"{r} (of the communicator)" for r in range(size) if r not in present]


def _incomplete(name: str, per_rank: dict[int, dict], absent: list[str]) -> str:
    """The line for a communicator whose dumps agree but do not cover all its ranks: never "no divergence"
    (a rank without a dump may be the one that diverged), and what the ranks with a dump wait in."""
    line = (f"INCOMPLETE on {name}: no divergence among the dumps of {_ranks(per_rank)}, but rank"
            f"{'s' if len(absent) > 1 else ''} {', '.join(absent)} wrote no dump (dead, not signalled, or its "
            f"dump not copied here), so where it diverged cannot be known")
    waiting = {}
    for r, c in per_rank.items():
        last = (c.get("records") or [None])[-1]
        if last is not None and last.get("state") != "completed":
            waiting[r] = last
    if waiting:
        calls = sorted({_trace.describe(e) for e in waiting.values()})
        line += f"; {_ranks(waiting)} wait{'' if len(waiting) > 1 else 's'} in {' / '.join(calls)}"
    return line


def stragglers(dumps: dict[int, dict]) -> list[str]:
    """The ranks of each communicator ranked by how late they arrive at its calls: for every call that every
    rank's record holds with a start time (the general path's records: asynchronous calls, the torch
    backend, gradient buckets, trees, barriers, the first call of a kind; a hot-path call keeps no time),
    each rank's lateness is its start minus the earliest start of that call. The clocks are the hosts'
    (``time.time()``): across nodes their offset adds to every lateness."""
    comms: dict[str, dict[int, dict[int, float]]] = {}
    seqs: dict[str, int] = {}
    for rank, dump in dumps.items():
        for c in dump.get("communicators", []):
            if c.get("name") is None or c.get("seq") is None:
                continue
            comms.setdefault(c["name"], {})[rank] = {e["seq"]: e["start"] for e in c.get("records", [])
                                                    if e.get("start")}
            seqs[c["name"]] = max(seqs.get(c["name"], 0), c["seq"])
    lines = []
    for name in sorted(comms, key=lambda n: (n != "world", n)):
        per = comms[name]
        ranks = sorted(per)
        if len(ranks) < 2:
            continue
        common = sorted(set.intersection(*(set(v) for v in per.values())))
        if not common:
            lines.append(f"stragglers on {name}: no call has a start time on every rank (hot-path calls keep none)")
            continue
        late: dict[int, list[float]] = {r: [] for r in ranks}
        last = dict.fromkeys(ranks, 0)
        for s in common:
            starts = {r: per[r][s] for r in ranks}
            first = min(starts.values())
            for r in ranks:
                late[r].append(starts[r] - first)
            last[max(ranks, key=lambda r: starts[r])] += 1
        order = sorted(ranks, key=lambda r: -sum(late[r]))
        lines.append(f"stragglers on {name}: {len(common)} calls with a start time on every rank (of "
                     f"{seqs[name]}; hot-path calls keep none), ranks from the latest:")
        for r in order:
            values = sorted(late[r])
            mean = sum(values) / len(values)
            lines.append(f"  rank {r}: last to arrive at {last[r]} of {len(common)} calls; late by {mean * 1e3:.1f} ms "
                         f"on average (median {values[len(values) // 2] * 1e3:.1f} ms, max {values[-1] * 1e3:.1f} ms)")
    hosts = {d.get("host") for d in dumps.values()}
    if len(hosts) > 1:
        lines.append(f"(the ranks ran on {len(hosts)} hosts: the offsets of their clocks add to these figures)")
    return lines or ["stragglers: no communicator with records of two ranks or more"]


def timeline(dumps: dict[int, dict]) -> dict:
    """The Chrome trace (``traceEvents``) of the dumps' records."""
    events = []
    starts = [e["start"] for d in dumps.values() for c in d.get("communicators", [])
              for e in c.get("records", []) if e.get("start")]
    t0 = min(starts) if starts else 0.0
    for rank, d in sorted(dumps.items()):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for c in d.get("communicators", []):
            # the collectives' records, then the point-to-point ones (a row of their own per communicator)
            for e, tid in [(e, c["name"]) for e in c.get("records", [])] + \
                    [(e, f"{c['name']} p2p") for e in c.get("p2p", [])]:
                if not e.get("start"):
                    continue
                end = e.get("end") or d.get("time") or e["start"]
                events.append({"name": e["collective"], "cat": e.get("path") or "", "ph": "X", "pid": rank,
                               "tid": tid, "ts": (e["start"] - t0) * 1e6,
                               "dur": max(0.0, (end - e["start"]) * 1e6),
                               "args": {k: e.get(k) for k in ("seq", "op", "root", "dtype", "shape", "state",
                                                              "site", "error")}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot(trace: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib (pip install matplotlib, which the bench extra brings): {exc}") from None
    lanes = sorted({(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"})
    fig, ax = plt.subplots(figsize=(10, 1 + 0.4 * len(lanes)))
    for i, lane in enumerate(lanes):
        bars = [(e["ts"] / 1e3, max(e["dur"] / 1e3, 0.01)) for e in trace["traceEvents"]
                if e["ph"] == "X" and (e["pid"], e["tid"]) == lane]
        ax.broken_barh(bars, (i - 0.4, 0.8))
    ax.set_yticks(range(len(lanes)), [f"rank {p} {t}" for p, t in lanes])
    ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m collectives trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="the trace directory (COLLECTIVES_TRACE_DIR; default ./collectives-trace), or the "
                                "COLLECTIVES_TIMELINE prefix of a job's timelines (with --timeline: merge them)")
    ap.add_argument("--job", help="the job id (default: the newest job in DIR)")
    ap.add_argument("--timeline", metavar="FILE", help="write a Chrome trace (JSON) of the records")
    ap.add_argument("--plot", metavar="FILE.png", help="draw the timeline (needs matplotlib)")
    ap.add_argument("--stragglers", action="store_true",
                    help="rank the ranks by how late they arrive at each call (from the records' start times)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.dir):  # COLLECTIVES_TIMELINE's prefix: merge the ranks' timelines
        return _merge_timelines(args)
    job, dumps = load(args.dir, args.job)
    if not dumps:
        torch_dirs = sorted(glob.glob(os.path.join(args.dir, "*.torch")))
        print(f"no trace dumps in {args.dir}" + (f" for job {args.job}" if args.job else "")
              + (f" (dumps in torch's format, COLLECTIVES_TRACE_FORMAT=torch, are in {torch_dirs[-1]}: read them "
                 f"with `python -m torch.distributed.flight_recorder.fr_trace DIR`)" if torch_dirs else ""))
        return 1
    size = max(d.get("size", 1) for d in dumps.values())
    missing = [r for r in range(size) if r not in dumps]
    lines = verdict(dumps)
    print(lines[0])
    for line in lines[1:]:
        print(line)
    print(f"\njob {job}: dumps of {len(dumps)} of {size} ranks in {args.dir}"
          + (f"; missing: {_ranks(missing)} (dead before it could write, or not asked)" if missing else ""))
    for r, d in sorted(dumps.items()):
        reason = d.get("reason") or ""
        reason = reason if len(reason) <= 110 else reason[:110].rsplit(" ", 1)[0] + " ..."
        print(f"  rank {r} ({d.get('host')}, pid {d.get('pid')}): dumped for: {reason}\n    at {_where(d)}")
    if args.stragglers:
        print()
        for line in stragglers(dumps):
            print(line)
    if args.timeline or args.plot:
        trace = timeline(dumps)
        if args.timeline:
            with open(args.timeline, "w") as f:
                json.dump(trace, f)
            print(f"\ntimeline: {args.timeline} ({sum(e['ph'] == 'X' for e in trace['traceEvents'])} events; open "
                  f"it in chrome://tracing or https://ui.perfetto.dev)")
        if args.plot:
            plot(trace, args.plot)
            print(f"plot: {args.plot}")
    return 0


def _merge_timelines(args) -> int:
    """``trace PREFIX --timeline OUT``: the ranks' timelines (``COLLECTIVES_TIMELINE=PREFIX``) as one Chrome
    trace, each collective call with its arrival skew (``late_us``)."""
    from . import _timeline

    timelines = _timeline.load(args.dir)
    if not timelines:
        print(f"no trace directory and no timelines at {args.dir} (expected {args.dir}.<rank> or "
              f"{args.dir}.<rank>.raw, written with COLLECTIVES_TIMELINE={args.dir})")
        return 1
    size = max(timelines) + 1
    missing = [r for r in range(size) if r not in timelines]
    calls = {r: len(t["calls"]) for r, t in sorted(timelines.items())}
    print(f"timelines of {len(timelines)} ranks at {args.dir}: "
          + ", ".join(f"rank {r}: {n} calls" for r, n in calls.items())
          + (f"; missing: {_ranks(missing)}" if missing else ""))
    if not args.timeline and not args.plot:
        print("(--timeline FILE writes them merged as one Chrome trace)")
        return 0
    trace = _timeline.merge(timelines)
    if args.timeline:
        with open(args.timeline, "w") as f:
            json.dump(trace, f)
        print(f"timeline: {args.timeline} ({sum(e.get('cat') == 'call' for e in trace['traceEvents'])} calls; open it "
              f"in chrome://tracing or https://ui.perfetto.dev)")
    if args.plot:
        plot({"traceEvents": [e for e in trace["traceEvents"] if e.get("cat") != "phase"]}, args.plot)
        print(f"plot: {args.plot}")
    return 0

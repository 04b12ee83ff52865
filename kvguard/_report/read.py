"""Read report files back for `kvguard report`: runs, their processes, rows by site or event. Stdlib only.

A run is every record with one run id; a process is one (host, pid) in it. Counts come
from each process's summary record, exact however many events were cut; a process
without one (killed, or still running) is counted from its event records and marks
the run incomplete. Lines that are not kvguard records are skipped and counted per
file, the first one named: a text file that is not a report is not a clean report.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator, Literal, NotRequired, Optional, TypedDict, Union, cast

from kvguard._paths import collapse
from kvguard._report.files import FILE_PREFIX, SCHEMA
from kvguard._kinds import DATA
from kvguard._report.tally import short_site, unprotected_text
from kvguard._text import plural



# The records as `_parse` reads them: the fields it checks have their types; the others
# are as written (kvguard's own values), or anything in a file written by hand (object).
class _Common(TypedDict):
    schema: int
    run: str
    host: str
    pid: int
    rank: NotRequired[Any]  # an int, or None (rank unknown); read where it is an int
    time: NotRequired[object]


class Header(_Common):
    record: Literal["header"]


class Event(_Common):
    record: Literal["event"]
    path: str
    op: str
    filename: str
    lineno: int
    call: NotRequired[object]
    kind: NotRequired[object]
    code: NotRequired[object]
    blocked: NotRequired[object]


class Summary(_Common):
    record: Literal["summary"]
    calls: int
    writes: int
    sites: list[object]
    allowed: NotRequired[object]
    protected: NotRequired[object]
    unprotected: NotRequired[object]
    unguarded_calls: NotRequired[object]
    events_cut: NotRequired[object]
    problems: NotRequired[object]
    targets: NotRequired[object]


Record = Union[Header, Event, Summary]
_FIELDS: dict[str, dict[str, type]] = {  # what each record must hold to be read at all
    "header": {},
    "event": {"path": str, "op": str, "filename": str, "lineno": int},
    "summary": {"calls": int, "writes": int, "sites": list},
}
_COMMON: dict[str, type] = {"run": str, "host": str, "pid": int}


@dataclasses.dataclass
class Skipped:
    """Malformed lines of one file: how many, and the first."""

    file: str
    count: int
    first: str  # `line 3: not JSON`


@dataclasses.dataclass
class Process:
    """The records of one process of a run."""

    header: Optional[Header] = None
    summary: Optional[Summary] = None
    events: list[Event] = dataclasses.field(default_factory=list)

    @property
    def rank(self) -> Optional[int]:
        for record in (self.summary, self.header, *self.events[:1]):
            if record is not None and isinstance(record.get("rank"), int):
                return int(record["rank"])
        return None

    @property
    def started(self) -> float:
        times = [r.get("time") for r in (self.header, *self.events[:1], self.summary) if r is not None]
        return min((t for t in times if isinstance(t, (int, float))), default=0.0)


@dataclasses.dataclass
class Run:
    id: str
    processes: dict[tuple[str, int], Process] = dataclasses.field(default_factory=dict)

    @property
    def started(self) -> float:
        return min(p.started for p in self.processes.values())


def load(path: str) -> tuple[list[Run], list[Skipped]]:
    """The runs in a report file or directory, oldest first, and the lines skipped."""
    runs: dict[str, Run] = {}
    skipped: list[Skipped] = []
    for file in _files(path):
        bad: list[str] = []
        with open(file, encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                record, problem = _parse(line)
                if record is None:
                    bad.append(f"line {n}: {problem}")
                    continue
                run = runs.setdefault(record["run"], Run(record["run"]))
                process = run.processes.setdefault((record["host"], record["pid"]), Process())
                if record["record"] == "event":
                    process.events.append(record)
                else:
                    setattr(process, record["record"], record)
        if bad:
            skipped.append(Skipped(file, len(bad), bad[0]))
    return sorted(runs.values(), key=lambda r: r.started), skipped


def select(runs: list[Run], run_id: Optional[str], rank: Optional[int]) -> list[Run]:
    """The runs named by `--run`, each with only the processes of `--rank`."""
    chosen = [r for r in runs if run_id is None or r.id == run_id]
    if rank is None:
        return chosen
    kept = [Run(r.id, {k: p for k, p in r.processes.items() if p.rank == rank}) for r in chosen]
    return [r for r in kept if r.processes]


def describe(run: Run, by: str = "site") -> dict[str, Any]:
    """A run as plain data: totals, its status, notes, and one row per site (or per event).

    A run is clean only when every process proves it: a summary record whose counts agree
    with its sites and its event records, guarded calls, protected tensors. A summary
    that counts writes is never clean, whatever else its records hold or lack.
    """
    processes = list(run.processes.values())
    summaries = [p.summary for p in processes if p.summary is not None]
    incomplete = [p for p in processes if p.summary is None]
    sites = _site_rows(processes)
    counted = sum(_written(p) for p in processes)
    writes = max(counted, sum(row["writes"] for row in sites))
    calls = sum(p.summary["calls"] if p.summary is not None else len({e.get("call") for e in p.events})
                for p in processes)
    allowed: dict[str, int] = {}
    for summary in summaries:
        reasons = summary.get("allowed")
        for reason, count in (reasons.items() if isinstance(reasons, dict) else ()):
            allowed[str(reason)] = allowed.get(str(reason), 0) + _count(count)
    disagreements = [line for p in processes if p.summary is not None for line in _disagreements(p)]
    protected = sum(_count(s.get("protected")) for s in summaries)
    loaded_elsewhere = _data_protected(summaries)
    unprotected = [p for p in processes if p.summary is not None and _protected_nothing(p.summary)
                   and not (loaded_elsewhere and _data_only(p.summary))]
    unlooked = [p for p in processes if p.summary is not None and _count(p.summary.get("unprotected"))]
    status = ("events" if writes or disagreements else
              "unproven" if incomplete or not calls or unprotected or unlooked else "clean")
    notes = [f"{_process_name(p)} wrote no summary record (killed, or still running): its counts are those of its "
             "event records" for p in incomplete]
    notes += disagreements
    notes += [f"{_process_name(p)} made {plural(p.summary['calls'], 'guarded call')} that protected no tensor: "
              "nothing was checked" for p in unprotected if p.summary is not None]
    notes += [f"{_process_name(p)}: {unprotected_text(_count(p.summary.get('unprotected')))}"
              for p in unlooked if p.summary is not None]
    cut = sum(_count(s.get("events_cut")) for s in summaries)
    if cut:
        notes.append(f"{plural(cut, 'event')} past KVGUARD_MAX_EVENTS are counted above but not in the files")
    if not calls:
        notes.append("no guarded call: nothing was checked")
    notes += sorted({str(problem) for s in summaries for problem in _listed(s.get("problems"))})
    return {
        "run": run.id, "status": status, "ranks": sorted({p.rank for p in processes if p.rank is not None}),
        "processes": len(processes), "calls": calls,
        "unguarded_calls": sum(_count(s.get("unguarded_calls")) for s in summaries),
        "protected": protected, "writes": writes, "sites": len(sites), "targets": _target_rows(summaries),
        "allowed": allowed, "events_in_files": sum(len(p.events) for p in processes), "events_cut": cut,
        "notes": notes, "by": by, "rows": sites if by == "site" else _event_rows(processes),
    }


def _listed(value: object) -> list[object]:
    return value if isinstance(value, list) else [value] if isinstance(value, str) and value else []


def _count(value: object) -> int:
    """A count from a record: a whole number >= 0, else 0 (a field missing, or written by hand)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _written(process: Process) -> int:
    """The writes a process counted: its summary's, else its event records'."""
    return _count(process.summary["writes"]) if process.summary is not None else len(process.events)


def _site_writes(summary: Summary) -> int:
    return sum(_count(site.get("writes")) for site in summary["sites"] if isinstance(site, dict))


def _disagreements(process: Process) -> list[str]:
    """Each way a process's summary contradicts itself or its event records (never clean)."""
    summary, name = process.summary, _process_name(process)
    assert summary is not None
    counted, at_sites, events = _count(summary["writes"]), _site_writes(summary), len(process.events)
    lines = []
    if counted > at_sites:
        lines.append(f"{name}'s summary counts {plural(counted, 'write')}, but its sites record "
                     f"{at_sites:,}: the writes were counted but their sites were not recorded")
    elif at_sites > counted:
        lines.append(f"{name}'s summary lists sites with {plural(at_sites, 'write')}, but counts {counted:,}")
    if events > max(counted, at_sites):
        lines.append(f"{name} has {plural(events, 'event record')} in the files, but its summary counts "
                     f"{plural(max(counted, at_sites), 'write')}")
    return lines


def _protected_nothing(summary: Summary) -> bool:
    """A summary of guarded calls that protected no tensor (a clean run must have watched something)."""
    return _count(summary["calls"]) > 0 and "protected" in summary and _count(summary.get("protected")) == 0 \
        and not _count(summary["writes"])


def _data_stats(summary: Summary) -> dict[str, object]:
    targets = summary.get("targets")
    stats = targets.get(DATA.word) if isinstance(targets, dict) else None
    return stats if isinstance(stats, dict) else {}


def _data_protected(summaries: list[Summary]) -> bool:
    """Whether some process of the run protected what datasets returned (a DataLoader worker)."""
    return any(_count(_data_stats(s).get("protected")) for s in summaries)


def _data_only(summary: Summary) -> bool:
    """Whether a process's guarded calls were all its `data` guard's: with DataLoader workers,
    the main process's guard sees no dataset return anything (the workers load), and that is
    no gap where its workers protected what they loaded."""
    targets = summary.get("targets")
    called = [label for label, stats in (targets.items() if isinstance(targets, dict) else ())
              if isinstance(stats, dict) and _count(stats.get("calls"))]
    return called == [DATA.word]


def _target_rows(summaries: list[Summary]) -> list[dict[str, Any]]:
    """Per target (or guard name), across processes: guarded calls and tensors protected."""
    rows: dict[str, dict[str, Any]] = {}
    for summary in summaries:
        targets = summary.get("targets")
        for label, stats in (targets.items() if isinstance(targets, dict) else ()):
            if not isinstance(stats, dict):
                continue
            row = rows.setdefault(str(label), {"target": str(label), "calls": 0, "protected": 0, "writes": 0,
                                               "moments": 0, "unprotected": 0, "unsampled_calls": 0,
                                               "intervals_checked": 0, "intervals_seen": 0, "sample_every": 0})
            row["sample_every"] = max(row["sample_every"], _count(stats.get("sample_every")))
            for name in ("calls", "protected", "writes", "moments", "unprotected", "unsampled_calls",
                         "intervals_checked", "intervals_seen"):
                if row[name] is not None:
                    row[name] += _count(stats.get(name))
            # written before 0.3: a kind's moments as `graphs` (autograd) or `steps` (weights)
            row["moments"] += _count(stats.get("graphs")) + _count(stats.get("steps"))
            if "writes" not in stats:  # written by kvguard 0.2: per-target writes unknown
                row["writes"] = None
    return list(rows.values())


def _site_rows(processes: list[Process]) -> list[dict[str, Any]]:
    """One row per site across processes: counts summed, ranks listed, the earliest first example."""
    rows: dict[tuple[object, ...], dict[str, Any]] = {}
    for process in processes:
        sites = process.summary["sites"] if process.summary is not None else _sites_of(process.events)
        for site in sites:
            if not isinstance(site, dict):
                continue
            key = (site.get("filename"), site.get("lineno"), site.get("op"))
            given = site.get("first")
            first = {**(given if isinstance(given, dict) else {}), "rank": process.rank}
            row = rows.get(key)
            if row is None:
                row = rows[key] = {
                    "site": short_site(str(key[0]), key[1]), "filename": key[0], "lineno": key[1], "op": key[2],
                    "kind": site.get("kind"), "code": site.get("code"), "paths": {}, "writes": 0, "blocked": 0,
                    "calls": 0, "ranks": set(), "first": first}
            for name in ("writes", "blocked", "calls"):
                row[name] += _count(site.get(name))
            paths = site.get("paths")
            for path, count in (paths.items() if isinstance(paths, dict) else ()):
                row["paths"][path] = row["paths"].get(path, 0) + _count(count)
            if process.rank is not None:
                row["ranks"].add(process.rank)
            if _order(first) < _order(row["first"]):
                row["first"] = first
    for row in rows.values():
        row["paths"] = sorted(row["paths"], key=lambda p: -row["paths"][p])
        row["ranks"] = sorted(row["ranks"])
    return sorted(rows.values(), key=lambda r: (-r["writes"], str(r["site"])))


def _order(first: dict[str, object]) -> tuple[int, int]:
    """Lowest rank, then earliest call; unknowns last."""
    rank, call = first.get("rank"), first.get("call")
    return (rank if isinstance(rank, int) else 1 << 30, call if isinstance(call, int) else 1 << 30)


def _sites_of(events: list[Event]) -> list[object]:
    """Site entries, as a summary record holds them, from a process's event records."""
    sites: dict[tuple[str, int, str], dict[str, Any]] = {}
    calls: dict[tuple[str, int, str], set[object]] = {}
    for ev in events:
        key = (ev["filename"], ev["lineno"], ev["op"])
        site = sites.get(key)
        if site is None:
            site = sites[key] = {"filename": ev["filename"], "lineno": ev["lineno"], "op": ev["op"],
                                 "kind": ev.get("kind"), "code": ev.get("code"), "paths": {}, "writes": 0,
                                 "blocked": 0, "first": {k: ev.get(k) for k in (
                                     "path", "call", "placed_at", "tensor", "before", "after", "diff")}}
        site["writes"] += 1
        site["blocked"] += bool(ev.get("blocked"))
        path = collapse(ev["path"])
        site["paths"][path] = site["paths"].get(path, 0) + 1
        calls.setdefault(key, set()).add(ev.get("call"))
    for key, site in sites.items():
        site["calls"] = len(calls[key])
    return list(sites.values())


def _event_rows(processes: list[Process]) -> list[dict[str, Any]]:
    """The event records in the files grouped by (path, op, site), with a count per rank."""
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for process in processes:
        for ev in process.events:
            key = (ev["path"], ev["op"], short_site(ev["filename"], ev["lineno"]))
            row = rows.setdefault(key, {"path": key[0], "op": key[1], "site": key[2], "code": ev.get("code"),
                                        "counts": {}})
            rank = str(process.rank)
            row["counts"][rank] = row["counts"].get(rank, 0) + 1
    return sorted(rows.values(), key=lambda r: -sum(r["counts"].values()))


def _process_name(process: Process) -> str:
    record: Union[Record, dict[str, object]] = (process.summary or process.header
                                                 or (process.events[0] if process.events else {}))
    rank = f"rank {process.rank}" if process.rank is not None else "a process"
    return f"{rank} (pid {record.get('pid')} on {record.get('host')})"


def _parse(line: str) -> tuple[Optional[Record], str]:
    """The record on one line, or None and why it is not one."""
    try:
        record = json.loads(line)
    except ValueError:
        return None, f"not JSON: {line.strip()[:60]!r}"
    if not isinstance(record, dict):
        return None, "not a JSON object"
    schema = record.get("schema")
    if not isinstance(schema, int):
        return None, "no schema field (not a kvguard record, or one from kvguard 0.1)"
    if schema > SCHEMA:
        return None, f"schema {schema} is newer than this kvguard reads ({SCHEMA}): upgrade kvguard"
    kind = record.get("record")
    if kind not in _FIELDS:
        return None, f"unknown record type {kind!r}"
    for name, kind_of in {**_COMMON, **_FIELDS[kind]}.items():
        if not isinstance(record.get(name), kind_of):
            return None, f"{kind} record without a valid {name!r}"
    return cast(Record, record), ""  # what it must hold checked above


def _files(path: str) -> Iterator[str]:
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.startswith(FILE_PREFIX) and n.endswith(".jsonl"))
        for name in names:
            yield os.path.join(path, name)
    elif os.path.isfile(path):
        yield path
    else:
        raise FileNotFoundError(f"no kvguard report file or directory at {path!r}")

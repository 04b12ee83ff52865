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
from typing import Any, Iterator, Optional

from kvguard._reportfile import FILE_PREFIX, SCHEMA
from kvguard._tally import pattern, plural, short_site

Record = dict[str, Any]
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

    header: Optional[Record] = None
    summary: Optional[Record] = None
    events: list[Record] = dataclasses.field(default_factory=list)

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
    """A run as plain data: totals, its status, notes, and one row per site (or per event)."""
    processes = list(run.processes.values())
    summaries = [p.summary for p in processes if p.summary is not None]
    incomplete = [p for p in processes if p.summary is None]
    sites = _site_rows(processes)
    writes = sum(row["writes"] for row in sites)
    calls = sum(p.summary["calls"] if p.summary is not None else len({e.get("call") for e in p.events})
                for p in processes)
    allowed: dict[str, int] = {}
    for summary in summaries:
        for reason, count in (summary.get("allowed") or {}).items():
            allowed[reason] = allowed.get(reason, 0) + count
    status = "events" if writes else "unproven" if incomplete or not calls else "clean"
    notes = [f"{_process_name(p)} wrote no summary record (killed, or still running): its counts are those of its "
             "event records" for p in incomplete]
    cut = sum(s.get("events_cut", 0) for s in summaries)
    if cut:
        notes.append(f"{plural(cut, 'event')} past KVGUARD_MAX_EVENTS are counted above but not in the files")
    if not calls:
        notes.append("no guarded call: nothing was checked")
    notes += sorted({problem for s in summaries for problem in s.get("problems") or ()})
    return {
        "run": run.id, "status": status, "ranks": sorted({p.rank for p in processes if p.rank is not None}),
        "processes": len(processes), "calls": calls,
        "unguarded_calls": sum(s.get("unguarded_calls", 0) for s in summaries),
        "protected": sum(s.get("protected", 0) for s in summaries), "writes": writes, "sites": len(sites),
        "allowed": allowed, "events_in_files": sum(len(p.events) for p in processes), "events_cut": cut,
        "notes": notes, "by": by, "rows": sites if by == "site" else _event_rows(processes),
    }


def _site_rows(processes: list[Process]) -> list[dict[str, Any]]:
    """One row per site across processes: counts summed, ranks listed, the earliest first example."""
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for process in processes:
        sites = process.summary["sites"] if process.summary is not None else _sites_of(process.events)
        for site in sites:
            if not isinstance(site, dict):
                continue
            key = (site.get("filename"), site.get("lineno"), site.get("op"))
            first = {**(site.get("first") or {}), "rank": process.rank}
            row = rows.get(key)
            if row is None:
                row = rows[key] = {
                    "site": short_site(str(key[0]), key[1]), "filename": key[0], "lineno": key[1], "op": key[2],
                    "kind": site.get("kind"), "code": site.get("code"), "paths": {}, "writes": 0, "blocked": 0,
                    "calls": 0, "ranks": set(), "first": first}
            for name in ("writes", "blocked", "calls"):
                row[name] += int(site.get(name) or 0)
            for path, count in (site.get("paths") or {}).items():
                row["paths"][path] = row["paths"].get(path, 0) + count
            if process.rank is not None:
                row["ranks"].add(process.rank)
            if _order(first) < _order(row["first"]):
                row["first"] = first
    for row in rows.values():
        row["paths"] = sorted(row["paths"], key=lambda p: -row["paths"][p])
        row["ranks"] = sorted(row["ranks"])
    return sorted(rows.values(), key=lambda r: (-r["writes"], str(r["site"])))


def _order(first: dict[str, Any]) -> tuple[int, int]:
    """Lowest rank, then earliest call; unknowns last."""
    rank, call = first.get("rank"), first.get("call")
    return (rank if isinstance(rank, int) else 1 << 30, call if isinstance(call, int) else 1 << 30)


def _sites_of(events: list[Record]) -> list[dict[str, Any]]:
    """Site entries, as a summary record holds them, from a process's event records."""
    sites: dict[tuple[Any, ...], dict[str, Any]] = {}
    calls: dict[tuple[Any, ...], set[Any]] = {}
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
        path = pattern(ev["path"])
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
    record = process.summary or process.header or (process.events[0] if process.events else {})
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
    return record, ""


def _files(path: str) -> Iterator[str]:
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.startswith(FILE_PREFIX) and n.endswith(".jsonl"))
        for name in names:
            yield os.path.join(path, name)
    elif os.path.isfile(path):
        yield path
    else:
        raise FileNotFoundError(f"no kvguard report file or directory at {path!r}")

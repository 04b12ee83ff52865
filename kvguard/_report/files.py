"""Report files: write this process's records, one JSON object a line. Stdlib only.

A process appends to `kvguard-rank<R>.jsonl` in the report directory: a header record
when it starts guarding, one event record per write up to `KVGUARD_MAX_EVENTS`, and a
summary record at exit whose counts are exact however many events were cut. A clean run
therefore leaves a file that proves it ran. Every record carries `schema` and the run
id, so runs appended to one directory stay apart. Each record is one `os.write` with
`O_APPEND`, so processes sharing a file never interleave. Only summaries go in: never
pickles, never whole tensors. The README lists every field.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import platform
import socket
import sys
import time
from typing import TYPE_CHECKING, Optional

from kvguard import _config, _ranks
from kvguard._config import DEFAULT_MAX_EVENTS
from kvguard._errors import ConfigError
from kvguard._report.diagnostics import diagnostics
from kvguard._report.process import PROCESS, GuardView
from kvguard._report.tally import Tally, TargetStats
from kvguard._state import STATE
from kvguard._text import say

if TYPE_CHECKING:
    from kvguard._report.events import MutationEvent

SCHEMA = 1  # raised when a field changes meaning or goes away; new fields keep it
FILE_PREFIX = "kvguard-rank"
_finish_registered = False


class ReportWriter:
    """This process's records in one report directory, and the counts of the guards writing there."""

    def __init__(self, directory: str, limit: int) -> None:
        self.directory = directory
        self.limit = limit  # event records written at most
        self.tally = Tally()
        self.written = 0
        self.cut = 0  # event records past the limit: counted, not written
        self._file: Optional[str] = None  # chosen by the header, kept for the process
        self._finished: Optional[int] = None  # the process that wrote its summary

    def __str__(self) -> str:
        return f"writing report files to {self.directory!r}"

    @property
    def started(self) -> bool:
        return self._file is not None

    def begin(self) -> bool:
        """Write the header record, once: who, which run, which settings and versions.

        Returns whether the writer works; one that failed is dropped with one line.
        """
        if self._file is not None:
            return self in PROCESS.listeners
        info = _ranks.rank_info()
        self._file = os.path.join(self.directory, f"{FILE_PREFIX}{info.get('rank') or 0}.jsonl")
        settings = STATE.settings
        try:
            self._append({**_who("header", info), "kvguard": _version("kvguard"), "torch": _version("torch"),
                          "python": platform.python_version(), "max_events": self.limit,
                          "settings": settings.as_record() if settings is not None and settings.active else None})
        except OSError as exc:
            PROCESS.drop(self, exc)
            return False
        return True

    def __call__(self, event: MutationEvent, guard: GuardView) -> None:
        """An event record for a guard writing here, while under the limit."""
        if guard.report_dir != self.directory:
            return
        if self.written >= self.limit:
            self.cut += 1
            return
        self._append({**_who("event"), "call": guard.call, "target": guard.target, "guard": guard.name,
                      "action": guard.action, **dataclasses.asdict(event)})
        self.written += 1

    def finish(self, problems: list[str]) -> None:
        """Write the summary record, once per process: exact counts, what was cut, what was left
        unguarded."""
        if self._finished == os.getpid():
            return
        self._finished = os.getpid()
        self._append({**_who("summary", _ranks.rank_info()), **self.tally.as_record(),
                      "events_written": self.written, "events_cut": self.cut, "problems": problems})

    def start_over(self) -> None:
        """This process is a fork's child: its records are its own (a header at its first guarded
        call, its events, its summary), counted from zero."""
        self.tally.clear()
        self.written = self.cut = 0
        self._file = self._finished = None

    def _append(self, record: dict[str, object]) -> None:
        assert self._file is not None
        line = (json.dumps(record, default=str, ensure_ascii=False) + "\n").encode()
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self._file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def output() -> tuple[Optional[str], Optional[int]]:
    """`KVGUARD_REPORT_DIR` and `KVGUARD_MAX_EVENTS` (None when unset), for report writers.

    Read again when the variables change (the last reading is kept in `STATE`). Guards
    refuse bad settings when they are made; here, where a report is being written, a bad
    cap is one line, then the default.
    """
    raw = (_config.read("KVGUARD_REPORT_DIR") or None, _config.read("KVGUARD_MAX_EVENTS"))
    if raw != PROCESS.output[0]:
        try:
            cap = _config.parse_max_events(raw[1])
        except ConfigError as exc:
            say(f"kvguard: {exc}; using {DEFAULT_MAX_EVENTS}")
            cap = None
        PROCESS.output = (raw, (raw[0], cap))
    return PROCESS.output[1]


def open_writer(report_dir: Optional[str | os.PathLike[str]] = None, start: bool = True) -> Optional[ReportWriter]:
    """A guard's writer: `report_dir` if given, else `KVGUARD_REPORT_DIR`; None for no files.

    `start` writes the header now, which fixes the file by the rank known now: a guard
    entering starts it; a target patched at import only counts in it (in a torchrun or
    Ray worker the rank is set after the imports).
    """
    env_dir, cap = output()
    if report_dir is not None:
        writer = writer_for(os.fspath(report_dir), "report_dir", cap)
    elif env_dir:
        writer = writer_for(env_dir, "KVGUARD_REPORT_DIR", cap)
    else:
        return None
    if writer is None or (start and not writer.begin()):
        return None
    return writer


def target_tallies(label: str) -> list[TargetStats]:
    """The counts (`TargetStats`) of target or guard `label` for the process and its report directory."""
    writer = open_writer(start=False)
    return [PROCESS.target_stats(label)] + ([writer.tally.target(label)] if writer is not None else [])


def writer_for(directory: str, source: str, cap: Optional[int] = None) -> Optional[ReportWriter]:
    """The writer for `directory` (created on first use), or None when it cannot be used.

    A directory that cannot be used is one line naming `source` (`KVGUARD_REPORT_DIR`,
    `report_dir`), once; the job runs on without files there.
    """
    global _finish_registered
    key = os.path.abspath(directory)
    if key in PROCESS.writers:
        return PROCESS.writers[key]  # type: ignore[no-any-return]
    problem = unusable(key)
    writer = None
    if problem is not None:
        say(f"kvguard: {source}={directory!r} cannot be used ({problem}); the job runs on without report files")
    else:
        if not _finish_registered:
            atexit.register(finish_all)
            _finish_registered = True
        writer = ReportWriter(key, DEFAULT_MAX_EVENTS if cap is None else cap)
        PROCESS.listeners.append(writer)
    PROCESS.writers[key] = writer
    return writer


def start_over_in_child() -> bool:
    """In a fork's child that guards on its own (a DataLoader worker), start its counts from zero:
    what the parent counted before the fork is the parent's, in its own summary. Returns whether
    this process was such a child (once: the counts are this process's from then on).

    The tallies are emptied in place: the guards entered before the fork go on counting in
    them (a guard that is to count as a call of this process opens its account again).
    """
    if PROCESS.pid == os.getpid():
        return False
    PROCESS.pid = os.getpid()
    PROCESS.tally.clear()
    for writer in PROCESS.writers.values():
        if writer is not None:
            writer.start_over()
    return True


def finish_all(diagnose: bool = True) -> None:
    """At exit: a summary record from every writer that started and still works (once per process).

    `diagnose`: with the exit diagnostics of the settings (`problems`); a DataLoader worker
    finishes without them, as the process that runs the targets says them.
    """
    try:
        problems: list[str] = []
        if diagnose and STATE.settings is not None and STATE.settings.targets:
            in_files = any(isinstance(x, ReportWriter) for x in PROCESS.listeners)
            problems = [line.removeprefix("kvguard: ") for line in diagnostics(STATE, PROCESS, in_files)]
        for writer in PROCESS.writers.values():
            # A writer whose targets were never called starts now: its file proves the run.
            if writer is not None and writer in PROCESS.listeners and (writer.started or writer.tally.targets):
                try:
                    if not writer.started and not writer.begin():
                        continue
                    writer.finish(problems)
                except OSError as exc:
                    PROCESS.drop(writer, exc)
    except Exception as exc:  # noqa: BLE001 - at exit, after the job: one line, never a traceback
        say(f"kvguard: could not finish the report files ({exc})")


def unusable(directory: str) -> Optional[str]:
    """Why report files cannot be written in `directory` (created if missing), or None.

    Checked when a directory is first named, so a bad one is one line at start-up, not an
    error at the first event.
    """
    if os.path.exists(directory) and not os.path.isdir(directory):
        return "it is a file, not a directory"
    probe = os.path.join(directory, f".kvguard-probe-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
        os.remove(probe)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _who(kind: str, info: Optional[dict[str, object]] = None) -> dict[str, object]:
    """The fields every record starts with; headers and summaries add the rank's full tags."""
    record: dict[str, object] = {"schema": SCHEMA, "record": kind, "run": _ranks.run_id(), "time": time.time(),
                              "host": socket.gethostname(), "pid": os.getpid()}
    info = info if info is not None else _ranks.rank_info()
    record["rank"] = info.get("rank")
    if kind != "event":
        record.update(world_size=info.get("world_size"), local_rank=info.get("local_rank"),
                      tags={k: v for k, v in info.items() if k not in ("rank", "world_size", "local_rank")})
    return record


def _version(package: str) -> Optional[str]:
    module = sys.modules.get(package)
    if module is not None and isinstance(getattr(module, "__version__", None), str):
        return str(module.__version__)
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001 - a version is decoration
        return None

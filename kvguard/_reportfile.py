"""Per-rank JSONL report files: write one object per event, read them back. Stdlib only.

Each process appends to `kvguard-rank<R>.jsonl` in the report directory, one line per
event, written with a single `os.write` so lines never interleave. Only summaries go in:
never pickles, never whole tensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from typing import Any, Iterator

FILE_PREFIX = "kvguard-rank"


class JsonlSink:
    """A listener that appends each event, with who and where, to this rank's file."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._path: str | None = None

    def __str__(self) -> str:
        return f"writing report files to {self.directory!r}"

    def path(self, rank: int) -> str:
        return os.path.join(self.directory, f"{FILE_PREFIX}{rank}.jsonl")

    def __call__(self, event: Any, guard: Any) -> None:
        from kvguard import _ranks

        info = _ranks.rank_info()
        rank = info.get("rank") or 0
        record = {
            "rank": rank, "world_size": info.get("world_size"), "local_rank": info.get("local_rank"),
            "tags": {k: v for k, v in info.items() if k not in ("rank", "world_size", "local_rank")},
            "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
            "target": getattr(guard, "target", None), "guard": getattr(guard, "name", None),
            "action": getattr(guard, "action", None),
            **{k: v for k, v in dataclasses.asdict(event).items() if k not in ("filename", "lineno")},
            "file": event.filename, "line": event.lineno,
        }
        line = (json.dumps(record, default=str) + "\n").encode()
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path(int(rank)), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def unusable(directory: str) -> str | None:
    """Why report files cannot be written in `directory` (created if missing), or None.

    Checked when kvguard starts, so a bad `KVGUARD_REPORT_DIR` is one line at start-up,
    not an error at the first event.
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


def read(path: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Events from a report file or a directory of them, and a list of problems found."""
    records: list[dict[str, Any]] = []
    problems: list[str] = []
    for file in _files(path):
        with open(file, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    if not isinstance(record, dict) or "path" not in record:
                        raise ValueError("not a kvguard event")
                    records.append(record)
                except ValueError as exc:
                    problems.append(f"{file}:{n}: skipped a malformed line ({exc})")
    return records, problems


def _files(path: str) -> Iterator[str]:
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.startswith(FILE_PREFIX) and n.endswith(".jsonl"))
        for name in names:
            yield os.path.join(path, name)
    elif os.path.isfile(path):
        yield path
    else:
        raise FileNotFoundError(f"no kvguard report file or directory at {path!r}")

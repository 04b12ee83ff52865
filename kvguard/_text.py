"""Plain-text helpers every part of kvguard may use. Stdlib only; imports nothing of kvguard's."""

from __future__ import annotations

import sys
from typing import Optional


def plural(count: int, noun: str, nouns: Optional[str] = None) -> str:
    """`1 write`, `10,240 writes`, `2 processes`."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


def say(line: str) -> None:
    """Write one `kvguard: ...` line to stderr, best effort: a closed or missing stderr is no error."""
    try:
        out = sys.stderr
        if out is not None:
            out.write(line.rstrip("\n") + "\n")
            out.flush()
    except Exception:  # noqa: BLE001 - a diagnostic must never become the failure
        pass

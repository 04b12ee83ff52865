"""Plain-text helpers every part of kvguard may use. Stdlib only; imports nothing of kvguard's."""

from __future__ import annotations

from typing import Optional


def plural(count: int, noun: str, nouns: Optional[str] = None) -> str:
    """`1 write`, `10,240 writes`, `2 processes`."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"

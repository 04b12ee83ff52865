"""Plain-text helpers every part of kvguard may use. Stdlib only; imports nothing of kvguard's."""

from __future__ import annotations

import difflib
import sys
from typing import Iterable, Optional


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


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`; did you mean rollout_data?` when one of `choices` is a close spelling of `word`, else "".

    Close as `difflib` measures it (a ratio of 0.75 or more, case ignored): a typo, a missing
    or extra letter, not a different word.
    """
    by_lower = {choice.lower(): choice for choice in choices if choice != word}
    close = difflib.get_close_matches(word.lower(), by_lower, n=1, cutoff=0.75)
    return f"; did you mean {by_lower[close[0]]}?" if close else ""

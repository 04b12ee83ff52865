"""Process-global activation state, in one object: what env activation set up, and its undo. Stdlib only.

What the process's guards reported (the tally, report writers, listeners) is reporting's
own state: `kvguard._report.process`.
"""

from __future__ import annotations

from typing import Any, Callable


class State:
    """Env activation's settings, whether it ran, the targets it patched, and how to undo it."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.settings: Any = None
        self.started = False
        self.patched: list[str] = []  # targets guarded in this process
        # The guard of each process-wide kind KVGUARD_TARGETS names (`kvguard._kinds`), by word, once
        # it started: `autograd` and `data` when torch loads, `weights` at the first optimizer or load
        self.kinds: dict[str, Any] = {}
        self.undo: list[Callable[[], None]] = []

    def uninstall(self) -> None:
        """Undo every patch kvguard made in this process, newest first."""
        while self.undo:
            self.undo.pop()()


STATE = State()

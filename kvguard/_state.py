"""All process-global kvguard state, in one object that tests can `reset()`. Stdlib only."""

from __future__ import annotations

from typing import Any, Callable

Listener = Callable[[Any, Any], None]  # (MutationEvent, Guard)


class State:
    """Env activation's settings, counters for the exit summary, listeners, and undo."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.settings: Any = None
        self.started = False
        self.patched: list[str] = []  # targets guarded in this process
        self.guarded_calls = 0
        self.events = 0
        self.sites: set[tuple[str, str, int]] = set()
        self.listeners: list[Listener] = []
        self.undo: list[Callable[[], None]] = []

    def publish(self, event: Any, guard: Any) -> None:
        """Tell every listener (report files, counters) about an event."""
        self.events += 1
        self.sites.add((event.path, event.filename, event.lineno))
        for listener in list(self.listeners):
            listener(event, guard)

    def summary(self, tag: str = "") -> str:
        who = f"kvguard [{tag}]" if tag else "kvguard"
        return (f"{who}: {self.guarded_calls} guarded call{'s' if self.guarded_calls != 1 else ''}, "
                f"{self.events} event{'s' if self.events != 1 else ''} at {len(self.sites)} distinct "
                f"site{'s' if len(self.sites) != 1 else ''}")

    def uninstall(self) -> None:
        """Undo every patch kvguard made in this process, newest first."""
        while self.undo:
            self.undo.pop()()


STATE = State()

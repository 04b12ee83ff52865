"""All process-global kvguard state, in one object that tests can `reset()`. Stdlib only."""

from __future__ import annotations

from typing import Any, Callable

Listener = Callable[[Any, Any], None]  # (MutationEvent, Guard)


class TargetStats:
    """What the calls of one env-activated target held, for the exit diagnostics."""

    def __init__(self) -> None:
        self.calls = 0  # guarded calls
        self.unguardable: dict[str, int] = {}  # calls skipped, by the argument's type
        self.protected = 0  # tensors protected over all calls
        self.keys_seen: set[Any] = set()  # top-level keys the argument held


class State:
    """Env activation's settings, counters for the exit summary, listeners, and undo."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.settings: Any = None
        self.started = False
        self.patched: list[str] = []  # targets guarded in this process
        self.targets: dict[str, TargetStats] = {}  # what each patched target's calls held
        self.guarded_calls = 0
        self.events = 0
        self.sites: set[tuple[str, str, int]] = set()
        self.listeners: list[Listener] = []
        self.undo: list[Callable[[], None]] = []

    def target_stats(self, target: str) -> TargetStats:
        return self.targets.setdefault(target, TargetStats())

    def publish(self, event: Any, guard: Any) -> None:
        """Tell every listener (report files, counters) about an event.

        A listener that fails is dropped with one line on stderr: writing a report must
        never replace the user's error or stop the op.
        """
        self.events += 1
        self.sites.add((event.path, event.filename, event.lineno))
        for listener in list(self.listeners):
            try:
                listener(event, guard)
            except Exception as exc:  # noqa: BLE001
                self.listeners.remove(listener)
                from kvguard._render import say

                say(f"kvguard: {listener} failed ({exc}); it gets no further events")

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

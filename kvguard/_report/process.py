"""What this process's guards reported, in one object: the exit summary's tally, report writers, listeners."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from kvguard._report.events import REDUCED_TWICE, SELF_OVERLAP
from kvguard._report.tally import SiteKey, Tally, TargetStats
from kvguard._text import say

if TYPE_CHECKING:
    from kvguard._report.events import MutationEvent


class GuardView(Protocol):
    """What a listener reads of the guard an event is of (a `Guard`, from the room above)."""

    @property
    def name(self) -> str: ...

    @property
    def target(self) -> Optional[str]: ...

    @property
    def action(self) -> str: ...

    @property
    def report_dir(self) -> Optional[str]: ...

    @property
    def call(self) -> int: ...


Listener = Callable[["MutationEvent", GuardView], None]
_OWN_PANEL = (REDUCED_TWICE, SELF_OVERLAP)  # event kinds shown in a panel even after a write at their site


class ProcessReport:
    """Every guard's counts for the exit summary, the sites already shown, and where events go."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.pid = os.getpid()  # the process these counts are of (a fork's child starts with its parent's)
        self.tally = Tally()  # every guard of the process, for the exit summary
        self.shown: set[SiteKey] = set()  # sites whose first write was printed
        # report directory -> its ReportWriter (in `files`, which imports this), None when unusable
        self.writers: dict[str, Any] = {}
        self.listeners: list[Listener] = []
        # The last reading of the report settings, by `files.output`: (raw values, parsed).
        self.output: tuple[tuple[Optional[str], Optional[str]], tuple[Optional[str], Optional[int]]] = (
            (None, None), (None, None))

    def target_stats(self, target: str) -> TargetStats:
        return self.tally.target(target)

    def first_sighting(self, event: MutationEvent) -> bool:
        """Whether this is the first write at its site to be shown (a panel, a warning)."""
        # A finding of its own kind at a site (a reduction reaching shared memory twice) is shown too.
        op = event.op if event.kind not in _OWN_PANEL else f"{event.op} {event.kind}"
        key = (event.filename, event.lineno, op)
        if key in self.shown:
            return False
        self.shown.add(key)
        return True

    def publish(self, event: MutationEvent, guard: GuardView) -> None:
        """Tell every listener (report files) about an event.

        A listener that fails is dropped with one line on stderr: writing a report must
        never replace the user's error or stop the op.
        """
        for listener in list(self.listeners):
            try:
                listener(event, guard)
            except Exception as exc:  # noqa: BLE001
                self.drop(listener, exc)

    def drop(self, listener: object, exc: Exception) -> None:
        """Stop sending events to a listener that failed, saying so in one line."""
        if listener in self.listeners:
            self.listeners.remove(listener)
        say(f"kvguard: {listener} failed ({exc}); it gets no further events")


PROCESS = ProcessReport()

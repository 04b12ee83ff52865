"""One guarded call's place in the counts: the process's tally, and its report directory's."""

from __future__ import annotations

import os
from typing import Optional

from kvguard._report import files as _files
from kvguard._report.events import MutationEvent
from kvguard._report.process import PROCESS
from kvguard._kinds import kind_of
from kvguard._report.tally import Tally


class CallAccount:
    """What one guard adds to the tallies, under its label (its target, else its name).

    Opened when the guard is entered: a guard made but never entered (the pytest plugin's
    "off") counts nowhere.
    """

    def __init__(self, label: str, report_dir: Optional[str | os.PathLike[str]] = None) -> None:
        self.label = label
        self._report_dir_option = report_dir  # the guard's report_dir= (None: KVGUARD_REPORT_DIR)
        self.report_dir: Optional[str] = None  # where the call's report files go, once opened
        self.call = 0  # the call's number in the process, once opened
        self._tallies: list[Tally] = []

    def open(self) -> None:
        """Count the call in the process's tally and in its report directory's."""
        writer = _files.open_writer(self._report_dir_option)
        self.report_dir = writer.directory if writer is not None else None
        self._tallies = [PROCESS.tally] + ([writer.tally] if writer is not None else [])
        self.call = PROCESS.tally.begin_call(self.label)
        for tally in self._tallies[1:]:
            tally.begin_call(self.label)

    def event(self, event: MutationEvent, moments: Optional[int] = None) -> None:
        """Count a write; `moments`: a process-wide kind's forward passes or optimizer steps so far
        (None: not known, at exit), by which its exit line dates the write."""
        kind = kind_of(self.label)
        moment = moments if kind is not None and kind.moment is not None else None
        for tally in self._tallies:
            tally.add(event, self.call, self.label, moment)

    def sampled(self, every: int, checked: int, seen: int) -> None:
        """The sampled tier checked `checked` of the `seen` optimizer-step intervals (1 in `every`)."""
        for tally in self._tallies:
            stats = tally.target(self.label)
            stats.sample_every = every
            stats.intervals_checked += checked
            stats.intervals_seen += seen

    def allowed(self, reason: str) -> None:
        for tally in self._tallies:
            tally.allow(reason, self.label)

    def close(self, protected: int, not_run: Optional[str], moments: int = 0, unprotected: int = 0) -> None:
        """The call is done: it protected `protected` tensors (over `moments` forward passes or
        optimizer steps, for a process-wide kind; `guard_autograd` may have left `unprotected`
        stretches or tensors unprotected), or did not run here (`not_run`, why)."""
        for tally in self._tallies:
            if not_run is None:
                tally.target(self.label).protected += protected
                tally.target(self.label).moments += moments
                tally.target(self.label).unprotected += unprotected
            else:
                tally.not_run_call(self.label, not_run)

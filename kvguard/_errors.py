"""Exceptions and warnings kvguard raises. Stdlib only; all of them survive pickling."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from kvguard._events import GuardReport, MutationEvent


class MutationError(RuntimeError):
    """A protected tensor was (or was about to be) written in place.

    Raised before the write in `action="raise"`, so the data is intact. Carries the
    `event` that triggered it and the guard's `report`; both are plain data, so the
    error pickles across processes (Ray, multiprocessing).
    """

    def __init__(self, message: str, event: Optional[MutationEvent] = None,
                 report: Optional[GuardReport] = None) -> None:
        super().__init__(message, event, report)
        self.event = event
        self.report = report

    def __str__(self) -> str:
        return str(self.args[0])


class MutationWarning(UserWarning):
    """A protected tensor was written in place (`action="warn"`)."""


class ConfigError(ValueError):
    """A kvguard setting has a value kvguard does not understand; the message names it."""

"""Exceptions and warnings kvguard raises. Stdlib only; all of them survive pickling."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from kvguard._report.events import GuardReport, MutationEvent


class MutationError(RuntimeError):
    """A protected tensor was (or was about to be) written in place.

    Raised before the write in `action="raise"`, so the data is intact. Carries the
    `event` that triggered it and the guard's `report`; both are plain data, so the
    error pickles across processes (Ray, multiprocessing).

    A handler that names this class (`except MutationError:`, `pytest.raises(
    MutationError)`; found from the bytecode when the error is raised, see `kvguard._guard.handlers`)
    or reads the error (its text, `event` or `report`) has seen it. One that catches it
    through a base class without looking (`except RuntimeError: retry`) swallowed it:
    the guard raises it again at its exit.
    """

    def __init__(self, message: str, event: Optional[MutationEvent] = None,
                 report: Optional[GuardReport] = None) -> None:
        super().__init__(message, event, report)
        # Shared with the guard that raised it, which keeps this cell, not the error (whose
        # traceback holds the writing frames), to tell at its exit whether it was read
        # (or caught by a handler that names this class).
        self.seen_cell = [False]

    @property
    def seen(self) -> bool:
        return self.seen_cell[0]

    @property
    def event(self) -> Optional[MutationEvent]:
        self.seen_cell[0] = True
        return self.args[1]  # type: ignore[no-any-return]

    @property
    def report(self) -> Optional[GuardReport]:
        self.seen_cell[0] = True
        return self.args[2]  # type: ignore[no-any-return]

    def __str__(self) -> str:
        self.seen_cell[0] = True
        return str(self.args[0])


class MutationWarning(UserWarning):
    """A protected tensor was written in place (`action="warn"`)."""


class GuardWarning(UserWarning):
    """A guard that may have looked at nothing: it protected no tensor, or a `keys` name never appeared."""


class ConfigError(ValueError):
    """A kvguard setting has a value kvguard does not understand; the message names it."""

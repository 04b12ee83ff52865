"""Tracebacks of process-wide guards end at the user's line.

A `MutationError` raised by a guard that env activation entered for the whole process
(`KVGUARD_TARGETS=autograd`, `weights`) leaves through no `with` block of kvguard's, which
would drop the engine's frames from its traceback: the excepthook drops them instead.
"""

from __future__ import annotations

import sys
from typing import Any

from kvguard._errors import MutationError

_installed = False


def end_at_the_users_line() -> None:
    """Install the excepthook once (it hands every exception on to the one it replaces)."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def excepthook(kind: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc, MutationError):
            from kvguard._protect.frames import drop_internal_frames

            drop_internal_frames(exc)
            tb = exc.__traceback__
        previous(kind, exc, tb)
    sys.excepthook = excepthook

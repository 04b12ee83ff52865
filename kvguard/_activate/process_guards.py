"""What the guards env activation enters for the whole process (`KVGUARD_TARGETS=autograd`,
`weights`) share: how their tracebacks end, and how they are left at exit.

A `MutationError` raised by such a guard leaves through no `with` block of kvguard's, which
would drop the engine's frames from its traceback: the excepthook drops them instead.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from kvguard._report.events import MutationError
from kvguard._text import say

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


def leave(guard: Optional[Any], what: str) -> None:
    """Leave a process guard at exit, so that its counts go into the summary; a finding it makes
    then is a line, not a traceback."""
    if guard is None:
        return
    try:
        guard.__exit__(None, None, None)
    except MutationError as exc:
        say(f"kvguard: {exc.args[0].splitlines()[0]}")
    except Exception as exc:  # noqa: BLE001
        say(f"kvguard: {what}: {exc}")

"""`KVGUARD_TARGETS=autograd`: one `guard_autograd` for the process, from the moment torch loads.

Entered by a post-import hook on torch on the thread that imports it (saved-tensor hooks
are per thread: the main thread's forward passes, and the backward passes they start),
and left at exit, before the summary line is printed.
"""

from __future__ import annotations

from typing import Any

from kvguard._state import STATE
from kvguard._text import say


def install(settings: Any) -> None:
    """Enter the process's autograd guard when torch is imported (now, if it is already)."""
    import wrapt

    def start(_torch: Any) -> None:
        if STATE.autograd is not None:
            return
        from kvguard._guard.autograd import AutogradGuard

        try:
            guard = AutogradGuard(action=settings.action, target="autograd", allow=settings.allow or None)
            STATE.autograd = guard.__enter__()
        except Exception as exc:  # noqa: BLE001 - a debug switch must not kill the job
            say(f"kvguard: KVGUARD_TARGETS=autograd not activated: {exc}")
    wrapt.register_post_import_hook(start, "torch")
    from kvguard._activate.process_guards import end_at_the_users_line

    end_at_the_users_line()


def stop() -> None:
    """Leave the process's autograd guard (at exit): its counts go into the summary."""
    from kvguard._activate.process_guards import leave

    guard, STATE.autograd = STATE.autograd, None
    leave(guard, "autograd guard")  # what it left unprotected ends its summary line (`tally.unprotected_text`)

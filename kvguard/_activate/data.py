"""`KVGUARD_TARGETS=data`: one `guard_data` for the process, from the moment torch loads.

Entered by a post-import hook on torch and left at exit, before the summary line. The
dataset methods it wraps are process-wide, so what a dataset returns on any thread is
protected; a DataLoader worker process activates its own (the environment reaches it,
and a forked one inherits the wrapped classes and the guard).
"""

from __future__ import annotations

from typing import Any

from kvguard._state import STATE
from kvguard._text import say


def install(settings: Any) -> None:
    """Enter the process's data guard when torch is imported (now, if it is already)."""
    import wrapt

    def start(_torch: Any) -> None:
        if STATE.data is not None:
            return
        from kvguard._guard.data import DataGuard
        from kvguard._report.tally import DATA_LABEL

        try:
            guard = DataGuard(action=settings.action, target=DATA_LABEL, allow=settings.allow or None)
            STATE.data = guard.__enter__()
        except Exception as exc:  # noqa: BLE001 - a debug switch must not kill the job
            say(f"kvguard: KVGUARD_TARGETS=data not activated: {exc}")
    wrapt.register_post_import_hook(start, "torch")
    from kvguard._activate.process_guards import end_at_the_users_line

    end_at_the_users_line()


def stop() -> None:
    """Leave the process's data guard (at exit): its counts go into the summary."""
    from kvguard._activate.process_guards import leave

    guard, STATE.data = STATE.data, None
    leave(guard, "data guard")

"""A process-wide guard kind (`kvguard._kinds`) switched on by its `KVGUARD_TARGETS` word.

Its one guard is entered by a post-import hook on torch, on the thread that imports it
(autograd's saved-tensor hooks are per thread: the main thread's forward passes, and the
backward passes they start; the dataset methods `data` wraps are process-wide), kept in
`STATE.kinds`, and left at exit before the summary line is printed. A kind that starts
another way (`weights`: at the first optimizer or load) names its own activation module,
which meets the same three functions: `install`, `stop`, `exit_lines`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from kvguard._kinds import Kind
from kvguard._state import STATE
from kvguard._text import say

if TYPE_CHECKING:
    from kvguard._config import Settings
    from kvguard._guard.guard import Guard


def activation_of(kind: Kind) -> ModuleType:
    """The module that starts and stops `kind` (this one, unless the kind names another)."""
    return importlib.import_module(kind.activation)


def install(kind: Kind, settings: Settings) -> None:
    """Enter the kind's guard for the process when torch is imported (now, if it is already)."""
    import wrapt

    def start(_torch: object) -> None:
        if kind.word in STATE.kinds:
            return
        try:
            guard = kind.guard_class()(action=settings.action, target=kind.word, allow=settings.allow or None)
            STATE.kinds[kind.word] = guard.__enter__()
            follow_sample(guard)
        except Exception as exc:  # noqa: BLE001 - a debug switch must not kill the job
            say(f"kvguard: KVGUARD_TARGETS={kind.word} not activated: {exc}")
    wrapt.register_post_import_hook(start, "torch")
    from kvguard._activate.process_guards import end_at_the_users_line

    end_at_the_users_line()


def follow_sample(guard: Guard) -> None:
    """Under `KVGUARD_SAMPLE`, a kind's guard checks only the sampled optimizer-step intervals."""
    from kvguard._guard.sampling import step_clock

    clock = step_clock()
    if clock is not None:
        guard.follow_sample(clock)


def stop(kind: Kind) -> None:
    """Leave the kind's guard (at exit): its counts go into the summary."""
    from kvguard._activate.process_guards import leave

    leave(STATE.kinds.pop(kind.word, None), f"{kind.word} guard")


def exit_lines(kind: Kind, tag: str, counted: bool) -> list[str]:
    """What the exit says beyond the tally's line: that the guard never started, where it did not."""
    return [f"{tag}: {kind.word}: {kind.never_started}"] if kind.never_started and not counted else []

"""The schedule hook: keep what `forward_backward_func` returns protected until it is logged.

Megatron's schedule (`get_forward_backward_func()`) returns `forward_data_store`: one
dict of loss/metric tensors per microbatch (`[{"lm loss": t}, ...]`) on the last
pipeline stage, `[]` elsewhere. The trainer then reduces and logs them, often with an
in-place `all_reduce`; one that forgets to clone rewrites a tensor that another
consumer (a logger, the next accumulation) reads. `guard_schedule` wraps the function
so that each call's result is guarded from the moment it is returned until an end point
the user picks: the next call (the default), or an explicit `release()`.

Level "light" is the default. The protection spans the trainer's own code between
steps (reductions, logging, the optimizer step, checkpoints): a light guard puts no
dispatch mode on the stack there, so that code runs at full speed, compiled regions and
other dispatch modes are untouched, and any thread may run it. It compares value
fingerprints when the protection ends, which catches any change by then (an in-place
`all_reduce` included, and writes no dispatch mode sees: `.data`, numpy views, another
thread). What it cannot do is
name the line or stop the write: the report names the entry and its values. Use
`level="full"` in a debugging run to get the line (every op between the steps then pays
the dispatch mode).
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Collection, Optional

import kvguard
from kvguard import _config
from kvguard._protect import frames as _frames

UNTIL = ("next_call", "release")
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MAX_DEPTH = 8
_open_schedules: "weakref.WeakSet[GuardedSchedule]" = weakref.WeakSet()
_atexit_registered = False


class GuardedSchedule:
    """`forward_backward_func` whose results stay guarded until `release()` or the next call.

    Make it with `guard_schedule(...)`; call it exactly as the function it wraps.
    """

    def __init__(self, forward_backward_func: Callable[..., Any], *, name: str = "losses_reduced",
                 action: str = "raise", until: str = "next_call", level: Optional[str] = None,
                 keys: Optional[Collection[Any]] = None, ignore: Optional[Collection[Any]] = None,
                 allow: Optional[Collection[str]] = None,
                 report_dir: Optional[str | os.PathLike[str]] = None) -> None:
        if not callable(forward_backward_func):
            raise TypeError(f"guard_schedule() wraps the function get_forward_backward_func() returns; "
                            f"got {forward_backward_func!r}")
        if until not in UNTIL:
            raise kvguard.ConfigError(f"guard_schedule(until={until!r}): expected one of {', '.join(UNTIL)}")
        # Options not given take the KVGUARD_* settings, as every guard's do; the level's
        # own default here is "light" (see the module docstring). Checked now, not at the
        # first call deep inside a training step.
        if level is None:
            level = _config.guard_defaults().level or "light"
        kvguard.guard([], name=name, action=action, keys=keys, ignore=ignore, allow=allow, level=level)
        self.__wrapped__ = forward_backward_func
        functools.update_wrapper(self, forward_backward_func)
        self.name, self.action, self.until, self.level = name, action, until, level
        self._options: dict[str, Any] = {"keys": keys, "ignore": ignore, "allow": allow, "report_dir": report_dir}
        self._open: list[tuple[kvguard.Guard, _frames.Site]] = []  # and the call that returned it
        self.calls = 0  # calls of the schedule
        self.unguarded = 0  # calls whose result held no tensor (a stage that is not the last: `[]`)
        self.reports: list[kvguard.GuardReport] = []  # those of the latest release, oldest first

    @property
    def guarded(self) -> int:
        """Results protected now (several under `until="release"` between releases)."""
        return len(self._open)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        site = _caller_site()
        if self.until == "next_call" and self._open:
            self._release(site)
        result = self.__wrapped__(*args, **kwargs)
        self.calls += 1
        if not _holds_tensor(result):
            self.unguarded += 1
            return result
        g = kvguard.guard(result, name=self.name, action=self.action, level=self.level, **self._options)
        g.__enter__()
        self._open.append((g, site))
        _exit_release(self)
        return result

    def release(self) -> list[kvguard.GuardReport]:
        """End the protection of every result still guarded; returns their reports, oldest first.

        Under action="raise" a result that was written raises `kvguard.MutationError`
        here (after every guard is closed). Called with nothing guarded, it returns `[]`.
        """
        return self._release(_caller_site())

    def _release(self, site: Optional[_frames.Site]) -> list[kvguard.GuardReport]:
        """Exit the open guards; findings point at `site` (the trainer's line), or, at
        interpreter exit (None), at the call that returned the result."""
        reports: list[kvguard.GuardReport] = []
        error: Optional[kvguard.MutationError] = None
        while self._open:
            g, opened = self._open.pop()  # newest first: level="full" modes leave the stack in order
            g.exit_site = site or opened._replace(
                code=f"{opened.code}  # returned here; still protected at interpreter exit, checked then")
            try:
                g.__exit__(None, None, None)
            except kvguard.MutationError as exc:
                error = error or exc
            reports.append(g.report)
        reports.reverse()
        if reports:
            self.reports = reports
        if error is not None:
            raise error
        return reports

    def __repr__(self) -> str:
        fn = getattr(self.__wrapped__, "__qualname__", repr(self.__wrapped__))
        return (f"<kvguard_megatron.guard_schedule {fn} name={self.name} action={self.action} "
                f"until={self.until} level={self.level}, {self.guarded} guarded>")


def guard_schedule(forward_backward_func: Callable[..., Any], *, name: str = "losses_reduced",
                   action: str = "raise", until: str = "next_call", level: Optional[str] = None,
                   keys: Optional[Collection[Any]] = None, ignore: Optional[Collection[Any]] = None,
                   allow: Optional[Collection[str]] = None,
                   report_dir: Optional[str | os.PathLike[str]] = None) -> GuardedSchedule:
    """Wrap `get_forward_backward_func()`'s function so its results stay protected until logged.

    Args:
        forward_backward_func: what `megatron.core.pipeline_parallel.get_forward_backward_func()`
            returns (or any function returning loss/metric tensors in dicts and lists).
        name: how report paths start: `losses_reduced[0]['lm loss']`.
        action, keys, ignore, allow, report_dir: as for `kvguard.guard`.
        until: "next_call" ends the previous result's protection when the schedule is
            called again; "release" keeps every result protected until `release()`.
            Protection still open at interpreter exit ends then, so it is always checked.
        level: "light" (no per-op cost between steps, findings when protection ends) or
            "full" (the writing line, and raise before the write); default: `KVGUARD_LEVEL`,
            else "light". Options not given take their `KVGUARD_*` setting, as for every guard.

    Example::

        forward_backward_func = guard_schedule(get_forward_backward_func(), action="warn")
        losses_reduced = forward_backward_func(forward_step_func=..., data_iterator=..., ...)
        log(losses_reduced)                 # a write to them here is reported ...
        forward_backward_func.release()     # ... here, or at the next call
    """
    return GuardedSchedule(forward_backward_func, name=name, action=action, until=until, level=level, keys=keys,
                           ignore=ignore, allow=allow, report_dir=report_dir)


def _holds_tensor(obj: Any, depth: int = 0) -> bool:
    """Whether a schedule's result holds a tensor (dicts, lists and tuples, a few levels deep)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return True
    if depth >= _MAX_DEPTH:
        return False
    if isinstance(obj, Mapping):
        return any(_holds_tensor(value, depth + 1) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(value, depth + 1) for value in obj)
    return False


def _caller_site() -> _frames.Site:
    """The trainer's line: the first user frame outside kvguard and this package."""
    for frame in _frames.user_frames(sys._getframe(1)):
        if not os.path.abspath(frame.f_code.co_filename).startswith(_HERE):
            return _frames.site_of(frame)
    return _frames.UNKNOWN_SITE


def _exit_release(schedule: GuardedSchedule) -> None:
    """Release what is still guarded at interpreter exit (before kvguard writes its summaries)."""
    global _atexit_registered
    _open_schedules.add(schedule)
    if not _atexit_registered:
        # Registered after the first guard opened its report file, so it runs before the
        # summaries are written (atexit runs last-registered first).
        atexit.register(_release_all)
        _atexit_registered = True


def _release_all() -> None:
    for schedule in list(_open_schedules):
        try:
            schedule._release(None)
        except kvguard.MutationError as exc:
            sys.stderr.write(f"{exc}\n")
        except Exception as exc:  # noqa: BLE001 - at exit: one line, never a traceback
            sys.stderr.write(f"kvguard: could not release {schedule!r} at exit ({exc})\n")

"""Intended writes: path patterns a guard lets through, and `kvguard.allow(reason)`. Stdlib only.

Some in-place writes are meant (whitening `rollout_data['advantages']` after logging, an
optimizer step on parameters in the dict). Saying so keeps them out of reports without
dropping a whole key: they are counted as allowed, with the pattern or the reason, and
they happen even under `action="raise"`.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import sys
import types
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Sequence

from kvguard import _intended
from kvguard._errors import ConfigError
from kvguard._paths import check_pattern, matcher

if TYPE_CHECKING:
    import torch

_reason: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("kvguard_allow", default=None)
# The boundary checks of the active guards (each one decides whether it runs on this thread),
# run as an allow block begins and as it ends.
boundaries: list[Callable[[], None]] = []


@contextlib.contextmanager
def allow(reason: str) -> Iterator[None]:
    """Let every write inside the block through, counted as allowed with `reason`.

    Use inside a guarded region for writes that are meant::

        with kvguard.allow("whiten advantages in place, after they were logged"):
            rollout_data["advantages"][i].sub_(mean).div_(std)

    Outside any guard it does nothing. Writes inside are not reported and never raise;
    the exit summary and report files count them under the reason. That includes
    changes no op reports (a write through `.numpy()`): inside a guard the block begins
    and ends with the guard's boundary check, so a change made in the block is allowed
    even when the guard only finds it later, and one made before the block is reported
    as usual. Each check reads every protected tensor's values once: in a hot loop, put
    the block around the loop rather than inside it.
    """
    if not isinstance(reason, str) or not reason.strip():
        raise ConfigError(f"kvguard.allow() takes a reason, e.g. kvguard.allow('whitening after logging'); "
                          f"got {reason!r}")
    _check_boundaries()  # changes from before the block are not the block's
    token = _reason.set(reason.strip())
    try:
        yield
    finally:
        try:
            _check_boundaries()  # inside the block still: what changed in it is allowed
        finally:
            _reason.reset(token)


def _check_boundaries() -> None:
    for check in list(boundaries):
        check()


# `module:qualname`: a function whose writes are all intended while it runs (a weight sync).
_SCOPE = re.compile(r"^([A-Za-z_][\w.]*):([A-Za-z_][\w.]*)$")
_HEAD = re.compile(r"^[^\[.]*")  # a path's first name: the guard's (`rd` of `rd['kl'][0]`)
# The patterns already said to match nothing, per env target: a target's calls each have a
# guard, and it is said once per process, not per call.
said_by_target: dict[str, set[str]] = {}


class Allowlist:
    """Path patterns in the form reports print: `rollout_data['kl'][*]`, `[*]` for any list index;
    and function scopes, `module:qualname`: every write made while that function runs.

    A pattern also covers everything below it: `rollout_data['advantages']` allows
    `rollout_data['advantages'][3]`. A scope names a function as a target does, without
    the argument (`myrl.sync:WeightSyncer.push`), and is found on the writing op's stack.
    `intended`: the well-known intended writers the guard applies with no setting
    (`kvguard._intended`), found on the stack the same way, after the user's own.
    """

    def __init__(self, patterns: Iterable[str], source: str, intended: Sequence[_intended.Writer] = (),
                 unread: Sequence[_intended.Writer] = ()) -> None:
        if isinstance(patterns, str):
            patterns = (patterns,)
        self.intended = tuple(intended)
        self.unread = tuple(unread)  # known writers whose installed library is outside their range
        self.patterns = tuple(check_pattern(p, source) for p in patterns)
        self._compiled = [(p, matcher(p)) for p in self.patterns if not _SCOPE.match(p)]
        self._scopes = [(p, m.group(1), m.group(2)) for p in self.patterns if (m := _SCOPE.match(p))]

    @staticmethod
    def block_reason() -> Optional[str]:
        """Why every write now is allowed (inside `kvguard.allow('...')`), or None."""
        given = _reason.get()
        return f"kvguard.allow({given!r})" if given is not None else None

    def intended_reason(self, reached: _intended.Reached = tuple) -> Optional[str]:
        """Why a write now is allowed by a well-known intended writer running (`kvguard._intended`) and
        meant to write what it reaches (`reached()`: the tensors written), or None."""
        found = _intended.writing(self.intended, sys._getframe(1), reached, _overlap) if self.intended else None
        return f"intended writer {found.writer.name}" if found is not None else None

    def unread_hint(self, reached: _intended.Reached = tuple) -> str:
        """For a write reported while a known writer runs whose library version is outside the range it
        was read in: a hint naming it, its versions and the fix; else ''."""
        found = _intended.writing(self.unread, sys._getframe(1), reached, _overlap) if self.unread else None
        return _intended.hint(found) if found is not None else ""

    def reason(self, path: str, reached: _intended.Reached = tuple) -> Optional[str]:
        """Why a write to `path` is allowed (`allow=PATTERN`, `kvguard.allow('...')`, an intended
        writer meant to write `reached()`, the tensors at `path`), or None."""
        given = _reason.get()
        if given is not None:
            return f"kvguard.allow({given!r})"
        for pattern, compiled in self._compiled:
            if compiled.match(path):
                return f"allow={pattern}"
        for pattern, module, qualname in self._scopes:
            if _running(module, qualname, sys._getframe(1)):
                return f"allow={pattern}"
        found = _intended.writing(self.intended, sys._getframe(1), reached, _overlap) if self.intended else None
        return f"intended writer {found.writer.name}" if found is not None else None

    def never_matching(self, path: str, name: str, said: set[str]) -> Optional[str]:
        """Why some path patterns can match nothing, unless in `said` (then added); None if none.

        Every path of a guard named `name` starts with it (`rd` in `rd['kl'][0]`), so a
        pattern starting with another (`rollout_data['kl'][*]`) never matches: its writes
        are reported while the user thinks them allowed. `path` is the one just written;
        the pattern under the guard's name is suggested when it would match. Guards whose
        paths have other roots (a model per optimizer, autograd's `<saved by ...>`) are
        not judged.
        """
        head = _HEAD.match(path).group(0)  # type: ignore[union-attr]  # matches any string
        if head != name:
            return None
        lines = []
        for pattern, _ in self._compiled:
            other = _HEAD.match(pattern).group(0)  # type: ignore[union-attr]
            if other == head or pattern in said:
                continue
            said.add(pattern)
            renamed = head + pattern[len(other):]
            meant = f"; did you mean {renamed}?" if matcher(renamed).match(path) else ""
            lines.append(f"allow pattern {pattern} matches no path: paths here start with {head}, "
                         f"as {path} just written does{meant}")
        return "; ".join(lines) or None


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share an element's memory, for `_intended.writing` (imported on the first
    question: by then torch made a write, while importing kvguard imports no torch)."""
    from kvguard._protect.geometry import elements_overlap

    return elements_overlap(a, b)


def _running(module: str, qualname: str, frame: Optional[types.FrameType]) -> bool:
    """Whether `module:qualname` is on the stack from `frame` up."""
    while frame is not None:
        if frame.f_globals.get("__name__") == module and _intended.code_qualname(frame) == qualname:
            return True
        frame = frame.f_back
    return False

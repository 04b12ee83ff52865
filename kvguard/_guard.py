"""`guard()` and `guarded()`: apply the action, own the report, run the exit check.

Torch-free at import: the engine (`_mode`, `_protect`) loads when a guard is entered.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from typing import Any, Callable, Collection, Literal, Optional, TypeVar

from kvguard import _frames, _ranks, _render
from kvguard._errors import ConfigError, MutationError, MutationWarning
from kvguard._events import GuardReport, MutationEvent
from kvguard._state import STATE

ACTIONS = ("raise", "warn", "record")
F = TypeVar("F", bound=Callable[..., Any])


class Guard:
    """A context manager that protects every tensor reachable from `obj`.

    Use through `kvguard.guard(...)`. After (or during) the block, `g.report` holds what
    happened. A guard can be entered once.
    """

    def __init__(self, obj: Any, *, name: Optional[str] = None, action: str = "raise",
                 keys: Optional[Collection[Any]] = None, ignore: Collection[Any] = ()) -> None:
        self.action = _check_action(action)
        _check_target(obj)
        self.obj = obj
        self.name = name if name is not None else _caller_name(obj)
        self.keys = _as_keys(keys, "keys")
        self.ignore = _as_keys(ignore, "ignore") or ()
        self.report = GuardReport(name=self.name, action=self.action)
        self._warned: set[tuple[str, str, int]] = set()
        self._mode: Any = None
        self._protected: Any = None
        self._entered = False
        self.target: Optional[str] = None  # set when env activation guards a target
        # Where exit-check events are located; defaults to the frame that exits the guard
        # (integrations such as the pytest plugin point it at the test instead).
        self.exit_site: Optional[_frames.Site] = None

    def __enter__(self) -> Guard:
        if self._entered:
            raise RuntimeError("a kvguard.guard(...) can be entered once; create a new one")
        self._entered = True
        from kvguard._mode import MutationGuardMode
        from kvguard._protect import ProtectedSet

        self._protected = ProtectedSet(self.obj, self.name, self.keys, self.ignore)
        self._mode = MutationGuardMode(self._protected, self._on_event, block=self.action == "raise")
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        from kvguard import _torch

        if _torch.innermost_dispatch_mode() is not self._mode:
            # Popping now would pop someone else's mode (torch pops the innermost).
            raise RuntimeError(f"{self!r} exited while another dispatch mode entered after it is "
                               "still active; exit guards and modes in reverse order of entry")
        try:
            self._mode.__exit__(exc_type, exc, tb)
        finally:
            unobserved = self._exit_check()
            self._protected.close()
            self._protected = self._mode = None
            self.obj = None
        for event in unobserved:
            self._on_event(event, at_exit=True)
        if unobserved and self.action == "raise" and exc_type is None:
            # Too late to stop the change, but a raise guard must not end quietly. An
            # exception already leaving the block is never masked.
            raise MutationError(_render.format_event(unobserved[0]), unobserved[0], self.report)
        return False

    def _exit_check(self) -> list[MutationEvent]:
        """Changes no op reported: a protected tensor re-pointed behind the mode's back."""
        moved = self._protected.changed_behind_our_back()
        if not moved:
            return []
        from kvguard import _diff

        site = self.exit_site or _frames.user_site()
        events = []
        for entry, tensor, old, now in moved:
            events.append(MutationEvent(
                path=entry.path, op="(no dispatched op)", kind="unobserved", blocked=False,
                filename=site.filename, lineno=site.lineno, code=site.code, function=site.function,
                placed_at=entry.placed_at, tensor=_diff.describe(tensor), before=_fingerprint_text(old),
                after=_fingerprint_text(now),
                diff="identity or memory changed with no dispatched op (k.data = ..., or code the guard cannot see)",
            ))
        return events

    def _on_event(self, event: MutationEvent, at_exit: bool = False) -> None:
        self.report.events.append(event)
        STATE.publish(event, self)
        if self.action == "raise" and not at_exit:
            raise MutationError(_render.format_event(event), event, self.report)
        if self.action == "warn":
            key = (event.path, event.filename, event.lineno)
            if key not in self._warned:
                self._warned.add(key)
                _render.print_event(event, tag=_ranks.rank_tag())
                warnings.warn_explicit(event.headline(), MutationWarning, event.filename, event.lineno)

    def __repr__(self) -> str:
        state = "active" if self._mode is not None else ("done" if self._entered else "new")
        return f"<kvguard.guard {self.name} action={self.action} {state}, {len(self.report.events)} events>"


def guard(obj: Any, *, name: Optional[str] = None, action: str = "raise",
          keys: Optional[Collection[Any]] = None, ignore: Collection[Any] = ()) -> Guard:
    """Protect every tensor reachable from `obj` while the `with` block runs.

    Args:
        obj: a dict, list, tuple or tensor, nested at any depth. Tensors placed into its
            dicts and lists inside the block are protected from the moment they are placed.
        name: how paths start in reports (`rollout_data['kl'][0]`); defaults to the
            caller's variable name for `obj`.
        action: "raise" stops the write with `MutationError` before it happens; "warn"
            lets it happen, warns once per (tensor, line) and prints a report to stderr;
            "record" only fills `g.report`.
        keys: protect only these top-level keys (or indices).
        ignore: never protect these top-level keys (or indices).

    Example::

        with kvguard.guard(rollout_data, action="warn") as g:
            compute_advantages_and_returns(args, rollout_data)
        print(g.report.format())
    """
    return Guard(obj, name=name, action=action, keys=keys, ignore=ignore)


def guarded(argname: str, *, name: Optional[str] = None, action: str = "raise",
            keys: Optional[Collection[Any]] = None, ignore: Collection[Any] = ()) -> Callable[[F], F]:
    """Decorator: guard the argument `argname` on every call of the function.

    The last call's report is kept on the wrapper as `fn.last_report`.

    Example::

        @kvguard.guarded("rollout_data", action="warn")
        def compute_advantages_and_returns(args, rollout_data): ...
    """
    _check_action(action)
    if not isinstance(argname, str):
        raise TypeError(f"kvguard.guarded() takes the argument's name as a string, got {argname!r}")

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        if argname not in signature.parameters:
            raise TypeError(
                f"kvguard.guarded({argname!r}): {fn.__qualname__}() has no parameter {argname!r}; "
                f"its parameters are {', '.join(signature.parameters) or 'none'}"
            )
        if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn):
            raise TypeError(f"kvguard.guarded() supports plain functions; {fn.__qualname__} is "
                            "a coroutine or generator function")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            if argname not in bound.arguments:
                return fn(*args, **kwargs)  # left at its default: nothing of the caller's to protect
            g = Guard(bound.arguments[argname], name=name or argname, action=action, keys=keys, ignore=ignore)
            wrapper.last_report = g.report  # type: ignore[attr-defined]
            with g:
                return fn(*args, **kwargs)

        wrapper.last_report = None  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def _check_action(action: Any) -> str:
    if action not in ACTIONS:
        raise ConfigError(f"invalid action {action!r}; expected one of {', '.join(ACTIONS)}")
    return str(action)


def guardable(obj: Any) -> bool:
    """Whether `obj` is something a guard protects: a dict, list, tuple or tensor."""
    if isinstance(obj, (dict, list, tuple)):
        return True
    torch = sys.modules.get("torch")  # no torch imported: obj cannot be a tensor
    return torch is not None and isinstance(obj, torch.Tensor)


def _check_target(obj: Any) -> None:
    if not guardable(obj):
        raise TypeError(
            f"kvguard.guard() protects a dict, list, tuple or tensor (nested at any depth); "
            f"got {type(obj).__name__}"
        )


def _as_keys(keys: Any, what: str) -> Optional[tuple[Any, ...]]:
    if keys is None:
        return None
    if isinstance(keys, (str, bytes, int)):
        return (keys,)
    try:
        return tuple(keys)
    except TypeError:
        raise TypeError(f"kvguard.guard({what}=...) takes a key or a collection of keys, got {keys!r}") from None


def _caller_name(obj: Any) -> str:
    frame = next(_frames.user_frames(sys._getframe(1)), None)
    if frame is not None:
        for scope in (frame.f_locals, frame.f_globals):
            names = [n for n, v in scope.items() if v is obj and not n.startswith("_")]
            if len(names) == 1:
                return names[0]
    return "obj"


def _fingerprint_text(fp: tuple[Any, ...]) -> str:
    if len(fp) >= 5:
        return f"data_ptr {fp[1]:#x}, shape {tuple(fp[2])}, stride {fp[3]}, offset {fp[4]}"
    return repr(fp[1:]) if len(fp) > 1 else "unknown"

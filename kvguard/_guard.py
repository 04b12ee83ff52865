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
from kvguard._errors import ConfigError, GuardWarning, MutationError, MutationWarning
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
        self._raised: list[MutationError] = []  # raised in ops; unread ones are raised again at exit
        self.target: Optional[str] = None  # set when env activation guards a target
        # Where exit-check events are located; defaults to the frame that exits the guard
        # (integrations such as the pytest plugin point it at the test instead).
        self.exit_site: Optional[_frames.Site] = None
        # Warnings that a `-W error` filter turned into exceptions: never raised into the
        # user's code, kept for integrations (the pytest plugin fails the test with them).
        self.unraised_warnings: list[Warning] = []
        self.keys_seen: frozenset[Any] = frozenset()  # top-level keys the object held (set at exit)
        self.protected_count = 0  # tensors protected over the guard's life (set at exit)

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

        if self._mode is None:
            raise RuntimeError(f"{self!r} exited without being entered")
        try:
            if not _torch.exit_dispatch_mode(self._mode, (exc_type, exc, tb)):
                self._mode.unhook()  # on another thread's stack: inert once the set is closed
        finally:
            unobserved = self._exit_check()
            self.keys_seen = frozenset(self._protected.keys_seen)
            self.protected_count = self._protected.protected_count
            self._protected.close()
            self._protected = self._mode = None
            self.obj = None
        for event in unobserved:
            self._on_event(event, at_exit=True)
        if isinstance(exc, MutationError) and exc.args[2] is self.report:
            _frames.drop_internal_frames(exc)
        if exc_type is None and self.target is None:
            self._warn_if_blind()
        if exc_type is not None or self.action != "raise":
            return False  # an exception already leaving the block is never masked
        raised = next((error for error in self._raised if not error.seen), None)
        if raised is not None:
            # An `except RuntimeError:` around the write swallowed the error unread: the
            # write was skipped and the code went on as if it had happened.
            raise MutationError(raised.args[0] + "\n" + _render.detail_line(
                "caught", "this MutationError was caught inside the guard and never read (an except "
                "clause around the write?); the write did not happen"), raised.args[1], self.report)
        if unobserved:
            # Too late to stop the change, but a raise guard must not end quietly.
            raise MutationError(_render.format_event(unobserved[0]), unobserved[0], self.report)
        return False

    def _warn_if_blind(self) -> None:
        """A `GuardWarning` when the guard may have looked at nothing."""
        missing = [k for k in self.keys or () if k not in self.keys_seen]
        if missing:
            self._warn(f"kvguard.guard({self.name}, keys=...): {', '.join(map(repr, missing))} never appeared "
                       f"in {self.name} (it held {_key_list(self.keys_seen)}); nothing was protected under "
                       f"{'that name' if len(missing) == 1 else 'those names'}", GuardWarning)
        elif self.protected_count == 0:
            self._warn(f"kvguard.guard({self.name}) protected no tensor: {self.name} held none while the "
                       "guard was active, so no write could be checked", GuardWarning)

    def _warn(self, message: str, category: type[Warning], filename: Optional[str] = None,
              lineno: int = 0) -> None:
        """Warn without ever raising into the user's code (`-W error` must not kill the job)."""
        try:
            if filename is None:
                site = self.exit_site or _frames.user_site()
                filename, lineno = site.filename, site.lineno
            warnings.warn_explicit(message, category, filename, lineno)
        except Exception as exc:  # noqa: BLE001 - a warnings filter set to "error", or a broken hook
            self.unraised_warnings.append(exc if isinstance(exc, Warning) else category(message))
            if category is not MutationWarning:  # a MutationWarning's panel is printed already
                _render.say(f"kvguard: {message}")

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
            error = MutationError(_render.format_event(event), event, self.report)
            self._raised.append(error)
            raise error
        if self.action == "warn":
            key = (event.path, event.filename, event.lineno)
            if key not in self._warned:
                self._warned.add(key)
                _render.print_event(event, tag=_ranks.rank_tag())
                self._warn(event.headline(), MutationWarning, event.filename, event.lineno)

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
            outer.last_report = g.report  # type: ignore[attr-defined]
            with g:
                return fn(*args, **kwargs)

        outer = outside_dynamo(wrapper)
        outer.last_report = None  # type: ignore[attr-defined]
        return outer  # type: ignore[return-value]

    return decorate


def outside_dynamo(fn: F) -> F:
    """`fn`, run eagerly when called from `torch.compile`d code.

    Entering and leaving a guard (weak references, frames, a dispatch mode) must be
    invisible to Dynamo: traced, it crashes. The guarded call itself runs eagerly, as
    compiled code does anyway under a dispatch mode. Imports torch: call it only where
    torch code is being wrapped.
    """
    import torch

    disable: Callable[[F], F] = getattr(torch, "_disable_dynamo")  # dynamo.disable, imported lazily
    return disable(fn)


def _check_action(action: Any) -> str:
    """The action, in any letter case: `"Warn"` works like `KVGUARD=WARN`."""
    spelled = action.strip().lower() if isinstance(action, str) else action
    if spelled not in ACTIONS:
        raise ConfigError(f"invalid action {action!r}; expected one of {', '.join(ACTIONS)} (any case)")
    return str(spelled)


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


_NAMING_CALLS = ("guard", "Guard", "protect")
_MAX_NAME_CHARS = 80


def _caller_name(obj: Any) -> str:
    """How the caller spelled `obj`: `rollout_data`, `self.rollout_data`, `batch["rollout"]`.

    Read from the calling line's source; without source, the one variable bound to
    `obj`; else "obj".
    """
    frame = next(_frames.user_frames(sys._getframe(1)), None)
    if frame is None:
        return "obj"
    text = _frames.call_argument_text(frame, _NAMING_CALLS)
    if text and len(text) <= _MAX_NAME_CHARS:
        return text
    names = [n for n, v in _frames.frame_namespace(frame).items() if v is obj and not n.startswith("_")]
    return names[0] if len(names) == 1 else "obj"


def _key_list(keys: Collection[Any]) -> str:
    shown = sorted(map(repr, keys))
    return ", ".join(shown[:8]) + (f" … (+{len(shown) - 8})" if len(shown) > 8 else "") if shown else "no keys"


def _fingerprint_text(fp: tuple[Any, ...]) -> str:
    if len(fp) >= 5:
        return f"data_ptr {fp[1]:#x}, shape {tuple(fp[2])}, stride {fp[3]}, offset {fp[4]}"
    return repr(fp[1:]) if len(fp) > 1 else "unknown"

"""Guard named functions when their module is imported (wrapt post-import hooks).

`install(targets, ...)` registers a hook per target module; if the module is already
imported, the hook runs at once. The patch also rebinds names that other modules
imported before it (`from .loss import compute_advantages_and_returns`). A hook never
lets an exception escape: a failure is one line on stderr and the import goes on.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
from typing import Any, Callable, Iterable, Optional

import wrapt

from kvguard._config import Calls, Target
from kvguard._guard import Guard, guardable, outside_dynamo
from kvguard._render import say
from kvguard._reportfile import open_writer
from kvguard._state import STATE
from kvguard._tally import TargetStats

_MARK = "__kvguard_target__"
_MISSING = object()  # the argument was not passed (left at its default)


def install(targets: Iterable[Target], action: str, keys: Optional[tuple[str, ...]] = None,
            ignore: tuple[str, ...] = (), allow: tuple[str, ...] = (), calls: Calls = Calls(),
            level: str = "full") -> None:
    """Guard each target's argument on the selected calls, from the moment its module loads."""
    for target in targets:
        wrapt.register_post_import_hook(_hook(target, action, keys, ignore, allow, calls, level), target.module)


def _hook(target: Target, *options: Any) -> Callable[[Any], None]:
    def on_import(module: Any) -> None:
        try:
            patch(module, target, *options)
        except Exception as exc:  # noqa: BLE001 - never break the user's import
            from kvguard._presets import missing_reason

            if missing_reason(target, module) is None:  # a preset's function missing here: said at exit
                say(f"kvguard: cannot guard {target}: {exc}")
    return on_import


def patch(module: Any, target: Target, action: str, keys: Any = None, ignore: Any = (),
          allow: tuple[str, ...] = (), calls: Calls = Calls(), level: str = "full") -> None:
    """Wrap `module.<qualname>` so the selected calls guard `argname`; rebind stale aliases.

    The wrapper is a plain function (a `staticmethod`/`classmethod` stays one), not a
    wrapt proxy: Dynamo takes a proxy for the function it wraps and compiles the
    original, guard and all skipped. Calls are numbered from 1, selected by `calls` or not.
    """
    owner_path, _, attr = target.qualname.rpartition(".")
    owner = module
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part)
    if not hasattr(owner, attr):
        raise AttributeError(f"{target.module} has no attribute {target.qualname!r}")
    original = inspect.getattr_static(owner, attr)
    if getattr(getattr(owner, attr), _MARK, None) is not None:
        return  # already guarded (the hook ran twice)
    function = getattr(owner, attr)
    rewrap = type(original) if isinstance(original, (staticmethod, classmethod)) else None
    inner = original.__func__ if rewrap is not None else original
    signature = inspect.signature(inner)
    if target.argname not in signature.parameters:
        raise TypeError(f"{target.qualname}() has no parameter {target.argname!r}; "
                        f"its parameters are {', '.join(signature.parameters)}")

    label = str(target)
    numbers = itertools.count(1)

    @functools.wraps(inner)
    def guarded_call(*args: Any, **kwargs: Any) -> Any:
        number = next(numbers)
        try:
            value = signature.bind_partial(*args, **kwargs).arguments.get(target.argname, _MISSING)
        except TypeError:
            value = _MISSING  # let the call itself report the bad arguments
        if value is _MISSING:  # left at its default: nothing of the caller's to protect
            return inner(*args, **kwargs)
        if not guardable(value):  # said at exit: the argument held nothing to guard
            kind = _type_name(value)
            for stats in _tallies(label):
                stats.unguardable[kind] = stats.unguardable.get(kind, 0) + 1
            return inner(*args, **kwargs)
        if not calls.selects(number):  # KVGUARD_CALLS: counted in the summary
            for stats in _tallies(label):
                stats.unguarded_calls += 1
            return inner(*args, **kwargs)
        g = Guard(value, name=target.argname, action=action, keys=keys, ignore=ignore, allow=allow, target=label,
                  level=level)
        try:
            with g:
                return inner(*args, **kwargs)
        finally:
            STATE.target_stats(label).keys_seen.update(g.keys_seen)

    wrapper = outside_dynamo(guarded_call)
    setattr(wrapper, _MARK, str(target))
    setattr(owner, attr, rewrap(wrapper) if rewrap is not None else wrapper)
    rebound = _rebind_aliases(function, getattr(owner, attr), skip=owner)
    STATE.patched.append(str(target))
    STATE.undo.append(lambda: _restore(owner, attr, original, rebound))
    _tallies(label)  # listed in the summaries, called or not


def _tallies(label: str) -> list[TargetStats]:
    """The target's counts for the process and, when report files are written, for its directory."""
    writer = open_writer(start=False)
    return [STATE.target_stats(label)] + ([writer.tally.target(label)] if writer is not None else [])


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _rebind_aliases(function: Any, wrapper: Any, skip: Any) -> list[tuple[Any, str]]:
    """Point `from x import fn` copies in other modules at the wrapper."""
    rebound = []
    for module in list(sys.modules.values()):
        if module is None or module is skip:
            continue
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for name, value in list(namespace.items()):
            if value is function:
                setattr(module, name, wrapper)
                rebound.append((module, name))
    return rebound


def _restore(owner: Any, attr: str, original: Any, rebound: list[tuple[Any, str]]) -> None:
    setattr(owner, attr, original)
    unwrapped = getattr(owner, attr)
    for module, name in rebound:
        setattr(module, name, unwrapped)


"""Guard named functions when their module is imported (wrapt post-import hooks).

`install(targets, ...)` registers a hook per target module; if the module is already
imported, the hook runs at once. The patch also rebinds names that other modules
imported before it (`from .loss import compute_advantages_and_returns`). A hook never
lets an exception escape: a failure is one line on stderr and the import goes on.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Iterable, Optional

import wrapt

from kvguard._config import Target
from kvguard._guard import Guard, guardable, outside_dynamo
from kvguard._render import say
from kvguard._state import STATE

_MARK = "__kvguard_target__"
_MISSING = object()  # the argument was not passed (left at its default)


def install(targets: Iterable[Target], action: str, keys: Optional[tuple[str, ...]] = None,
            ignore: tuple[str, ...] = ()) -> None:
    """Guard each target's argument on every call, from the moment its module loads."""
    for target in targets:
        wrapt.register_post_import_hook(_hook(target, action, keys, ignore), target.module)


def _hook(target: Target, action: str, keys: Any, ignore: Any) -> Callable[[Any], None]:
    def on_import(module: Any) -> None:
        try:
            patch(module, target, action, keys, ignore)
        except Exception as exc:  # noqa: BLE001 - never break the user's import
            say(f"kvguard: cannot guard {target}: {exc}")
    return on_import


def patch(module: Any, target: Target, action: str, keys: Any = None, ignore: Any = ()) -> None:
    """Wrap `module.<qualname>` so each call guards `argname`; rebind stale aliases.

    The wrapper is a plain function (a `staticmethod`/`classmethod` stays one), not a
    wrapt proxy: Dynamo takes a proxy for the function it wraps and compiles the
    original, guard and all skipped.
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

    stats = STATE.target_stats(str(target))

    @functools.wraps(inner)
    def guarded_call(*args: Any, **kwargs: Any) -> Any:
        try:
            value = signature.bind_partial(*args, **kwargs).arguments.get(target.argname, _MISSING)
        except TypeError:
            value = _MISSING  # let the call itself report the bad arguments
        if not guardable(value):
            if value is not _MISSING:  # said at exit: the argument held nothing to guard
                kind = _type_name(value)
                stats.unguardable[kind] = stats.unguardable.get(kind, 0) + 1
            return inner(*args, **kwargs)
        STATE.guarded_calls += 1
        stats.calls += 1
        g = Guard(value, name=target.argname, action=action, keys=keys, ignore=ignore)
        g.target = str(target)
        try:
            with g:
                return inner(*args, **kwargs)
        finally:
            stats.protected += g.protected_count
            stats.keys_seen.update(g.keys_seen)

    wrapper = outside_dynamo(guarded_call)
    setattr(wrapper, _MARK, str(target))
    setattr(owner, attr, rewrap(wrapper) if rewrap is not None else wrapper)
    rebound = _rebind_aliases(function, getattr(owner, attr), skip=owner)
    STATE.patched.append(str(target))
    STATE.undo.append(lambda: _restore(owner, attr, original, rebound))


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


"""Guard named functions when their module is imported (wrapt post-import hooks).

`install(targets, ...)` registers a hook per target module; if the module is already
imported, the hook runs at once. The patch also rebinds names that other modules
imported before it (`from .loss import compute_advantages_and_returns`). A hook never
lets an exception escape: a failure is one line on stderr and the import goes on.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import types
from typing import Any, Callable, Iterable, Optional

import wrapt

from kvguard._config import Calls
from kvguard._guard import calls as _calls
from kvguard._guard.guard import Guard
from kvguard._guard.target import guardable
from kvguard._presets import missing_reason
from kvguard._protect import tree as _tree
from kvguard._report.diagnostics import WALKED, first_hints, not_guarded
from kvguard._report.files import target_tallies
from kvguard._report.process import PROCESS
from kvguard._state import STATE
from kvguard._presets import Target
from kvguard._text import did_you_mean, say

_MARK = "__kvguard_target__"


def install(targets: Iterable[Target], action: str, keys: Optional[tuple[str, ...]] = None,
            ignore: tuple[str, ...] = (), allow: tuple[str, ...] = (), calls: Calls = Calls(),
            level: str = "full") -> None:
    """Guard each target's argument on the selected calls, from the moment its module loads."""
    for target in targets:
        wrapt.register_post_import_hook(_hook(target, action, keys, ignore, allow, calls, level), target.module)


def _hook(target: Target, *options: Any) -> Callable[[types.ModuleType], None]:  # options: as `patch` takes them
    def on_import(module: types.ModuleType) -> None:
        try:
            patch(module, target, *options)
        except Exception as exc:  # noqa: BLE001 - never break the user's import
            if target.module == "__main__" and isinstance(exc, AttributeError):
                say(main_script_line(target))
            elif missing_reason(target, module) is None:  # a preset's function missing here: said at exit
                not_guarded[str(target)] = str(exc)  # said again at exit, where a clean-looking summary ends
                say(f"kvguard: cannot guard {target}: {exc}")
    return on_import


def main_script_line(target: Target) -> str:
    """Why a `__main__:fn` target cannot be guarded from start-up, and what to do instead.

    The script's functions do not exist yet when kvguard starts (the `.pth` runs before
    the script), and a script is run, not imported, so no import hook ever sees them
    defined; catching the definition would take a trace function slowing every call of
    the job.
    """
    name = target.qualname.partition(".")[0]
    return (f"kvguard: cannot guard {target}: the main script defines {name} only as it runs, after kvguard "
            "starts, and a script is not imported, so no hook sees it; move it into a module the script "
            f"imports and name that module (module:{target.qualname}({target.argname})), or decorate it "
            f"with @kvguard.guarded({target.argname!r})")


def patch(module: types.ModuleType, target: Target, action: str, keys: Optional[tuple[str, ...]] = None,
          ignore: tuple[str, ...] = (), allow: tuple[str, ...] = (), calls: Calls = Calls(),
          level: str = "full") -> None:
    """Wrap `module.<qualname>` so the selected calls guard `argname`; rebind stale aliases.

    The wrapper is a plain function of the original's form (see `kvguard._guard.calls`; a
    `staticmethod`/`classmethod` stays one), not a wrapt proxy: Dynamo takes a proxy for
    the function it wraps and compiles the original, guard and all skipped. Calls are
    numbered from 1, selected by `calls` or not.
    """
    attr = target.qualname.rpartition(".")[2]
    owner = found = module
    for part in target.qualname.split("."):
        if not hasattr(found, part):  # a typo, most likely: the closest name there
            raise AttributeError(f"{target.module} has no attribute {target.qualname!r}{did_you_mean(part, dir(found))}")
        owner, found = found, getattr(found, part)
    original = inspect.getattr_static(owner, attr)
    if getattr(getattr(owner, attr), _MARK, None) is not None:
        return  # already guarded (the hook ran twice)
    function = getattr(owner, attr)
    rewrap = type(original) if isinstance(original, (staticmethod, classmethod)) else None
    inner = original.__func__ if rewrap is not None else original
    _calls.parameters(inner, target.argname)  # a missing one is said as "cannot guard ...: ..."

    label = str(target)
    numbers = itertools.count(1)
    said_unguardable: list[bool] = []

    def start(value: object, arguments: dict[str, object]) -> Optional[Guard]:
        number = next(numbers)
        if value is _calls.MISSING:  # left at its default: nothing of the caller's to protect
            return None
        if not guardable(value):  # said now, once, and at exit
            kind = _type_name(value)
            for stats in target_tallies(label):
                stats.unguardable[kind] = stats.unguardable.get(kind, 0) + 1
            if not said_unguardable:
                said_unguardable.append(True)
                say(unguardable_line(target, kind, arguments))
            return None
        if not calls.selects(number):  # KVGUARD_CALLS: counted in the summary
            for stats in target_tallies(label):
                stats.unguarded_calls += 1
            return None
        if not _calls.sampled(number, label):  # KVGUARD_SAMPLE: counted in the summary too
            return None
        return Guard(value, name=target.argname, action=action, keys=keys, ignore=ignore,
                     allow=allow + getattr(target, "intended", ()), target=label, level=level)

    def finish(g: Guard) -> None:
        PROCESS.target_stats(label).keys_seen.update(g.keys_seen)

    wrapper = _calls.wrap(inner, target.argname, start, f"target {label}", finish)
    setattr(wrapper, _MARK, str(target))
    setattr(owner, attr, rewrap(wrapper) if rewrap is not None else wrapper)
    rebound = _rebind_aliases(function, getattr(owner, attr), skip=owner)
    STATE.patched.append(str(target))
    STATE.undo.append(lambda: _restore(owner, attr, original, rebound))
    target_tallies(label)  # listed in the summaries, called or not




def unguardable_line(target: Target, kind: str, arguments: dict[str, object]) -> str:
    """The line said at a target's first call whose argument holds nothing kvguard walks.

    Names the parameters of that call that did hold tensors: the argument the target
    should have named, most likely.
    """
    holding = [name for name, value in arguments.items() if name != target.argname and _holds_tensor(value)]
    if holding:
        hint = f"did you mean {' or '.join(holding[:3])}? (the first call's {_plural_of(holding)} tensors)"
    else:
        hint = "no parameter of the first call held a tensor"
    first_hints[str(target)] = hint
    return (f"kvguard: target {target}: {target.argname} holds {kind}, whose contents kvguard does not walk "
            f"(it walks {WALKED}), so its calls run unguarded; {hint}")


def _plural_of(names: list[str]) -> str:
    return "parameter that holds" if len(names) == 1 else "parameters that hold"


def _holds_tensor(value: object) -> bool:
    """Whether a guard of `value` would protect a tensor (walks it once; never raises)."""
    if not guardable(value):
        return False
    try:
        import torch

        leaves, _ = _tree.walk(value, "x", torch.Tensor)
        return bool(leaves)
    except Exception:  # noqa: BLE001 - a container whose walk fails: not a suggestion
        return False


def _type_name(value: object) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _rebind_aliases(function: object, wrapper: object, skip: object) -> list[tuple[types.ModuleType, str]]:
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


def _restore(owner: object, attr: str, original: object, rebound: list[tuple[types.ModuleType, str]]) -> None:
    setattr(owner, attr, original)
    unwrapped = getattr(owner, attr)
    for module, name in rebound:
        setattr(module, name, unwrapped)


"""`KVGUARD_TARGETS=weights`: a process's model weights protected outside the writes meant for them.

Two ways in, wrapped once torch loads:

- `torch.optim.Optimizer.__init__`: each optimizer adds the modules that hold its
  parameters, named as the caller's variables name them (`model`, `self.actor`), and has
  its `step` wrapped; so does each group `add_param_group` adds to it later;
- `torch.nn.Module.load_state_dict`: a module that no optimizer owns (an inference-side
  model, a rollout engine's copy) is protected from its first load on, so that a write to
  its weights between loads is reported. Weight-sync functions that write them on purpose
  are named in `KVGUARD_ALLOW` (`module:qualname`);
- the rollout engine's side (`weights_loads`, `weights_receives`): `load_weights(weights)`
  of every module (vLLM's and sglang's models), the frameworks' load points, and what a
  process with no optimizer receives for its weights.

The first of them enters one weights guard for the process (on that thread); it is left
at exit, before the summary. A failure to watch is never silent: it is said on the
process's own stderr (a test runner's capture does not hide it) and in the exit line.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from typing import TYPE_CHECKING, Any, Optional

from kvguard._activate import process_kind
from kvguard._activate.weights_guard import _attributes, _candidates, _guard, _is_module, _name_of, _watched
from kvguard._kinds import WEIGHTS, Kind
from kvguard._state import STATE
from kvguard._text import plural, say

if TYPE_CHECKING:
    from kvguard._config import Settings

_unwatched: list[str] = []  # what could not be watched, for the exit line: `SGD made at train.py:5`
_stderr_fd: Optional[int] = None  # the process's stderr as it was at start-up (before any capture)


def install(kind: Kind, settings: Settings) -> None:
    """Wrap `torch.optim.Optimizer.__init__` when torch is imported (now, if it is already)."""
    import wrapt

    global _stderr_fd
    if _stderr_fd is None:
        try:
            _stderr_fd = os.dup(2)
        except OSError:
            pass

    def patch(torch: Any) -> None:
        optimizer_class = torch.optim.Optimizer
        original = optimizer_class.__init__
        if getattr(original, "_kvguard_weights", False):
            return

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            try:
                _register(self, settings, sys._getframe(1))
            except Exception as exc:  # noqa: BLE001 - a debug switch must not kill the job
                _cannot_watch(self, exc)

        __init__._kvguard_weights = True  # type: ignore[attr-defined]
        optimizer_class.__init__ = __init__
        STATE.undo.append(lambda: setattr(optimizer_class, "__init__", original))
        _patch_groups(optimizer_class, settings)
        _patch_loads(torch.nn.Module, settings)
        from kvguard._activate import weights_loads, weights_receives

        weights_loads.install(settings, torch)  # the rollout engine's side: loads, and what they receive
        weights_receives.install(settings, torch)
    wrapt.register_post_import_hook(patch, "torch")
    from kvguard._activate.process_guards import end_at_the_users_line

    end_at_the_users_line()


def _patch_loads(module_class: Any, settings: Settings) -> None:
    """Protect a module from its first `load_state_dict` on (the outermost call, once it is over),
    through the one patch of `load_state_dict` every guard listens to (`kvguard._torch.patches`)."""
    from kvguard._torch import patches as _patches

    def loaded(module: Any) -> None:
        try:  # the caller's frame: ours, then the patch's wrapper, then the code that loaded
            _guard(settings).add_modules([(_name_of(module, sys._getframe(2)), module)])
        except Exception as exc:  # noqa: BLE001 - a debug switch must not kill the job
            _cannot_watch(module, exc)
    STATE.undo.append(_patches.on_load_state_dict(loaded))


def _register(optimizer: Any, settings: Any, frame: Any) -> None:
    modules, loose = _holders(optimizer, frame)
    _guard(settings).add_optimizer(optimizer, modules, loose)
    _watched.add(optimizer)


def _patch_groups(optimizer_class: Any, settings: Any) -> None:
    """A parameter group added to a watched optimizer later (`add_param_group`: a head unfrozen, a
    LoRA adapter) is watched from then on, its modules found and named as at the optimizer's making."""
    original = optimizer_class.add_param_group

    @functools.wraps(original)
    def add_param_group(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = len(self.param_groups) if self in _watched else None  # not yet while `__init__` runs
        result = original(self, *args, **kwargs)
        if before is not None:
            try:
                modules, loose = _holders(self, sys._getframe(1), list(range(before, len(self.param_groups))))
                _guard(settings).add_params(self, modules, loose)
            except Exception as exc:  # noqa: BLE001 - a debug switch must not kill the job
                _cannot_watch(self, exc)
        return result

    optimizer_class.add_param_group = add_param_group
    STATE.undo.append(lambda: setattr(optimizer_class, "add_param_group", original))


def _cannot_watch(obj: Any, exc: BaseException) -> None:
    """An optimizer or a loaded module kvguard failed to watch: said now where no capture hides
    it (the process's own stderr, as at start-up), and again in the exit line."""
    from kvguard._protect.frames import user_site

    try:
        where = f" made at {user_site().short}"
    except Exception:  # noqa: BLE001
        where = ""
    what = f"{type(obj).__name__}{where}"
    _unwatched.append(what)
    loud(f"kvguard: KVGUARD_TARGETS=weights cannot watch {what} ({type(exc).__name__}: {exc}); "
         "its weights are not protected")


def loud(line: str) -> None:
    """Say `line` on stderr, and on the process's own stderr too when something captures it now
    (pytest's capture replaces `sys.stderr` and fd 2), so that it cannot disappear."""
    say(line)
    fd = _stderr_fd
    if fd is None or not _captured(fd):
        return
    try:
        os.write(fd, (line.rstrip("\n") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _captured(fd: int) -> bool:
    """Whether `sys.stderr` writes somewhere other than `fd` (the stderr the process started with)."""
    try:
        now = os.fstat(sys.stderr.fileno())
        then = os.fstat(fd)
    except Exception:  # noqa: BLE001 - no file descriptor at all: an in-memory capture
        return True
    return (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino)


def exit_lines(kind: Kind, tag: str, watched: bool) -> list[str]:
    """The exit lines about what could not be watched, or that nothing was (`watched`: whether the
    weights guard counted anything)."""
    lines = []
    if _unwatched:
        shown = ", ".join(_unwatched[:4]) + (f" … (+{len(_unwatched) - 4})" if len(_unwatched) > 4 else "")
        lines.append(f"{tag}: weights: {plural(len(_unwatched), 'optimizer or module', 'optimizers or modules')} "
                     f"could not be watched, so their weights were not protected: {shown}")
    elif not watched:
        lines.append(f"{tag}: weights: no optimizer was made and no module loaded a state dict here, so no "
                     "weight was watched")
    from kvguard._activate import weights_loads

    return lines + weights_loads.exit_lines(tag)


def _holders(optimizer: Any, frame: Any, groups: Optional[list[int]] = None
             ) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The modules in the caller's frames that hold the optimizer's parameters (of `groups`, by
    index; default all) (the largest first), named as the code names them; and the parameters
    none holds, named by their group."""
    chosen_groups = range(len(optimizer.param_groups)) if groups is None else groups
    params = [p for g in chosen_groups for p in optimizer.param_groups[g]["params"]]
    wanted = {id(p) for p in params}
    candidates = _candidates(frame)
    sized = sorted(((sum(1 for _ in m.parameters()), n, m) for n, m in candidates), key=lambda c: -c[0])
    chosen: list[tuple[str, Any]] = []
    covered: set[int] = set()
    for _, name, module in sized:
        ids = {id(p) for p in module.parameters()} & wanted
        if ids - covered:
            chosen.append((name, module))
            covered |= ids
    loose = [(f"{type(optimizer).__name__}.param_groups[{g}]['params'][{i}]", p)
             for g in chosen_groups for i, p in enumerate(optimizer.param_groups[g]["params"])
             if id(p) not in covered]
    return chosen, loose


stop = process_kind.stop  # the weights guard is left as every kind's is

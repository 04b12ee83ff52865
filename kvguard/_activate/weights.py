"""`KVGUARD_TARGETS=weights`: a process's model weights protected outside the writes meant for them.

Two ways in, wrapped once torch loads:

- `torch.optim.Optimizer.__init__`: each optimizer adds the modules that hold its
  parameters, named as the caller's variables name them (`model`, `self.actor`), and has
  its `step` wrapped;
- `torch.nn.Module.load_state_dict`: a module that no optimizer owns (an inference-side
  model, a rollout engine's copy) is protected from its first load on, so that a write to
  its weights between loads is reported. Weight-sync functions that write them on purpose
  are named in `KVGUARD_ALLOW` (`module:qualname`).

The first of them enters one weights guard for the process (on that thread); it is left
at exit, before the summary.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

from kvguard._state import STATE
from kvguard._text import say

_FRAMES = 12  # caller frames searched for the modules that hold an optimizer's parameters


def install(settings: Any) -> None:
    """Wrap `torch.optim.Optimizer.__init__` when torch is imported (now, if it is already)."""
    import wrapt

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
                say(f"kvguard: KVGUARD_TARGETS=weights cannot watch {type(self).__name__}: {exc}")

        __init__._kvguard_weights = True  # type: ignore[attr-defined]
        optimizer_class.__init__ = __init__
        STATE.undo.append(lambda: setattr(optimizer_class, "__init__", original))
        _patch_loads(torch.nn.Module, settings)
    wrapt.register_post_import_hook(patch, "torch")
    from kvguard._activate.process_guards import end_at_the_users_line

    end_at_the_users_line()


def _patch_loads(module_class: Any, settings: Any) -> None:
    """Protect a module from its first `load_state_dict` on (the outermost call, once it returns)."""
    original = module_class.load_state_dict
    depth = threading.local()

    @functools.wraps(original)
    def load_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth.n = getattr(depth, "n", 0) + 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            depth.n -= 1
        if depth.n == 0:
            try:
                _guard(settings).add_modules([(_name_of(self, sys._getframe(1)), self)])
            except Exception as exc:  # noqa: BLE001 - a debug switch must not kill the job
                say(f"kvguard: KVGUARD_TARGETS=weights cannot watch {type(self).__name__}: {exc}")
        return result

    module_class.load_state_dict = load_state_dict
    STATE.undo.append(lambda: setattr(module_class, "load_state_dict", original))


def _guard(settings: Any) -> Any:
    """The process's weights guard, entered on first use."""
    from kvguard._guard.module import ModuleGuard
    from kvguard._report.tally import WEIGHTS_LABEL

    guard = STATE.weights
    if guard is None:
        guard = ModuleGuard([], (), name=WEIGHTS_LABEL, action=settings.action, allow=settings.allow or None,
                            target=WEIGHTS_LABEL)
        guard._account.label = WEIGHTS_LABEL
        STATE.weights = guard.__enter__()
    return guard


def _register(optimizer: Any, settings: Any, frame: Any) -> None:
    modules, loose = _holders(optimizer, frame)
    _guard(settings).add_optimizer(optimizer, modules, loose)


def _candidates(frame: Any) -> list[tuple[str, Any]]:
    """(name, module) of the modules in the user's frames from `frame` up, as the code names them."""
    import torch

    from kvguard._protect.frames import frame_namespace, user_frames

    found: list[tuple[str, Any]] = []
    for _, user in zip(range(_FRAMES), user_frames(frame)):
        for name, value in frame_namespace(user).items():
            if isinstance(value, torch.nn.Module):
                found.append((name, value))
            elif name == "self" and not isinstance(value, torch.optim.Optimizer):
                found += [(f"self.{k}", v) for k, v in vars(value).items() if isinstance(v, torch.nn.Module)]
    return found


def _name_of(module: Any, frame: Any) -> str:
    """How the caller's code names `module` (`model`, `self.rollout_model`); else its class."""
    return next((name for name, value in _candidates(frame) if value is module and name != "self"),
                type(module).__name__)


def _holders(optimizer: Any, frame: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The modules in the caller's frames that hold the optimizer's parameters (the largest first),
    named as the code names them; and the parameters none holds, named by their group."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
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
             for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])
             if id(p) not in covered]
    return chosen, loose


def stop() -> None:
    """Leave the process's weights guard (at exit): its counts go into the summary."""
    from kvguard._activate.process_guards import leave

    guard, STATE.weights = STATE.weights, None
    leave(guard, "weights guard")

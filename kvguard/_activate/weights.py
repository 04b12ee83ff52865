"""`KVGUARD_TARGETS=weights`: every optimizer's weights protected outside its `step()`, no code change.

`torch.optim.Optimizer.__init__` is wrapped once torch loads. The first optimizer made
enters one weights guard for the process (on that thread); each optimizer then adds the
modules that hold its parameters, named as the caller's variables name them (`model`,
`self.actor`), and has its `step` wrapped. The guard is left at exit, before the summary.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from kvguard._errors import MutationError
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
    wrapt.register_post_import_hook(patch, "torch")
    from kvguard._activate.tracebacks import end_at_the_users_line

    end_at_the_users_line()


def _register(optimizer: Any, settings: Any, frame: Any) -> None:
    from kvguard._guard.module import ModuleGuard
    from kvguard._report.tally import WEIGHTS_LABEL

    guard = STATE.weights
    if guard is None:
        guard = ModuleGuard([], (), name=WEIGHTS_LABEL, action=settings.action, allow=settings.allow or None,
                            target=WEIGHTS_LABEL)
        guard._account.label = WEIGHTS_LABEL
        STATE.weights = guard.__enter__()
    modules, loose = _holders(optimizer, frame)
    guard.add_optimizer(optimizer, modules, loose)


def _holders(optimizer: Any, frame: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The modules in the caller's frames that hold the optimizer's parameters (the largest first),
    named as the code names them; and the parameters none holds, named by their group."""
    import torch

    from kvguard._protect.frames import frame_namespace, user_frames

    params = [p for group in optimizer.param_groups for p in group["params"]]
    wanted = {id(p) for p in params}
    candidates: list[tuple[str, Any]] = []
    for _, user in zip(range(_FRAMES), user_frames(frame)):
        for name, value in frame_namespace(user).items():
            if isinstance(value, torch.nn.Module):
                candidates.append((name, value))
            elif name == "self" and not isinstance(value, torch.optim.Optimizer):
                candidates += [(f"self.{k}", v) for k, v in vars(value).items() if isinstance(v, torch.nn.Module)]
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
    guard, STATE.weights = STATE.weights, None
    if guard is None:
        return
    try:
        guard.__exit__(None, None, None)
    except MutationError as exc:  # at exit, a finding is a line, not a traceback
        say(f"kvguard: {exc.args[0].splitlines()[0]}")
    except Exception as exc:  # noqa: BLE001
        say(f"kvguard: weights guard: {exc}")

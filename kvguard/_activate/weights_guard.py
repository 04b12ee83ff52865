"""The process's weights guard (`KVGUARD_TARGETS=weights`), and how the caller's code names a module.

Shared by the word's ways in: the optimizers and `load_state_dict` (`weights`), the loads
of the rollout engine's side (`weights_loads`) and what it receives (`weights_receives`).
The first of them enters the guard; `counts` keeps what the rollout side's exit line says.
"""

from __future__ import annotations

import weakref
from typing import Any

from kvguard._activate import process_kind
from kvguard._kinds import WEIGHTS
from kvguard._state import STATE

_FRAMES = 12  # caller frames searched for the modules that hold an optimizer's parameters
_watched: weakref.WeakSet[Any] = weakref.WeakSet()  # the optimizers the weights guard holds
# What the rollout side's exit line says: loads by how they were made ("load_weights", a load
# point's name), tensors handed to them ("handed"), receive buffers watched ("buffers").
counts: dict[str, int] = {}


def _guard(settings: Any) -> Any:
    """The process's weights guard, entered on first use."""
    from kvguard._guard.module import ModuleGuard

    guard = STATE.kinds.get(WEIGHTS.word)
    if guard is None:
        guard = ModuleGuard([], (), name=WEIGHTS.word, action=settings.action, allow=settings.allow or None,
                            target=WEIGHTS.word)
        STATE.kinds[WEIGHTS.word] = guard.__enter__()
        process_kind.follow_sample(guard)
    return guard


def _candidates(frame: Any) -> list[tuple[str, Any]]:
    """(name, module) of the modules in the user's frames from `frame` up, as the code names them.

    A frame that cannot be read is passed over, never the end of the search: pytest's
    frames (pluggy's `HookCaller`) and any `__slots__` class have a `self` without `__dict__`.
    """
    import torch

    from kvguard._protect.frames import frame_namespace, user_frames

    found: list[tuple[str, Any]] = []
    for _, user in zip(range(_FRAMES), user_frames(frame)):
        try:
            namespace = frame_namespace(user)
        except Exception:  # noqa: BLE001 - a frame we cannot read names nothing
            continue
        for name, value in namespace.items():
            try:  # `isinstance` reads `__class__` through the object's own `__getattribute__`
                if isinstance(value, torch.nn.Module):
                    found.append((name, value))
                elif name == "self" and not isinstance(value, torch.optim.Optimizer):
                    found += [(f"self.{k}", v) for k, v in _attributes(value) if _is_module(v)]
            except Exception:  # noqa: BLE001 - an object that refuses to be looked at holds nothing we name
                continue
    return found


def _is_module(value: Any) -> bool:
    import torch

    try:
        return isinstance(value, torch.nn.Module)
    except Exception:  # noqa: BLE001
        return False


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    """`obj`'s own attributes: its `__dict__` and its `__slots__`; what cannot be read is left out."""
    found: list[tuple[str, Any]] = []
    try:
        own = object.__getattribute__(obj, "__dict__")
        found += list(own.items()) if isinstance(own, dict) else []
    except Exception:  # noqa: BLE001 - no `__dict__` (slots only), or one that refuses to be read
        pass
    try:
        mro = type(obj).__mro__
    except Exception:  # noqa: BLE001
        return found
    for cls in mro:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot in ("__dict__", "__weakref__"):
                continue
            try:
                found.append((slot, getattr(obj, slot)))
            except Exception:  # noqa: BLE001 - an empty slot, or a name-mangled one
                continue
    return found


def _name_of(module: Any, frame: Any) -> str:
    """How the caller's code names `module` (`model`, `self.rollout_model`); else its class."""
    return next((name for name, value in _candidates(frame) if value is module and name != "self"),
                type(module).__name__)


def buffers_now() -> int:
    """The receive buffers the weights set has watched so far (for the exit line)."""
    from kvguard._guard.module import ModuleGuard

    guard = STATE.kinds.get(WEIGHTS.word)
    return guard.buffer_count if isinstance(guard, ModuleGuard) else 0

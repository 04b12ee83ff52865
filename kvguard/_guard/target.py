"""What a guard can protect, and what reports call it: the object's kind, the caller's name for it."""

from __future__ import annotations

import sys
from typing import Any

from kvguard._protect import frames as _frames
from kvguard._protect import tree as _tree


def guardable(obj: Any) -> bool:
    """Whether `obj` is something a guard protects: a tensor, or a container kvguard walks.

    Containers: dicts and every Mapping, lists, tuples, namedtuples, dataclass instances,
    `types.SimpleNamespace` and `torch.utils._pytree` nodes (see `kvguard._protect.tree`).
    """
    if isinstance(obj, (dict, list, tuple)) or _tree.walkable(obj):
        return True
    torch = sys.modules.get("torch")  # no torch imported: obj cannot be a tensor
    return torch is not None and isinstance(obj, torch.Tensor)


def check_target(obj: Any) -> None:
    if not guardable(obj):
        kind = obj if isinstance(obj, type) else type(obj)
        spelled = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        if isinstance(obj, type):
            spelled = f"the class {spelled} itself, not an instance"
        elif _is_module(obj):
            spelled += "; for a model's parameters and buffers use kvguard.guard_module(model)"
        elif _tree._instance_dict(obj) is not None:
            spelled += ", whose attributes kvguard does not walk"
        raise TypeError(
            f"kvguard.guard() protects tensors held in dicts (and any Mapping), lists, tuples, namedtuples, "
            f"dataclass instances, SimpleNamespaces or torch pytree nodes (nested at any depth), or a tensor; "
            f"got {spelled}"
        )


def _is_module(obj: Any) -> bool:
    """Whether `obj` is a `torch.nn.Module`: its weights have their own guard, `guard_module`."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


_NAMING_CALLS = ("guard", "Guard", "protect", "guard_module")
_MAX_NAME_CHARS = 80


def caller_name(obj: Any) -> str:
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

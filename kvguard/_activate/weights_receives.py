"""`KVGUARD_TARGETS=weights` on the rollout engine's side: what a process receives for its weights.

Wrapped once torch is imported, in a process that has made no optimizer (a rollout engine's
worker, an inference server: a trainer's collectives are its own business):

- the receiving collectives of `torch.distributed`: `broadcast` on a rank other than its
  source, `recv`, `irecv`, `all_gather`, `all_gather_into_tensor`, `all_gather_single`,
  `scatter`, `all_to_all_single`, `all_to_all` (called from the user's code, not from inside
  torch);
- `torch.multiprocessing.reductions.rebuild_cuda_tensor`, which a CUDA IPC handle
  (`reduce_tensor(t)`, pickled and sent) rebuilds a tensor with.

What each fills is a receive buffer from then on (`kvguard._protect.weights_received`): a
write to it is a refill, and the views of it still held then are reported there. The
weights guard starts at the first receive if no load started it before.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import TYPE_CHECKING, Any, Callable, Optional

from kvguard._state import STATE

if TYPE_CHECKING:
    import torch

    from kvguard._config import Settings

_MARK = "__kvguard_receive__"
# name -> (argument index, keyword) of what it receives into; a list of tensors for the all_* forms
_RECEIVERS: dict[str, tuple[int, str]] = {
    "broadcast": (0, "tensor"), "recv": (0, "tensor"), "irecv": (0, "tensor"), "all_gather": (0, "tensor_list"),
    "all_gather_into_tensor": (0, "output_tensor"), "all_gather_single": (0, "output_tensor"),
    "scatter": (0, "tensor"), "all_to_all_single": (0, "output"),
    "all_to_all": (0, "output_tensor_list"),
}


def install(settings: Settings, torch: Any) -> None:
    """Wrap the receiving collectives and the CUDA IPC rebuild (torch is imported)."""
    dist: Optional[types.ModuleType] = None
    c10d: Optional[types.ModuleType] = None
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except Exception:  # noqa: BLE001 - a torch built without distributed: nothing to receive with
        pass
    if dist is not None and c10d is not None and dist.is_available():
        for name in _RECEIVERS:
            original = getattr(c10d, name, None)
            if original is None or getattr(original, _MARK, False):
                continue
            wrapper = _collective(original, name, settings)
            for owner in (dist, c10d):
                if getattr(owner, name, None) is original:
                    _replace(owner, name, original, wrapper)
    from torch.multiprocessing import reductions

    rebuild = getattr(reductions, "rebuild_cuda_tensor", None)
    if rebuild is not None and not getattr(rebuild, _MARK, False):
        _replace(reductions, "rebuild_cuda_tensor", rebuild, _ipc(rebuild, settings))


def _replace(owner: types.ModuleType, name: str, original: object, wrapper: object) -> None:
    setattr(owner, name, wrapper)

    def restore() -> None:
        if getattr(owner, name, None) is wrapper:
            setattr(owner, name, original)
    STATE.undo.append(restore)


def _collective(original: Callable[..., Any], name: str, settings: Settings) -> Callable[..., Any]:
    index, keyword = _RECEIVERS[name]

    @functools.wraps(original)
    def receive(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            caller = sys._getframe(1)
            if _tracking() and not _inside_torch(caller):
                into = args[index] if len(args) > index else kwargs.get(keyword)
                tensors = list(into) if isinstance(into, (list, tuple)) else [into]
                if _receives(name, args, kwargs):
                    _received(tensors, f"dist.{name}", caller, settings)
        except Exception:  # noqa: BLE001 - kvguard's bookkeeping never fails the user's receive
            pass
        return result
    setattr(receive, _MARK, True)
    return receive


def _receives(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this rank receives in this call: a broadcast's source only sends."""
    if name != "broadcast":
        return True
    import torch.distributed as dist

    group = args[2] if len(args) > 2 else kwargs.get("group")
    group_src = kwargs.get("group_src")
    if group_src is not None:
        return bool(dist.get_rank(group) != group_src)
    src = args[1] if len(args) > 1 else kwargs.get("src")
    return src is None or dist.get_rank() != src


def _ipc(original: Callable[..., torch.Tensor], settings: Settings) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def rebuild_cuda_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = original(*args, **kwargs)
        try:
            caller = sys._getframe(1)
            if _tracking():
                _received([tensor], "a CUDA IPC rebuild", caller, settings)
        except Exception:  # noqa: BLE001
            pass
        return tensor
    setattr(rebuild_cuda_tensor, _MARK, True)
    return rebuild_cuda_tensor


def _tracking() -> bool:
    """Receives are followed in a process that has made no optimizer (the rollout side)."""
    from kvguard._activate.weights_guard import _watched

    return not len(_watched)


def _inside_torch(frame: Optional[types.FrameType]) -> bool:
    """Whether torch itself called (`broadcast_object_list`'s byte tensors, DDP's internals)."""
    from kvguard._protect.frames import user_frames

    return frame is None or next(user_frames(frame), None) is not frame


def _received(tensors: list[Any], how: str, caller: Optional[types.FrameType], settings: Settings) -> None:
    import torch

    from kvguard._activate.weights_guard import _guard, buffers_now, counts
    from kvguard._protect import weights_loads as _loads
    from kvguard._protect.frames import site_of

    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors:
        return
    _guard(settings)  # the weights guard starts at the first receive, if nothing started it before
    _loads.received(tensors, how, site_of(caller))
    counts["buffers"] = buffers_now()

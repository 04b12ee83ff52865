"""What one of autograd's packs keeps under `guard_autograd`, and backward's read of it checked.

`Saved` is what a pack hands autograd in place of the tensor (the Python pack's here; the
compiled extension's C pack makes `write_hook.Saved`, with the same attributes); the
protected set holds it through `TensorOf`, a weak reference, so autograd alone decides how
long it lives. `State` counts forward stretches and backward passes (`SavedSet.graphs`).
Installing hooks switches PyTorch's own version check off, so the unpack redoes it:
`version_error` says what PyTorch would have said, then what kvguard saw.
"""

from __future__ import annotations

import collections
import os
import weakref
from typing import TYPE_CHECKING, Optional

from kvguard._report.events import SAVED_PREFIX
from kvguard._torch import autograd as _autograd

if TYPE_CHECKING:
    import torch

TORCH_CHECK = ("one of the variables needed for gradient computation has been modified by an inplace "
               "operation")
TORCH_HINT = ("Hint: the backtrace further above shows the operation that failed to compute its gradient. "
              "The variable in question was changed in there or anywhere later. Good luck!")
UNNAMED = SAVED_PREFIX + "…>"  # a saved tensor's path until a report names the saving node


class Burst:
    """Tensors saved outside backward with no backward in between: one forward stretch."""

    __slots__ = ("read",)

    def __init__(self) -> None:
        self.read = False  # a backward pass read one of them (that pass counts the graph)


class Saved:
    """What one pack kept: the tensor autograd reads back, its version then, where it was saved.

    Under composed hooks (`saved_composed.Composed`) it keeps no tensor (`tensor` is None):
    theirs keep it."""

    __slots__ = ("tensor", "version", "site", "saver", "writes", "read_by", "burst", "task", "__weakref__")

    def __init__(self, tensor: Optional[torch.Tensor], site: Optional[tuple[str, int]]) -> None:
        # Shares memory and version counter; no grad_fn: no cycle.
        self.tensor = tensor.detach() if tensor is not None else None
        self.version = tensor._version if tensor is not None else 0
        self.site = site  # (co_filename, line), shown as `file.py:LINE` (`site_text`)
        self.saver: Optional[str] = None  # "SigmoidBackward0: result", once a report needed it
        self.writes: list[str] = []  # the writes kvguard reported on it, for backward's error
        self.read_by: Optional[int] = None  # the backward node that last unpacked it (`_autograd.node_serial`)
        self.burst: Optional[Burst] = None  # the forward stretch that saved it (`SavedSet.graphs`)
        self.task: Optional[int] = None  # the backward pass that first read it


class State:
    """What a set counts of its forward stretches and backward passes (`SavedSet.graphs`): kept by
    the C hooks (`kvguard._native.write_hook.SavedHooks`, the same attributes) where they pack."""

    __slots__ = ("backward_since_pack", "burst", "bursts", "bursts_read", "tasks", "_recent")

    def __init__(self) -> None:
        self.backward_since_pack = True
        self.burst: Optional[Burst] = None  # the forward stretch saving now (`graphs`)
        self.bursts = self.bursts_read = self.tasks = 0
        self._recent: collections.deque[int] = collections.deque(maxlen=64)

    def count_task(self, task: int) -> bool:
        """Count backward pass `task` unless it is one of the last 64 counted."""
        if task in self._recent:
            return False
        self._recent.append(task)
        self.tasks += 1
        return True


class TensorOf(weakref.ref):  # type: ignore[type-arg]
    """An entry's reference: weak to the `Saved` (its death is the entry's), calling gives the tensor.

    `key`: the entry's key in the set, once it has one (its death drops just that entry)."""

    __slots__ = ("key",)
    key: int

    def __call__(self) -> Optional[torch.Tensor]:
        saved = super().__call__()
        return saved.tensor if saved is not None else None

    def saved(self) -> Optional[Saved]:
        return super().__call__()


def saved_path(saved: Saved) -> str:
    """How a report names a saved tensor: `<saved by SigmoidBackward0: result>`."""
    return f"{SAVED_PREFIX}{saved.saver}>" if saved.saver else f"{SAVED_PREFIX}a node not found>"


def site_text(site: tuple[str, int]) -> str:
    """`file.py:LINE`, as reports show where a tensor was saved (the same few lines, over and over)."""
    text = _SITE_TEXT.get(site)
    if text is None:
        if len(_SITE_TEXT) > 4096:
            _SITE_TEXT.clear()
        text = _SITE_TEXT[site] = f"{os.path.basename(site[0])}:{site[1]}"
    return text


_SITE_TEXT: dict[tuple[str, int], str] = {}


def version_error(saved: Saved) -> str:
    """PyTorch's words for a saved tensor written since it was saved, then what kvguard saw."""
    tensor = saved.tensor
    assert tensor is not None
    node = _autograd.current_autograd_node()
    name = type(node).__name__ if node is not None else "its node"
    head = (f"{TORCH_CHECK}: [{_type_text(tensor)} {_shape_text(tensor)}], which {name} saved, is at version "
            f"{tensor._version}; expected version {saved.version} instead. {TORCH_HINT}")
    where = f" at {site_text(saved.site)}" if saved.site else ""
    if saved.writes:
        said = "; ".join(dict.fromkeys(saved.writes))
        return f"{head}\n\nkvguard: the tensor {name} saved{where} was written by {said}"
    return (f"{head}\n\nkvguard: the tensor {name} saved{where} was written where kvguard did not watch: "
            "after guard_autograd ended, on another thread, or by code no dispatched op shows")


def _shape_text(tensor: torch.Tensor) -> str:
    """`[4, 3]`; a nested tensor (which has no sizes) as its components' shapes."""
    try:
        return str(list(tensor.shape))
    except Exception:  # noqa: BLE001 - NestedTensorImpl refuses sizes()
        try:
            return "nested " + ", ".join(str(list(t.shape)) for t in tensor.unbind())
        except Exception:  # noqa: BLE001
            return "(shape unknown)"


def _type_text(tensor: torch.Tensor) -> str:
    try:
        return tensor.type()
    except Exception:  # noqa: BLE001
        return type(tensor).__name__

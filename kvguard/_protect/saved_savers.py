"""Which node saved a tensor, found only when a report names it (`<saved by SigmoidBackward0: result>`).

Looking it up at each pack would cost every forward; instead a write that hits saved
tensors walks the graph from recently saved tensors and the caller's variables, reading
each node's saved slots without unpacking them, until every saved tensor it hit is named.
"""

from __future__ import annotations

import types
from typing import Callable, Hashable, Optional

import torch

from kvguard._protect import frames as _frames
from kvguard._protect.entries import Entry
from kvguard._protect.saved_composed import Kept, Lent
from kvguard._protect.saved_packs import Saved, TensorOf, saved_path
from kvguard._torch import autograd as _autograd

MAX_WALK = 200_000  # nodes a search for savers visits at most
ROOTS = 64  # recently saved tensors kept (weakly) as starting points of that search


def saved_of(entry: Entry) -> Optional[Saved]:
    """The `Saved` behind a saved tensor's entry (None: it died, or the entry is not one)."""
    ref = entry.ref
    return ref.saved() if isinstance(ref, (TensorOf, Lent)) else None


def find_savers(unnamed: dict[int, Saved], roots: list[torch.Tensor], saved_types: tuple[type, ...]) -> None:
    """Name the node and slot of each of `unnamed` (by id) found in the graphs behind `roots`.

    `saved_types`: what a pack leaves in a node's slot (the Python pack's `Saved`, the C pack's)."""
    stack = [n for t in roots if (n := _grad_fn(t)) is not None]
    kept: list[object] = []  # wrappers held while walked, so their ids stay theirs
    seen: set[int] = set()
    while stack and unnamed and len(kept) < MAX_WALK:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        kept.append(node)
        for slot, data in _autograd.saved_slots(node):
            if type(data) is Kept:  # saved under composed hooks
                data = data.saved
            if type(data) in saved_types and data.saver is None:
                data.saver = f"{type(node).__name__}: {slot}"
                unnamed.pop(id(data), None)
        stack += _autograd.next_nodes(node)


def named(hit: list[Entry], saver: Callable[[Entry], Optional[Saved]] = saved_of) -> list[Entry]:
    """`hit` with each entry's path its saver's, one entry per tensor saved more than once (the
    other savers as aliases)."""
    first: dict[Hashable, Entry] = {}
    kept = []
    for entry in sorted(hit, key=lambda e: (s := saver(e)) is None or s.saver is None):  # named first
        saved = saver(entry)
        if saved is not None:
            entry.path = saved_path(saved)
        key = _memory_key(entry)
        same = first.get(key)
        if same is None:
            first[key] = entry
            kept.append(entry)
            entry.aliases = ()
        elif entry.path != same.path and entry.path not in same.aliases:
            same.aliases += (entry.path,)
    return kept


def caller_tensors(frame: Optional[types.FrameType], depth: int = 12) -> list[torch.Tensor]:
    """Tensors with a graph in the user's frames (and one level into their containers)."""
    found = []
    for _, frame in zip(range(depth), _frames.user_frames(frame)):
        for value in _frames.frame_namespace(frame).values():
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (
                value,)
            for v in list(values)[:1000]:
                if isinstance(v, torch.Tensor) and v.grad_fn is not None:
                    found.append(v)
    return found


def _memory_key(entry: Entry) -> Hashable:
    """The same for two entries of one tensor's elements (a detached alias and the tensor itself)."""
    tensor = entry.ref()
    if tensor is None or tensor.layout != torch.strided:
        return entry.record.layout
    try:
        return (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
    except Exception:  # noqa: BLE001 - no storage (meta, a wrapper subclass)
        return entry.record.layout


def _grad_fn(tensor: torch.Tensor) -> Optional[torch.autograd.graph.Node]:
    try:
        return tensor.grad_fn
    except Exception:  # noqa: BLE001
        return None

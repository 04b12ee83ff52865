"""What a dataset returned, as a protected set: each tensor from the moment it was returned.

A dataset that caches, pools or reuses tensors and writes them after handing them out
changes samples the caller already holds (Megatron-LM !4164: `GPTDataset` returned its
cached loss mask itself, and the next sample's `loss_mask[labels == pad] = 0.0` wrote into
every earlier one). `SampleSet.returned` queues a sample's tensors, held weakly, in a list
the write hook watches like a guarded container; the next write op (or boundary) protects
them in one batch. A tensor stays protected while it is alive, under the path of the
first sample that returned it (`GPTDataset[3]['loss_mask']`).
"""

from __future__ import annotations

import numbers
import weakref
from typing import Callable, Optional

import torch

from kvguard._protect import tree as _tree
from kvguard._protect.entries import Entry
from kvguard._protect.queued import QueuedSet
from kvguard._protect.records import Record


class _Returned(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a returned tensor, with its path and where it was returned from."""

    __slots__ = ("path", "placed")

    def __new__(cls, tensor: torch.Tensor, callback: Callable[[_Returned], None], path: str,
                placed: Optional[str]) -> _Returned:
        return super().__new__(cls, tensor, callback)

    def __init__(self, tensor: torch.Tensor, callback: Callable[[_Returned], None], path: str,
                 placed: Optional[str]) -> None:
        super().__init__(tensor, callback)  # type: ignore[call-arg]  # weakref.ref takes them (typeshed says not)
        self.path = path
        self.placed = placed


class SampleSet(QueuedSet[_Returned]):
    """The tensors datasets returned while the guard was active, protected while they live."""

    def __init__(self, name: str) -> None:
        # the tensors waiting in `_pending` (returned, not protected yet), by id: a dead one's id
        # may be a new tensor's already, so a match counts only when the reference is to it
        self._queued: dict[int, _Returned] = {}
        self.samples = 0  # samples returned (a batch from `__getitems__` counts each)
        super().__init__(name)

    def returned(self, path: str, sample: object, placed: Optional[str]) -> None:
        """`sample` was just returned as `path` (`GPTDataset[3]`): protect its tensors from now on."""
        self.samples += 1
        leaves, _ = _tree.walk(sample, path, torch.Tensor)
        for leaf in _tree.leaves_of(leaves):
            tensor = leaf.tensor
            key = id(tensor)
            queued = self._queued.get(key)
            if (queued is not None and queued() is tensor) or self.entry_of(tensor) is not None:
                continue  # returned before (a cache, or an outer dataset passing an inner one's sample on)
            ref = self._queued[key] = _Returned(tensor, self._on_death, leaf.path, placed)
            self._pending.append(ref)
            self.protected_count += 1  # protected from now: a write looks at what waits first

    def _entry(self, ref: _Returned, tensor: torch.Tensor, record: Record) -> Entry:
        return Entry(ref.path, record, ref, ref.placed)

    def _flush(self) -> None:
        self._queued.clear()
        super()._flush()

    def settle(self) -> None:
        """A sample's path is fixed when it is returned: nothing moves it."""


def sample_path(dataset: object, index: object) -> str:
    """`GPTDataset[3]`: the dataset's class and the index as the caller gave it."""
    if isinstance(index, numbers.Integral):
        index = int(index)
    text = repr(index) if not isinstance(index, (list, tuple)) or len(repr(index)) <= 40 else "[…]"
    return f"{type(dataset).__name__}[{text}]"

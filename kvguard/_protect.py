"""The protected set: which memory belongs to which guarded entry, since when.

Holds protected tensors only through weak references, so a guard never extends a
tensor's life. Containers of the guarded object are held (and compared by identity)
so that a tensor placed into them is protected from that moment on.
"""

from __future__ import annotations

import bisect
import sys
import weakref
from typing import Any, Callable, Collection, Optional

import torch

from kvguard import _frames, _torch, _tree


class Entry:
    """One protected tensor: its path, memory, placement and (lazily) its first value."""

    __slots__ = ("path", "ref", "spans", "placed_at", "fingerprint", "before", "__weakref__")

    def __init__(self, path: str, tensor: torch.Tensor, ref: weakref.ref, placed_at: Optional[str]) -> None:
        self.path = path
        self.ref = ref
        self.spans = _torch.spans(tensor)
        self.placed_at = placed_at
        self.fingerprint = _torch.storage_fingerprint(tensor)
        self.before: Optional[torch.Tensor] = None  # copied on the first write only

    def refresh(self, tensor: torch.Tensor) -> None:
        """Re-read the memory after the tensor was re-pointed (`set_`, `resize_`)."""
        self.spans = _torch.spans(tensor)
        self.fingerprint = _torch.storage_fingerprint(tensor)


class ProtectedSet:
    """Maps written memory to protected entries; learns about newly placed tensors."""

    def __init__(self, root: Any, name: str, keys: Optional[Collection[Any]], ignore: Collection[Any]) -> None:
        self._root, self._name, self._keys, self._ignore = root, name, keys, ignore
        self._entries: dict[int, Entry] = {}
        self._by_identity: dict[int, Entry] = {}  # tensors without readable memory (meta)
        self._index: dict[tuple[str, int], tuple[list[int], list[tuple[int, int, list[Entry]]]]] = {}
        self._watch: list[tuple[Any, tuple[int, ...]]] = []
        self._dirty = False
        self._scan(frames=None)

    # -- placement -------------------------------------------------------------------

    def refresh(self) -> None:
        """Protect tensors placed since the last call. Cheap when nothing moved."""
        if self._dirty or _tree.changed(self._watch):
            self._scan(frames=list(_frames.user_frames(sys._getframe(1))))

    def _scan(self, frames: Optional[list[Any]]) -> None:
        self._dirty = False
        for key in [k for k, e in self._entries.items() if e.ref() is None]:
            del self._entries[key]
        leaves, containers = _tree.walk(self._root, self._name, _is_tensor, self._keys, self._ignore)
        for leaf in leaves:
            known = self._entries.get(id(leaf.tensor))
            if known is not None and known.ref() is leaf.tensor:
                continue
            self._add(leaf, None if frames is None else _placed_at(frames, leaf.chain))
        self._watch = _tree.snapshot(containers)
        self._rebuild_index()

    def _add(self, leaf: _tree.Leaf, placed_at: Optional[str]) -> None:
        ref = weakref.ref(leaf.tensor, self._on_death)
        entry = Entry(leaf.path, leaf.tensor, ref, placed_at)
        self._entries[id(leaf.tensor)] = entry

    def _on_death(self, _: weakref.ref) -> None:
        # The memory may be reused by a new tensor; forget it before the next write.
        self._dirty = True

    # -- lookup ----------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        per_device: dict[tuple[str, int], list[tuple[int, int, Entry]]] = {}
        self._by_identity = {}
        for key, entry in self._entries.items():
            if not entry.spans:
                self._by_identity[key] = entry
            for span in entry.spans:
                per_device.setdefault(span.device, []).append((span.start, span.stop, entry))
        self._index = {}
        for device, items in per_device.items():
            items.sort(key=lambda item: item[0])
            groups: list[tuple[int, int, list[Entry]]] = []
            for start, stop, entry in items:  # merge into disjoint groups
                if groups and start < groups[-1][1]:
                    g_start, g_stop, members = groups[-1]
                    if entry not in members:
                        members.append(entry)
                    groups[-1] = (g_start, max(g_stop, stop), members)
                else:
                    groups.append((start, stop, [entry]))
            self._index[device] = ([g[0] for g in groups], groups)

    def hits(self, written: torch.Tensor) -> list[Entry]:
        """Protected entries whose elements share at least one byte with `written`'s."""
        if self._by_identity:
            entry = self._by_identity.get(id(written))
            if entry is not None and entry.ref() is written:
                return [entry]
        found: list[Entry] = []
        for span in _torch.spans(written):
            index = self._index.get(span.device)
            if index is None:
                continue
            starts, groups = index
            i = max(bisect.bisect_right(starts, span.start) - 1, 0)
            while i < len(groups) and groups[i][0] < span.stop:
                if groups[i][1] > span.start:
                    for entry in groups[i][2]:
                        if entry not in found and self._overlaps(span, written, entry):
                            found.append(entry)
                i += 1
        return found

    @staticmethod
    def _overlaps(span: _torch.Span, written: torch.Tensor, entry: Entry) -> bool:
        if not any(s.start < span.stop and span.start < s.stop for s in entry.spans):
            return False
        if span.dense and all(s.dense for s in entry.spans):
            return True
        tensor = entry.ref()
        if tensor is None or tensor.layout != torch.strided or written.layout != torch.strided:
            return tensor is not None
        return _torch.elements_overlap(written, tensor)

    def tensor_of(self, entry: Entry) -> Optional[torch.Tensor]:
        return entry.ref()  # type: ignore[no-any-return]

    def repointed(self, entry: Entry) -> None:
        tensor = entry.ref()
        if tensor is not None:
            entry.refresh(tensor)
            self._rebuild_index()

    # -- exit ------------------------------------------------------------------------

    def changed_behind_our_back(self) -> list[tuple[Entry, torch.Tensor, tuple[Any, ...]]]:
        """Entries whose identity or layout changed with no op reporting it."""
        moved = []
        for entry in self._entries.values():
            tensor = entry.ref()
            if tensor is None:
                continue
            now = _torch.storage_fingerprint(tensor)
            if now != entry.fingerprint:
                moved.append((entry, tensor, entry.fingerprint))
        return moved

    def close(self) -> None:
        """Drop every reference: the guard keeps nothing alive once it exits."""
        self._entries.clear()
        self._by_identity = {}
        self._index = {}
        self._watch = []
        self._root = None


def _is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


def _placed_at(frames: list[Any], chain: tuple[tuple[Any, Any], ...]) -> str:
    site = _frames.placement_site(frames, chain)
    if site is not None:
        return site.short
    first = _frames.site_of(frames[0] if frames else None)
    return f"{first.short} (first seen)"

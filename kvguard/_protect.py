"""The protected set: which memory belongs to which guarded entry, since when.

Entries hold their tensors through weak references. To notice placements, the guard
keeps the guarded object's containers and what they held at its last look (compared
by identity before every write op), so a value removed from the dict is let go at the
next look, and a tensor placed into it is protected from that moment on.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import sys
import weakref
from typing import Any, Callable, Collection, Iterator, NamedTuple, Optional, Sequence

import torch

from kvguard import _digest, _frames, _torch, _tree


class Change(NamedTuple):
    """What a boundary check found on one entry: `values` changed, or its `memory` moved."""

    entry: Entry
    tensor: torch.Tensor
    kind: str
    was: Any
    now: Any


class Entry:
    """One protected tensor: its path, memory, placement and the digest of its values."""

    __slots__ = ("path", "ref", "spans", "placed_at", "fingerprint", "digest", "explained", "aliases",
                 "detached", "__weakref__")

    def __init__(self, path: str, tensor: torch.Tensor, ref: Callable[[], Optional[torch.Tensor]],
                 placed_at: Optional[str]) -> None:
        self.path = path
        self.ref = ref
        self.spans = _torch.spans(tensor)
        self.placed_at = placed_at
        self.fingerprint = _torch.storage_fingerprint(tensor)
        self.digest: _digest.Digest = None  # its values when last looked at (see `_digest`)
        self.explained = False  # an op event reported a write since then
        self.aliases: list[str] = []  # other paths to the same tensor object
        self.detached = False  # no longer reachable from the guarded object

    def refresh(self, tensor: torch.Tensor) -> None:
        """Re-read the memory and layout after an op changed them (`t_`, `set_`, `resize_`)."""
        self.spans = _torch.spans(tensor)
        self.fingerprint = _torch.storage_fingerprint(tensor)


class ProtectedSet:
    """Maps written memory to protected entries; learns about newly placed tensors."""

    def __init__(self, root: Any, name: str, keys: Optional[Collection[Any]], ignore: Collection[Any],
                 fingerprint: bool = True) -> None:
        self._root, self._name, self._keys, self._ignore = root, name, keys, ignore
        self._entries: dict[int, Entry] = {}
        self._by_identity: dict[int, Entry] = {}  # tensors without readable memory (meta)
        # per device: group starts, and disjoint (start, stop, entries) groups sorted by start
        self._index: dict[Any, tuple[list[int], list[tuple[int, int, list[Entry]]]]] = {}
        self._watch = _tree.snapshot([])
        self._all_starts: list[int] = []
        self._max_stop_upto: list[int] = []
        self._dirty = False
        self.on_index: Optional[Callable[[], None]] = None  # told when the protected memory changes
        self.keys_seen: set[Any] = set()  # top-level keys (or indices) the root ever held
        self.protected_count = 0  # tensors protected so far, including ones let go since
        self._fingerprint = fingerprint
        self._undigested: list[Entry] = []  # added since the last batch of digests
        self._scan(frames=None)

    # -- placement -------------------------------------------------------------------

    def written_entries(self, written: Sequence[torch.Tensor], kind: str, resizes: bool = False) -> list[Entry]:
        """The entries any of `written` touches, after protecting newly placed tensors.

        Runs for every op that writes anything, protected or not, so it stays flat: the
        placement check compares the watched containers in C, and a write whose whole
        storage misses every protected span returns at once.
        """
        self.look()
        # A protected tensor written itself may have been re-pointed behind our back: follow it.
        own = [e for t in written if (e := self._entries.get(id(t))) is not None and e.ref() is t]
        if own:
            self._follow(own)
        if kind == "write" and not self._by_identity:
            starts, max_stop = self._all_starts, self._max_stop_upto
            for tensor in written:
                try:
                    storage = tensor.untyped_storage()
                    lo = storage.data_ptr()
                    hi = lo + storage.nbytes()
                except Exception:  # noqa: BLE001 - sparse and other storage-less tensors
                    break
                i = bisect.bisect_left(starts, hi) - 1
                if lo == 0 or (i >= 0 and max_stop[i] > lo):
                    break  # may touch protected memory: look closely
            else:
                return []
        found: list[Entry] = []
        for tensor in written:
            found += [e for e in self.hits(tensor, kind, resizes) if e not in found]
        if found and self._follow(found):  # memory it no longer owns: look again
            return self.written_entries(written, kind, resizes)
        return found

    def look(self) -> None:
        """Protect what was placed since the last look (and forget what died): before any write is judged."""
        if self._dirty or _tree.changed(self._watch):
            self._scan(frames=list(_frames.user_frames(sys._getframe(1))))

    @property
    def watching(self) -> bool:
        """Whether a placement can happen: the guarded object has containers to watch."""
        return bool(self._watch.containers or self._watch.probed)

    def intervals(self) -> list[tuple[int, int]]:
        """The protected memory as sorted, disjoint `[start, stop)` byte ranges (all devices together)."""
        return _torch.merge_intervals((g[0], g[1]) for _, groups in self._index.values() for g in groups)

    def identities(self) -> list[int]:
        """The TensorImpl addresses of the protected tensors: a write to one of them is looked at
        wherever its memory is now (`w.data = x` re-points it without any op)."""
        found = []
        for entry in self._entries.values():
            tensor = entry.ref()
            if tensor is not None:
                try:
                    found.append(int(tensor._cdata))
                except Exception:  # noqa: BLE001 - a subclass without one: found by its memory
                    pass
        return found

    @property
    def by_identity(self) -> bool:
        """Whether some protected tensor has no readable memory (every write must be looked at)."""
        return bool(self._by_identity)

    def _follow(self, entries: list[Entry]) -> bool:
        """Re-read the memory of entries re-pointed outside the dispatcher; whether any had moved.

        `w.data = x`, `share_memory_()`: the entry's memory is wherever its tensor is now.
        """
        moved = False
        for entry in entries:
            tensor = entry.ref()
            if tensor is not None and entry.fingerprint != _torch.storage_fingerprint(tensor):
                entry.refresh(tensor)
                moved = True
        if moved:
            self._rebuild_index()
        return moved

    def _scan(self, frames: Optional[list[Any]]) -> None:
        with _collector_paused():
            self._scan_now(frames)

    def _scan_now(self, frames: Optional[list[Any]]) -> None:
        self._dirty = False
        for key in [k for k, e in self._entries.items() if e.ref() is None]:
            del self._entries[key]
        leaves, containers = _tree.walk(self._root, self._name, _is_tensor, self._keys, self._ignore,
                                        top_keys=self.keys_seen)
        reached: dict[int, list[str]] = {}
        for leaf in leaves:
            paths = reached.setdefault(id(leaf.tensor), [])
            paths.append(leaf.path)
            known = self._entries.get(id(leaf.tensor))
            if known is None or known.ref() is not leaf.tensor:
                self._add(leaf, None if frames is None else _placed_at(frames, leaf.chain))
        for key, entry in self._entries.items():
            paths = reached.get(key, [])
            entry.detached = not paths
            entry.aliases = [p for p in paths if p != entry.path]
        self._watch = _tree.snapshot(containers)
        if leaves:
            del leaf
        del leaves
        if self._dirty:
            # Values that a Mapping made on access died with the walk: forget them now
            # rather than rescan at every write op.
            for key in [k for k, e in self._entries.items() if e.ref() is None]:
                del self._entries[key]
            self._dirty = False
        self._rebuild_index()
        self._take_digests()  # of the tensors this look protected, in one batch

    def _add(self, leaf: _tree.Leaf, placed_at: Optional[str]) -> None:
        ref = weakref.ref(leaf.tensor, self._on_death)
        self.protected_count += 1
        entry = self._entries[id(leaf.tensor)] = Entry(leaf.path, leaf.tensor, ref, placed_at)
        if self._fingerprint:
            self._undigested.append(entry)

    # -- values ----------------------------------------------------------------------

    def _take_digests(self) -> None:
        """Digest the entries added since the last call, in one batch: their starting values."""
        new, self._undigested = self._undigested, []
        for entry, digest in zip(new, _digest.digests([e.ref() for e in new])):
            entry.digest = digest

    def explain(self, entries: list[Entry], settled: bool = True) -> None:
        """An op event reported a write to these entries: the next boundary check does not.

        A `settled` write has landed when the op returns: the entries' digests move to
        their values now, so a later change no op reports is still found. One that lands
        later (an asynchronous collective completes at `wait()`) marks them instead, so
        the next check does not count it. The write may also have moved their memory (a
        sparse `add_` reallocates): follow it.
        """
        self._follow(entries)
        if settled and self._fingerprint:
            for entry, digest in zip(entries, _digest.digests([e.ref() for e in entries])):
                entry.digest = digest
        else:
            for entry in entries:
                entry.explained = True

    def drifted(self, entries: list[Entry]) -> list[Entry]:
        """Entries whose values changed since their digest with no op reporting it.

        Checked just before a reported write, which would otherwise hide the change
        from the next boundary check; the digests then start from the values now.
        """
        if not self._fingerprint:
            return []
        now = _digest.digests([e.ref() for e in entries])
        agrees = _digest.same_all([e.digest for e in entries], now)
        found = [e for e, same in zip(entries, agrees) if not same and not e.explained]
        for entry, digest in zip(entries, now):
            entry.digest, entry.explained = digest, False
        return found

    def boundary_changes(self, frames: Optional[list[Any]], rescan: bool = True) -> list[Change]:
        """Entries whose values or memory changed with no op reporting it, each found once.

        Looks at placements since the last write op first. A storage move that keeps
        the values (`share_memory_()`, a multiprocessing queue) is no change: the entry
        follows the tensor to its new memory. Without a digest (fingerprints off, or
        nothing to read) a move is reported, as the values cannot be compared.
        """
        # A look for placements: every container is walked again at `g.check()` (stores into
        # containers that cannot be watched); at the exit, where a tensor placed now would
        # have nothing to be compared with, only when a watched one changed.
        if rescan or self._dirty or _tree.changed(self._watch):
            self._scan(frames)
        with _collector_paused():
            return self._changes_now()

    def _changes_now(self) -> list[Change]:
        live = [(e, t) for e in list(self._entries.values()) if (t := e.ref()) is not None]
        now = _digest.digests([t for _, t in live]) if self._fingerprint else [None] * len(live)
        agrees = _digest.same_all([e.digest for e, _ in live], now)
        found = []
        for (entry, tensor), digest, same in zip(live, now, agrees):
            layout = _torch.storage_fingerprint(tensor)
            if not entry.explained and not same:
                found.append(Change(entry, tensor, "values", entry.digest, digest))
            elif layout != entry.fingerprint and (entry.digest is None or digest is None):
                found.append(Change(entry, tensor, "memory", entry.fingerprint, layout))
            entry.digest, entry.explained = digest, False
        self._follow([e for e, _ in live])
        return found

    def _on_death(self, _: Any) -> None:
        # The memory may be reused by a new tensor; forget it before the next write.
        self._dirty = True

    def entry_of(self, tensor: torch.Tensor) -> Optional[Entry]:
        """The entry protecting this very tensor object, if any."""
        entry = self._entries.get(id(tensor))
        return entry if entry is not None and entry.ref() is tensor else None

    def release(self, tensors: tuple[torch.Tensor, ...]) -> Callable[[], None]:
        """Drop our weak references to `tensors` for a moment; returns the undo.

        `torch.utils.swap_tensors` refuses tensors that have weak references.
        """
        held = [(e, t) for t in tensors if (e := self.entry_of(t)) is not None]
        for entry, tensor in held:
            entry.ref = _Strong(tensor)

        def restore() -> None:
            for entry, tensor in held:
                entry.ref = weakref.ref(tensor, self._on_death)
                entry.refresh(tensor)
            if held:
                self._rebuild_index()
        return restore

    # -- lookup ----------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        per_device: dict[Any, list[tuple[int, int, Entry]]] = {}
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
        every = sorted((g[0], g[1]) for _, groups in self._index.values() for g in groups)
        self._all_starts = [start for start, _ in every]
        running, self._max_stop_upto = 0, []
        for _, stop in every:
            running = max(running, stop)
            self._max_stop_upto.append(running)
        if self.on_index is not None:
            self.on_index()

    def hits(self, written: torch.Tensor, kind: str = "write", resizes: bool = False) -> list[Entry]:
        """Protected entries a write to `written` touches.

        A value write touches an entry when they share at least one byte of element
        memory (tensors without readable memory, such as meta tensors, by identity; an
        empty tensor by identity when an `out=` op may resize it and fill it). A
        metadata or re-pointing op touches only the tensor object it changes: `t_` on a
        view leaves the base's shape alone.
        """
        if kind != "write":
            entry = self.entry_of(written)
            return [entry] if entry is not None else []
        if self._by_identity:
            entry = self.entry_of(written)
            if entry is not None and not entry.spans and (written.numel() > 0 or resizes):
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
        tensor = entry.ref()
        if tensor is None:
            return False
        # Wrapper subclasses (DTensor, jagged) are compared through the tensors holding their data.
        return any(ProtectedSet._parts_overlap(span, w, t)
                   for w in _torch.plain_parts(written) for t in _torch.plain_parts(tensor))

    @staticmethod
    def _parts_overlap(span: _torch.Span, written: torch.Tensor, tensor: torch.Tensor) -> bool:
        if tensor.layout != torch.strided or written.layout != torch.strided:
            return True  # sparse parts: span overlap is as exact as it gets
        written_spans, tensor_spans = _torch.spans(written), _torch.spans(tensor)
        if not any(a.start < b.stop and b.start < a.stop for a in written_spans for b in tensor_spans):
            return False
        if all(_torch.dense(a, written) for a in written_spans) and all(_torch.dense(b, tensor) for b in tensor_spans):
            return True
        return _torch.elements_overlap(written, tensor)

    def tensor_of(self, entry: Entry) -> Optional[torch.Tensor]:
        return entry.ref()

    def relayout(self, entry: Entry) -> None:
        tensor = entry.ref()
        if tensor is not None:
            entry.refresh(tensor)
            self._rebuild_index()

    # -- exit ------------------------------------------------------------------------

    def close(self) -> None:
        """Drop every reference: the guard keeps nothing alive once it exits."""
        self._entries.clear()
        self._by_identity = {}
        self._index = {}
        self._watch = _tree.snapshot([])
        self._root = None


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No garbage collection while a look allocates its entries.

    A look over 15,000 tensors allocates ~100,000 objects, enough to trigger a full
    collection over every object of the process (torch alone has ~500,000, ~0.2 s),
    which tripled the cost of entering a guard. They are collected later as usual.
    """
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class _Strong:
    """Stands in for a weak reference while one must not exist."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __call__(self) -> torch.Tensor:
        return self.tensor


def _is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


def _placed_at(frames: list[Any], chain: tuple[tuple[Any, Any], ...]) -> str:
    site = _frames.placement_site(frames, chain)
    if site is not None:
        return site.short
    first = _frames.site_of(frames[0] if frames else None)
    return f"{first.short} (first seen)"

"""Which protected entries a write touches: the protected set's memory index.

Per device, the protected byte ranges as sorted, disjoint groups, each with the entries
whose spans lie in it; entries with no readable memory (meta tensors) by identity. A
write is first compared by its whole storage (two binary searches), then span by span,
then element by element where spans are not dense. Rebuilt lazily after a change that
is not a plain addition.
"""

from __future__ import annotations

import bisect
from typing import Hashable, Iterable, Iterator, Optional, Sequence

import torch

from kvguard._protect import geometry as _geometry
from kvguard._protect.collector import collector_paused
from kvguard._protect.entries import Entry
from kvguard._torch import tensors as _tensors


class MemoryIndex:
    """The protected memory of one protected set, for lookups by written tensor."""

    def __init__(self) -> None:
        self._groups: dict[Hashable, _Groups] = {}  # per device
        self.by_identity: dict[int, Entry] = {}  # id(tensor) -> its entry, for tensors without memory
        self.stale = True  # rebuild before the next lookup

    def invalidate(self) -> None:
        self.stale = True

    def add(self, entries: Iterable[Entry]) -> None:
        """Entries newly protected (nothing else changed): merged in, unless a rebuild is due anyway."""
        if not self.stale:
            self._add(entries)

    def ensure(self, entries: Iterable[Entry]) -> None:
        """Rebuild from `entries` (all of the set's) if the index is stale: one sort per device,
        with the collector paused, so that the first write after many tensors were protected
        costs what sorting them costs (see `collector`)."""
        if not self.stale:
            return
        with collector_paused():  # ~n tuples at once: no full collection over the process midway
            self._build(entries)

    def _build(self, entries: Iterable[Entry]) -> None:
        self.stale = False
        self.by_identity = {}
        spans_of: dict[Hashable, list[tuple[int, int, int, Entry]]] = {}  # device -> (start, stop, order, entry)
        for order, entry in enumerate(entries):
            for span in self._spans(entry):
                spans_of.setdefault(span.device, []).append((span.start, span.stop, order, entry))
        self._groups = {device: _Groups.of(spans) for device, spans in spans_of.items()}

    def _add(self, entries: Iterable[Entry]) -> None:
        for entry in entries:
            for span in self._spans(entry):
                groups = self._groups.get(span.device)
                if groups is None:
                    groups = self._groups[span.device] = _Groups()
                groups.add(span.start, span.stop, entry)

    def _spans(self, entry: Entry) -> list[_geometry.Span]:
        """The entry's byte spans; an entry with none (no readable memory) is found by identity."""
        spans = entry.spans
        if not spans:
            tensor = entry.ref()
            if tensor is not None:
                self.by_identity[id(tensor)] = entry
        return spans

    def may_touch(self, written: Sequence[torch.Tensor]) -> bool:
        """Whether any of `written` may touch protected memory: its whole storage meets a group
        (or it has no readable storage). False is certain; True asks for `hits`."""
        if self.by_identity:
            return True
        for tensor in written:
            storage = storage_range(tensor)
            if storage is None:
                return True
            lo, hi = storage
            groups = self._groups.get(tensor.device)
            if lo == 0 or (groups is not None and groups.meets(lo, hi)):
                return True
        return False

    def hits(self, written: torch.Tensor, resizes: bool = False) -> list[Entry]:
        """The entries a value write to `written` touches: they share at least one byte of
        element memory (tensors without readable memory by identity; an empty tensor by
        identity when an `out=` op may resize it and fill it)."""
        if self.by_identity:
            entry = self.by_identity.get(id(written))
            if entry is not None and entry.ref() is written and (written.numel() > 0 or resizes):
                return [entry]
        found: list[Entry] = []
        for span in _geometry.spans(written):
            groups = self._groups.get(span.device)
            for members in groups.meeting(span.start, span.stop) if groups is not None else ():
                for entry in members:
                    if entry not in found and overlaps(span, written, entry):
                        found.append(entry)
        return found

    def in_storage_of(self, tensor: torch.Tensor) -> list[Entry]:
        """The entries whose memory lies in `tensor`'s storage (strided tensors; none for others)."""
        storage = storage_range(tensor)
        if storage is None:
            return []
        lo, hi = storage
        groups = self._groups.get(tensor.device)
        found: list[Entry] = []
        for members in groups.meeting(lo, hi) if groups is not None and lo else ():
            found += [e for e in members if e not in found]
        return found

    def clear(self) -> None:
        self._groups, self.by_identity, self.stale = {}, {}, False


def storage_range(tensor: torch.Tensor) -> Optional[tuple[int, int]]:
    """`[lo, hi)`, the bytes of `tensor`'s whole storage (lo 0: none allocated); None for sparse
    and other storage-less tensors."""
    try:
        storage = tensor.untyped_storage()
        lo = storage.data_ptr()
        return lo, lo + storage.nbytes()
    except Exception:  # noqa: BLE001
        return None


def overlaps(span: _geometry.Span, written: torch.Tensor, entry: Entry) -> bool:
    if not any(s.start < span.stop and span.start < s.stop for s in entry.spans):
        return False
    tensor = entry.ref()
    if tensor is None:
        return False
    # Wrapper subclasses (DTensor, jagged) are compared through the tensors holding their data.
    return any(_parts_overlap(span, w, t) for w in _tensors.plain_parts(written) for t in _tensors.plain_parts(tensor))


def _parts_overlap(span: _geometry.Span, written: torch.Tensor, tensor: torch.Tensor) -> bool:
    if tensor.layout != torch.strided or written.layout != torch.strided:
        return True  # sparse parts: span overlap is as exact as it gets
    written_spans, tensor_spans = _geometry.spans(written), _geometry.spans(tensor)
    if not any(a.start < b.stop and b.start < a.stop for a in written_spans for b in tensor_spans):
        return False
    if all(_geometry.dense(a, written) for a in written_spans) and all(_geometry.dense(b, tensor) for b in tensor_spans):
        return True
    return _geometry.elements_overlap(written, tensor)


class _Groups:
    """The protected byte ranges of one device: sorted, disjoint groups, each with the entries
    whose spans lie in it. A tensor placed later is merged in with two binary searches."""

    __slots__ = ("starts", "stops", "members")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.stops: list[int] = []
        self.members: list[list[Entry]] = []

    @classmethod
    def of(cls, spans: list[tuple[int, int, int, Entry]]) -> _Groups:
        """The groups of (start, stop, order, entry) spans in one sweep by start: ranges that
        share a byte are one group, whose entries keep their `order` (the set's walk order)."""
        groups = cls()
        spans.sort(key=_start)
        members: list[tuple[int, Entry]] = []
        for start, stop, order, entry in spans:
            if members and start < groups.stops[-1]:  # shares a byte with the group being built
                groups.stops[-1] = max(groups.stops[-1], stop)
            else:
                if members:
                    groups.members.append(_in_order(members))
                groups.starts.append(start)
                groups.stops.append(stop)
                members = []
            members.append((order, entry))
        if members:
            groups.members.append(_in_order(members))
        return groups

    def add(self, start: int, stop: int, entry: Entry) -> None:
        i = bisect.bisect_right(self.stops, start)  # the first group that ends after `start`
        j = bisect.bisect_left(self.starts, stop)  # past the last one that starts before `stop`
        members = [entry]
        if i < j:  # it overlaps groups i..j-1: one group now
            start, stop = min(start, self.starts[i]), max(stop, self.stops[j - 1])
            members = [e for group in self.members[i:j] for e in group]
            if entry not in members:
                members.append(entry)
        self.starts[i:j], self.stops[i:j], self.members[i:j] = [start], [stop], [members]

    def meeting(self, lo: int, hi: int) -> Iterator[list[Entry]]:
        """The entries of each group that shares a byte with `[lo, hi)`."""
        i = bisect.bisect_right(self.stops, lo)
        while i < len(self.starts) and self.starts[i] < hi:
            yield self.members[i]
            i += 1

    def meets(self, lo: int, hi: int) -> bool:
        i = bisect.bisect_right(self.stops, lo)
        return i < len(self.starts) and self.starts[i] < hi


def _start(span: tuple[int, int, int, Entry]) -> int:
    return span[0]


def _in_order(members: list[tuple[int, Entry]]) -> list[Entry]:
    """A group's entries, each once, in the set's order."""
    if len(members) == 1:
        return [members[0][1]]
    members.sort(key=_order)
    out: list[Entry] = []
    for _, entry in members:
        if not out or out[-1] is not entry:  # an entry's spans sit next to each other once sorted
            out.append(entry)
    return out


def _order(member: tuple[int, Entry]) -> int:
    return member[0]

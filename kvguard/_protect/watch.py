"""The placement watcher: the guarded object's containers as they were at the last look.

Before every write op the containers are compared by identity with what they held (in C,
`kvguard._native.speedups`, or by the compiled hook itself); when one changed, only what
it newly holds is walked. A container that lost a nested container, one no walk owns,
or a watch grown to twice its size since the last full walk asks for a full walk instead,
so that nothing unreachable stays held.

The snapshot is kept in segments: a container of `SEGMENT` values or more alone, smaller
ones together up to that size. A placement takes a new snapshot of the segments it
changed only, so its cost follows the containers it went into, not everything watched.
"""

from __future__ import annotations

from typing import Collection, Hashable, Optional, Sequence, Union

import torch

from kvguard._protect import stores as _stores
from kvguard._protect import tree as _tree
from kvguard._protect.contract import SnapshotPairs

SEGMENT = 256  # values: a container this large is a segment of its own
Found = list[Union[_tree.Leaf, _tree.Run]]  # what a walk found: leaves, and lists of tensors as runs


def _segments(containers: Sequence[_tree.Container]) -> list[_tree.Snapshot]:
    """Snapshots of `containers` in segments (see the module's docstring), in order."""
    out: list[_tree.Snapshot] = []
    chunk: list[_tree.Container] = []
    size = 0
    for container in containers:
        n = 1 if type(container) is _tree.Probe else len(container)
        if n >= SEGMENT:
            out.append(_tree.snapshot([container]))
            continue
        chunk.append(container)
        size += n
        if size >= SEGMENT:
            out.append(_tree.snapshot(chunk))
            chunk, size = [], 0
    if chunk:
        out.append(_tree.snapshot(chunk))
    return out


def _parts(snap: _tree.Snapshot) -> list[_tree.Container]:
    """The containers and probes a snapshot was taken of."""
    return [*snap.containers, *(probe for probe, _ in snap.probes)]


class Watcher:
    """What one guarded object's containers held, and the walk state to find what was placed."""

    def __init__(self, root: object, name: str, keys: Optional[Collection[object]], ignore: Collection[object],
                 runs: bool = False) -> None:
        self.root, self.name, self.keys, self.ignore = root, name, keys, ignore
        self.runs = runs  # lists of tensors come back as one `tree.Run` each
        self.segments: list[_tree.Snapshot] = []
        self.owners: dict[int, _tree.Owner] = {}  # id of a watched dict, list or probe -> its container
        self.walked: dict[int, object] = {}  # id -> every container walked since the last full walk
        self.grown = 0  # containers added to the watch since the last full walk
        self.partial = False  # placements were walked in part since the last full walk
        self.keys_seen: set[Hashable] = set()  # top-level keys (or indices) the root ever held
        # Told each value stored into a watched dict as it is stored (`stores`: Python 3.12+), if set.
        self.on_store: Optional[_stores.Listener] = None
        self._listened: dict[int, tuple[dict[object, object], _stores.Listener]] = {}  # id -> (dict, who hears it)

    def walk_all(self) -> Found:
        """Every tensor reachable from the guarded object, each path once (leaves, or runs); the
        watch starts over."""
        self.partial, self.grown = False, 0
        self.owners, self.walked = {}, {}
        leaves, containers = _tree.walk(self.root, self.name, torch.Tensor, self.keys, self.ignore,
                                        top_keys=self.keys_seen, seen=self.walked, owners=self.owners,
                                        runs=self.runs)
        self.segments = _segments(containers)
        self._listen(containers, again=True)
        return leaves

    def _listen(self, containers: Sequence[_tree.Container], again: bool = False) -> None:
        """Hear of stores into the dicts among `containers` (`again`: those alone, the others no more)."""
        listener = self.on_store
        if listener is None or not _stores.AVAILABLE:
            return
        dicts = {id(c): c for c in containers if isinstance(c, dict)}
        if again:
            for key in [key for key in self._listened if key not in dicts]:
                _stores.unlisten(*self._listened.pop(key))
        for key, d in dicts.items():
            if key not in self._listened:
                self._listened[key] = (d, listener)
                _stores.listen(d, listener)

    def _unlisten_all(self) -> None:
        for d, listener in self._listened.values():
            _stores.unlisten(d, listener)
        self._listened = {}

    def changed(self) -> bool:
        """Whether a watched container holds other values than at the last look."""
        return any(map(_tree.changed, self.segments))

    def touched(self) -> list[int]:
        """The segments whose containers hold other values than at the last look (for `placed`)."""
        return [i for i, snap in enumerate(self.segments) if _tree.changed(snap)]

    def keys_changed(self) -> bool:
        """Whether a watched dict's keys changed (a rename moves paths with no placement)."""
        return any(map(_tree.keys_changed, self.segments))

    def placed(self, touched: Optional[list[int]] = None, final: bool = False) -> Optional[Found]:
        """The tensors placed into the containers that changed (in the `touched` segments, if
        known already), walking only what is new; None when only a full walk can tell (`walk_all`).

        Costs in proportion to what was placed (and, for a store that is not an append, to
        the size of the container it went into), not to everything watched.

        `final`: the last look before the watch closes (a guard's exit). A container that lost
        a walked one, or a watch that doubled, then asks for no full walk (what is no longer
        reachable is let go with the whole watch), and no new snapshot is taken.
        """
        leaves: Found = []
        grown: list[_tree.Container] = []
        if touched is None:
            touched = self.touched()
        # A segment that is one list, appended to: its snapshot grows by what was appended (a copy
        # of the tuple, in C) instead of being taken again value by value.
        extended: dict[int, tuple[object, ...]] = {}
        for i, (target, held) in ((i, pair) for i in touched for pair in _tree.changed_at(self.segments[i])):
            owner = self.owners.get(id(target))
            new = _tree.appended(target, held) if owner is not None and target is owner.obj else None
            diff: Optional[tuple[list[tuple[object, object]], list[object]]]
            if new is not None:
                snap = self.segments[i]
                if len(snap.containers) == 1 and not snap.probed:
                    extended[i] = new
                diff = ([(step, value) for step, value in enumerate(new, len(held))], [])
            else:
                diff = _tree.new_children(target, held) if owner is not None and target is owner.obj else None
            if owner is None or (not final and diff is not None and any(id(v) in self.walked for v in diff[1])):
                return None
            if diff is None:  # attributes, pytree nodes, mappings, probes: their container again
                self.walked.pop(id(owner.obj), None)
                found, watched = _tree.walk(owner.obj, owner.path, torch.Tensor, self.keys, self.ignore,
                                            top_keys=self.keys_seen, chain=owner.chain, seen=self.walked,
                                            owners=self.owners, runs=self.runs)
                leaves += found
                grown += watched
                continue
            kids = diff[0]
            if not owner.chain:  # the guarded object itself: its top-level filters
                kept = _tree.top_level([(step, value, step, None) for step, value in kids], self.keys,
                                       self.ignore, self.keys_seen)
                kids = [(step, value) for step, value, _, _ in kept]
            for step, value in kids:
                found, watched = _tree.walk(value, owner.path + _tree.step_text(step), torch.Tensor,
                                            chain=owner.chain + ((target, step),), seen=self.walked,
                                            owners=self.owners, runs=self.runs)
                leaves += found
                grown += watched
        if final:
            return leaves
        self.grown += len(grown)
        if self.grown > max(len(self.owners) - self.grown, 8):
            return None  # the watch doubled: drop what is no longer reachable
        segments = self.segments
        for i in sorted(touched, reverse=True):  # the segments that changed, taken again; the others as they were
            snap, new = segments[i], extended.get(i)
            if new is not None:
                segments[i] = snap._replace(held=snap.held + new, ends=(snap.ends[0] + len(new),))
            else:  # a container grown to a segment's size leaves its group: its appends are then the case above
                segments[i:i + 1] = _segments(_parts(snap))
        segments += _segments(grown)
        self._listen(grown)
        self.partial = True
        return leaves

    def snapshot_pairs(self) -> SnapshotPairs:
        """(containers, held) per segment, for the compiled hook to compare before each write;
        None when only Python can tell (slots and deques)."""
        if any(snap.probed for snap in self.segments):
            return None
        return [(snap.containers, snap.held) for snap in self.segments]

    @property
    def watching(self) -> bool:
        """Whether a placement can happen: the guarded object has containers to watch."""
        return any(snap.containers or snap.probed for snap in self.segments)

    def forget(self) -> None:
        """Drop the snapshot and the containers walked, keeping the object and the keys seen: what
        is no longer reachable from it can die now (as a full walk would let it)."""
        self.segments = []
        self.owners, self.walked = {}, {}
        self.partial = False
        self._unlisten_all()

    def close(self) -> None:
        """Drop every reference to the guarded object and its containers."""
        self.segments = []
        self.owners, self.walked = {}, {}
        self.root = None
        self._unlisten_all()

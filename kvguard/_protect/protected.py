"""The protected set: which memory belongs to which guarded entry, since when.

Entries hold their tensors through weak references. The watcher (`watch`) keeps the
guarded object's containers and what they held at the last look (compared by identity
before every write op), so a value removed from the dict is let go at the next look, and
a tensor placed into it is protected from that moment on; the memory index (`index`)
says which entries a write touches.
"""

from __future__ import annotations

import os
import sys
import types
import weakref
from typing import Callable, Collection, Hashable, Optional, Sequence, Union, cast

import torch

from kvguard._protect import digest as _digest
from kvguard._protect import frames as _frames
from kvguard._protect import placements as _placements
from kvguard._protect import records as _records
from kvguard._protect import stores as _stores
from kvguard._protect import tree as _tree
from kvguard._protect.collector import collector_paused
from kvguard._protect.contract import Added, Capabilities, Protected, Publisher, SnapshotPairs
from kvguard._protect.entries import Change, Entry, StrongRef
from kvguard._protect.index import MemoryIndex
from kvguard._protect.watch import Watcher
from kvguard._torch import patches as _patches
from kvguard._torch import tensors as _tensors


class ProtectedSet(Capabilities):
    """Maps written memory to protected entries; learns about newly placed tensors."""

    # Set by the guard just before its exit check: the set closes after it, so a tensor placed
    # since the last look needs no digest (`NativeSet`); a pause's check is not final.
    final = False
    # A tensor placed into the guarded object while the guard runs is protected while the object
    # holds it, and let go once it has left (`_still_held`); what the object held when the guard
    # began, the caller's, stays protected wherever it goes (reported `detached`). Sets fed from
    # elsewhere (a dataset's returns, autograd's packs, a model's weights) keep all they protect.
    lets_go_of_what_left = True

    def __init__(self, root: object, name: str, keys: Optional[Collection[object]], ignore: Collection[object],
                 fingerprint: bool = True) -> None:
        self._entries: dict[int, Entry] = {}
        self._memory = MemoryIndex()  # which entries a write touches
        self._watcher = Watcher(root, name, keys, ignore)  # where placements show
        self._hear_stores(fingerprint)
        self._dirty = False  # a protected tensor died: forget it before the next write is judged
        self._reached: dict[int, Union[str, list[str]]] = {}  # id -> path(s) that reached each tensor at the last full walk
        self._reach_applied = True  # entries' aliases and `detached` agree with `_reached`
        # Told when the protected memory changes: with the entries added, or None when it changed otherwise.
        self.on_index: Optional[Callable[[Added], None]] = None
        self.protected_count = 0  # tensors protected so far, including ones let go since
        self._fingerprint = fingerprint
        self._compiled = _records.compiled_describe()  # kept for the set's life: one kind of record
        self._at_entry: Optional[set[int]] = None  # ids of the tensors the object held at entry
        self._scan(frames=None)
        self._at_entry = set(self._entries)
        self._hear_waits(fingerprint)

    # -- placement -------------------------------------------------------------------

    def _hear_stores(self, fingerprint: bool) -> None:
        """Digest what is stored into the guarded dicts as it is stored, where the interpreter tells
        (`stores`): with no digest to compare (fingerprints off) there is nothing to take early."""
        # id -> (tensor, its digest when stored, where): read by the look that protects it, then dropped.
        self._stored_digests: dict[int, tuple[torch.Tensor, _digest.Digest, Optional[str]]] = {}
        if fingerprint and _stores.AVAILABLE:
            self._watcher.on_store = self._stored
        self._unhear_waits: Optional[Callable[[], None]] = None
        self._waits_wanted = False  # set once the object is walked (`_hear_waits`)

    def _hear_waits(self, fingerprint: bool) -> None:
        """Once the object is walked: hear collectives complete from the first placement on.

        A tensor placed while a collective still wrote it (`all_reduce(t, async_op=True)`, then
        `rd["t"] = t`, then `wait()`) was digested before the collective's values landed. Heard
        from the first placement only: a guard nothing is placed into (a decorated function
        called a thousand times) never patches `Work.wait`.
        """
        self._waits_wanted = fingerprint and self.lets_go_of_what_left

    def _placing(self) -> None:
        """Something is placed: hear collectives complete from now on, if wanted and not yet."""
        if self._waits_wanted and self._unhear_waits is None:
            self._unhear_waits = _patches.on_work_wait(self._waited)

    def _waited(self, outputs: Optional[list[torch.Tensor]]) -> None:
        """A c10d collective completed (`Work.wait()` returned): the tensors placed during the guard that
        it wrote, begun before they were protected (a write after is judged at its op), start from
        their values now; those not looked at yet are digested at their look."""
        if not outputs:
            return
        storages = {_tensors.storage_address(t) for t in outputs}
        pending = self._stored_digests
        for key in [k for k, (t, _, _) in pending.items() if _tensors.storage_address(t) in storages]:
            del pending[key]
        placed = [e for t in outputs for e in self.hits(t) if self._placed_here(e)]
        if placed:
            for entry, digest in zip(placed, _digest.digests([e.ref() for e in placed])):
                entry.digest = digest

    def _stored(self, value: object) -> None:
        """A value is being stored into a guarded dict: digest the tensors in it not protected yet,
        and note the statement storing it (the frame running now: no source to search later)."""
        if isinstance(value, torch.Tensor):
            tensors = [value]
        else:
            found, _ = _tree.walk(value, "", torch.Tensor)
            tensors = [leaf.tensor for leaf in cast("list[_tree.Leaf]", found)]
        pending = self._stored_digests  # pinned memory still landing is read at the look, as before
        new = [t for t in tensors if id(t) not in pending and self.entry_of(t) is None
               and not _tensors.still_landing(t)]
        if not new:
            return
        self._placing()
        line = _frames.first_user_line(sys._getframe(1))
        site = f"{os.path.basename(line[0])}:{line[1]}" if line is not None else None
        for tensor, digest in zip(new, _digest.digests(new)):
            pending[id(tensor)] = (tensor, digest, site)

    def _at_store(self, tensor: Optional[torch.Tensor]) -> Optional[tuple[torch.Tensor, _digest.Digest, Optional[str]]]:
        """What `_stored` took of this very tensor since the last look (its digest, its line), if any."""
        at_store = self._stored_digests.get(id(tensor)) if tensor is not None else None
        return at_store if at_store is not None and at_store[0] is tensor else None

    def _stored_line(self, tensor: torch.Tensor) -> Optional[str]:
        """The statement that stored `tensor`, where its store was heard: no source to search."""
        at_store = self._at_store(tensor)
        return at_store[2] if at_store is not None else None

    def _as_stored(self, entries: Sequence[Entry]) -> None:
        """Entries just made for placed tensors start from the values they were stored with, where
        those were digested (`_stored`): a change since then, by any writer, is found next."""
        for entry in entries:
            at_store = self._at_store(entry.ref())
            if at_store is not None and not _digest.same_all([entry.digest], [at_store[1]])[0]:
                entry.digest = at_store[1]

    def _stop_hearing(self) -> None:
        """No more stores or collectives' completions told to this set (at its close)."""
        self._watcher.on_store = None
        self._stored_digests.clear()
        self._waits_wanted = False
        undo, self._unhear_waits = self._unhear_waits, None
        if undo is not None:
            undo()

    def stored_since_look(self, tensors: Sequence[torch.Tensor]) -> bool:
        return bool(self._stored_digests) and any(self._at_store(t) is not None for t in tensors)

    def _placed_all(self) -> None:
        """A placement pass is over: the digests taken at stores it read are no longer needed."""
        self._placing()
        self._stored_digests.clear()

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
        memory = self._memory
        if memory.stale:
            memory.ensure(self._entries.values())
        if kind == "write" and not memory.may_touch(written):
            return []
        found: list[Entry] = []
        for tensor in written:
            found += [e for e in self.hits(tensor, kind, resizes) if e not in found]
        if found and self._follow(found):  # memory it no longer owns: look again
            return self.written_entries(written, kind, resizes)
        return self._still_held(found) if found else found

    def _placed_here(self, entry: Entry) -> bool:
        """Whether `entry`'s tensor was placed into the guarded object while the guard ran."""
        tensor = entry.ref()
        return tensor is not None and self._at_entry is not None and id(tensor) not in self._at_entry

    def _still_held(self, entries: list[Entry]) -> list[Entry]:
        """`entries` less those of tensors placed during the guard that the guarded object no
        longer holds (`lets_go_of_what_left`): those are let go now, unreported.

        Asked only where a write or a change would be reported, so a placement's cost stays
        what was placed: which tensors the object holds is what a full walk says (`settle`).
        """
        if not self.lets_go_of_what_left or not any(map(self._placed_here, entries)):
            return entries
        self.settle()
        left = [e for e in entries if e.detached and self._placed_here(e)]
        if not left:
            return entries
        self._let_go(left)
        gone = set(map(id, left))
        return [e for e in entries if id(e) not in gone]

    def _let_go(self, entries: list[Entry]) -> None:
        """Stop protecting `entries` (the write hook forgets their memory)."""
        for entry in entries:
            tensor = entry.ref()
            if tensor is not None and self._entries.get(id(tensor)) is entry:
                del self._entries[id(tensor)]
        self._rebuild_index()

    def look(self) -> None:
        """Protect what was placed since the last look (and forget what died): before any write is judged."""
        if self._dirty:
            self._forget_dead()
        touched = self._watcher.touched()  # the hot path: one identity comparison per value, in C
        if touched:
            frames = list(_frames.user_frames(sys._getframe(1)))
            with collector_paused():
                self._place(frames, touched)

    def _place(self, frames: list[types.FrameType], touched: Optional[list[int]] = None) -> None:
        """Protect what was placed into the watched containers that changed (see `Watcher.placed`)."""
        leaves = cast("Optional[list[_tree.Leaf]]", self._watcher.placed(touched))  # leaves only: made without runs
        if leaves is None:
            return self._scan_now(frames)
        known, new, taken = self._entries, [], set()
        for leaf in leaves:  # tensors not protected yet, each once (its first path)
            key = id(leaf.tensor)
            if key not in taken and ((e := known.get(key)) is None or e.ref() is not leaf.tensor):
                taken.add(key)
                new.append(leaf)
        added = self._add(new, frames) if new else []
        del leaves, new
        self._placed_all()
        self._rebuild_index(added)  # the hook learns the new memory and what to compare now

    def settle(self) -> None:
        """Bring every entry's path, aliases and `detached` up to date (before they go into a report).

        A report names where a tensor is now: after `appendleft`, `insert(0, t)`, `pop(0)`,
        `reverse()` or `rotate()` its old index may hold another tensor. A path that still
        reaches it is kept; one that no longer does gives way to the first that does. A
        tensor no longer reachable keeps its last path and is marked `detached`.
        """
        # A renamed key moves paths with no placement; a placement not looked at yet waits for
        # the next look (a swap is judged before one), as it would without the rename.
        watcher = self._watcher
        if watcher.partial or watcher.keys_changed() and not watcher.changed():
            self._scan(frames=list(_frames.user_frames(sys._getframe(1))))
        if not self._reach_applied:
            self._reach_applied = True
            reached = self._reached
            for key, entry in self._entries.items():
                paths = reached.get(key)
                entry.detached = paths is None
                if paths is None:
                    entry.aliases = ()
                elif isinstance(paths, str):
                    entry.path, entry.aliases = paths, ()
                else:
                    if entry.path not in paths:
                        entry.path = paths[0]
                    entry.aliases = tuple(p for p in paths if p != entry.path)

    def _forget_dead(self) -> None:
        self._dirty = False
        if self._drop_dead():
            self._rebuild_index()

    def _drop_dead(self) -> bool:
        """Drop the entries whose tensor was freed; whether there were any."""
        dead = [k for k, e in self._entries.items() if e.ref() is None]
        for key in dead:
            del self._entries[key]
        return bool(dead)

    def snapshot_pairs(self) -> SnapshotPairs:
        """(containers, held) pairs for the compiled hook to compare before each write (`Watcher.snapshot_pairs`)."""
        return self._watcher.snapshot_pairs()

    @property
    def watching(self) -> bool:
        """Whether a placement can happen: the guarded object has containers to watch."""
        return self._watcher.watching

    @property
    def keys_seen(self) -> set[Hashable]:
        """Top-level keys (or indices) the guarded object ever held."""
        return self._watcher.keys_seen

    def intervals(self) -> list[tuple[int, int]]:
        """The protected memory as `[start, stop)` byte ranges (all devices together), in no
        order and overlapping where the tensors do: the hook sorts and merges them."""
        return _records.intervals(e.record for e in self._entries.values())

    def holds_inference(self, added: Added = None) -> bool:
        """Whether an inference tensor is protected (its writes inside inference mode need their
        own hook): among all entries, or among those just `added`."""
        entries = self._entries.values() if added is None else added
        return _records.holds_inference(e.record for e in entries)

    def publish(self, backend: Publisher, added: Added, replace: bool) -> bool:
        """Tell a write-hook backend the protected memory: all of it, or what `added` brought
        (merged into what it has unless `replace`). Returns whether some of it has no
        readable memory, so that every write must be looked at."""
        if added is None:  # through intervals(): a weights set leaves out what its optimizer step writes
            backend.add_protected(self.intervals(), self.identities(), replace)
            return self.by_identity
        records = [e.record for e in added]
        backend.add_protected(_records.intervals(records), _records.impls(records), replace)
        return not all(map(_records.has_memory, records))

    def identities(self) -> list[int]:
        """The TensorImpl addresses of the protected tensors: a write to one of them is looked at
        wherever its memory is now (`w.data = x` re-points it without any op)."""
        return _records.impls(e.record for e in self._entries.values())

    @property
    def by_identity(self) -> bool:
        """Whether some protected tensor has no readable memory (every write must be looked at)."""
        if self._memory.stale:
            return not all(_records.has_memory(e.record) for e in self._entries.values())
        return bool(self._memory.by_identity)

    def _follow(self, entries: list[Entry]) -> bool:
        """Re-read the memory of entries re-pointed outside the dispatcher; whether any had moved.

        `w.data = x`, `share_memory_()`: the entry's memory is wherever its tensor is now.
        """
        live = [(e, t) for e in entries if (t := e.ref()) is not None]
        moved = False
        for (entry, _), record in zip(live, self._records_of([t for _, t in live], digest=False)):
            if record.layout != entry.record.layout:
                entry.record = record
                moved = True
        if moved:
            self._rebuild_index()
        return moved

    def _scan(self, frames: Optional[list[types.FrameType]]) -> None:
        with collector_paused():
            self._scan_now(frames)

    def _scan_now(self, frames: Optional[list[types.FrameType]]) -> None:
        self._dirty = False
        self._drop_dead()
        leaves = cast("list[_tree.Leaf]", self._watcher.walk_all())  # leaves only: made without runs
        reached: dict[int, Union[str, list[str]]] = {}  # id -> the path, or a list of paths when several reach it
        new: list[_tree.Leaf] = []
        entries = self._entries
        for leaf in leaves:
            key = id(leaf.tensor)
            paths = reached.get(key)
            if paths is None:
                reached[key] = leaf.path
                known = entries.get(key)
                if known is None or known.ref() is not leaf.tensor:
                    new.append(leaf)
            elif isinstance(paths, str):
                reached[key] = [paths, leaf.path]
            else:
                paths.append(leaf.path)
        if new:
            self._add(new, frames)
        self._placed_all()
        self._reached = reached  # aliases and `detached` are read from it when a report needs them
        self._reach_applied = False
        if leaves:
            del leaf
        del leaves, new
        if self._dirty:
            # Values that a Mapping made on access died with the walk: forget them now
            # rather than rescan at every write op.
            self._drop_dead()
            self._dirty = False
        self._rebuild_index()

    def _records_of(self, tensors: Sequence[torch.Tensor], digest: Optional[bool] = None) -> list[_records.Record]:
        """Each tensor's record as this set keeps them: its fingerprint setting (unless `digest`
        says otherwise), from the one source it reads records with (`records.describe`)."""
        return _records.describe(tensors, self._fingerprint if digest is None else digest, self._compiled)

    def _add(self, leaves: list[_tree.Leaf], frames: Optional[list[types.FrameType]]) -> list[Entry]:
        """Protect newly reached tensors: their records (memory, layout, digest) in one batch."""
        records = self._records_of([leaf.tensor for leaf in leaves])
        on_death, entries = self._on_death, self._entries
        placements = None if frames is None else _placements.Placements(frames)  # each frame read once
        added = []
        at_entry = self._at_entry
        for leaf, record in zip(leaves, records):
            if at_entry is not None:
                at_entry.discard(id(leaf.tensor))  # a new tensor where one of those died
            placed_at = self._stored_line(leaf.tensor) if self._stored_digests else None
            if placed_at is None and placements is not None:
                placed_at = placements.placed_at(leaf.chain, leaf.tensor)
            entry = entries[id(leaf.tensor)] = Entry(leaf.path, record, weakref.ref(leaf.tensor, on_death), placed_at)
            added.append(entry)
        self.protected_count += len(leaves)
        if self._stored_digests:
            self._as_stored(added)
        return added

    # -- values ----------------------------------------------------------------------

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

    def boundary_changes(self, caller: Optional[types.FrameType], rescan: bool = True) -> list[Change]:
        """Entries whose values or memory changed with no op reporting it, each found once.

        `caller` is the frame that checks, where placements found now are located from.

        Looks at placements since the last write op first. A storage move that keeps
        the values (`share_memory_()`, a multiprocessing queue) is no change: the entry
        follows the tensor to its new memory. Without a digest (fingerprints off, or
        nothing to read) a move is reported, as the values cannot be compared.
        """
        # A look for placements: every container is walked again at `g.check()` (stores into
        # containers that cannot be watched); at the exit, where a tensor placed now would
        # have nothing to be compared with, only when a watched one changed.
        if rescan or self._dirty or self._watcher.partial or self._watcher.changed():
            self._scan(list(_frames.user_frames(caller)) if caller is not None else None)
        with collector_paused():
            found = self._changes_now()
        if found:
            self.settle()
            found = self._changes_still_held(found)
        return found

    def _changes_still_held(self, found: list[Change]) -> list[Change]:
        """`found` less the changes of tensors placed during the guard that have left it (`_still_held`)."""
        kept = set(map(id, self._still_held([change.entry for change in found])))
        return [change for change in found if id(change.entry) in kept]

    def _changes_now(self) -> list[Change]:
        found, moved = self._compare([(e, t) for e in list(self._entries.values()) if (t := e.ref()) is not None])
        if moved:
            self._rebuild_index()
        return found

    def _compare(self, live: list[tuple[Entry, torch.Tensor]]) -> tuple[list[Change], bool]:
        """What changed in each (entry, its live tensor) since its digest, each entry then following
        its tensor; and whether any moved (the caller tells the hook)."""
        return self._compare_records(live, self._records_of([t for _, t in live]))

    def _compare_records(self, live: list[tuple[Entry, torch.Tensor]],
                         records: list[_records.Record]) -> tuple[list[Change], bool]:
        """`_compare` with each live tensor's record read already."""
        agrees = _digest.same_all([e.digest for e, _ in live], [r.digest for r in records])
        found = []
        moved = False
        for (entry, tensor), record, same in zip(live, records, agrees):
            digest = record.digest
            if not entry.explained and not same:
                found.append(Change(entry, tensor, "values", entry.digest, digest))
            if record.layout != entry.record.layout:
                if same and (entry.digest is None or digest is None):
                    found.append(Change(entry, tensor, "memory", _records.layout_text(entry.record),
                                        _records.tensor_text(tensor)))
                entry.record, moved = record, True  # follow it to its memory now
            entry.digest, entry.explained = digest, False
        return found, moved

    def _on_death(self, _: object) -> None:
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
            entry.ref = StrongRef(tensor)

        def restore() -> None:
            for entry, tensor in held:
                entry.ref = weakref.ref(tensor, self._on_death)
            for (entry, _), record in zip(held, self._records_of([t for _, t in held], digest=False)):
                entry.record = record
            if held:
                self._rebuild_index()
        return restore

    # -- lookup ----------------------------------------------------------------------

    def _rebuild_index(self, added: Added = None) -> None:
        """The protected memory changed (by `added` entries only, if given): tell the hook; the
        lookup index is rebuilt when next needed."""
        if added is None:
            self._memory.invalidate()
        else:
            self._memory.add(added)
        if self.on_index is not None:
            self.on_index(added)

    def hits(self, written: torch.Tensor, kind: str = "write", resizes: bool = False) -> list[Entry]:
        """Protected entries a write to `written` touches.

        A value write touches the entries whose memory it shares (see `MemoryIndex.hits`).
        A metadata or re-pointing op touches only the tensor object it changes: `t_` on a
        view leaves the base's shape alone.
        """
        if kind != "write":
            entry = self.entry_of(written)
            return [entry] if entry is not None else []
        self._memory.ensure(self._entries.values())
        return self._memory.hits(written, resizes)

    def note(self, entry: Entry, what: str) -> None:
        """A write to `entry` was reported (`what`: op, line, code); kept where someone needs it later."""

    def tensor_of(self, entry: Entry) -> Optional[torch.Tensor]:
        return entry.ref()

    def tensors_at(self, path: str) -> list[torch.Tensor]:
        """The live protected tensors named `path` (or with it among their other paths). `NativeSet`
        keeps rows, not entries: its guards (`kvguard.guard`'s) apply no intended writer, so it has none."""
        found = []
        for entry in list(getattr(self, "_entries", {}).values()):
            if entry.path == path or path in entry.aliases:
                tensor = self.tensor_of(entry)
                if tensor is not None:
                    found.append(tensor)
        return found

    def relayout(self, entry: Entry) -> None:
        tensor = entry.ref()
        if tensor is not None:
            entry.record = self._records_of([tensor], digest=False)[0]
            self._rebuild_index()

    # -- exit ------------------------------------------------------------------------

    def close(self) -> None:
        """Drop every reference: the guard keeps nothing alive once it exits."""
        self._stop_hearing()
        self._entries.clear()
        self._memory.clear()
        self._watcher.close()
        self._reached = {}


_meets: type[Protected] = ProtectedSet  # mypy checks the set against the contract here

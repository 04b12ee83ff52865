"""The protected set with its tensors kept in C++ (`write_hook.Table`): cost in proportion to what changed.

`ProtectedSet` keeps a Python `Entry`, a weak reference and a record tuple per tensor,
about 5 µs and 680 bytes each, and builds its lookup index at the first write. Here each
tensor is a row of the compiled extension's table (weak reference to its TensorImpl, byte
span, layout hash, digest, flags), batches are described and compared in one C++ pass,
the memory index grows with the rows, and the write hook reads the protected memory
straight from the table. Python keeps only what reports need, by row: the path, and
where the tensor was placed. An `Entry` is made for a row only when a write hits it or a
report names it.

Rows the table cannot describe (subclasses, sparse, nested, meta tensors) keep their
record in Python and their own small `MemoryIndex`, as in `ProtectedSet`; so do digests
taken on another device.
"""

from __future__ import annotations

import sys
import types
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Collection, Optional, Sequence, Union, cast

import torch

from kvguard._protect import digest as _digest
from kvguard._protect import frames as _frames
from kvguard._protect import placements as _placements
from kvguard._protect import geometry as _geometry
from kvguard._protect import records as _records
from kvguard._protect import tree as _tree
from kvguard._protect.collector import collector_paused
from kvguard._protect.contract import Added, Publisher
from kvguard._protect.entries import Change, Entry
from kvguard._protect.index import MemoryIndex, overlaps, storage_range
from kvguard._protect.protected import ProtectedSet
from kvguard._protect.watch import Found, Watcher
from kvguard._torch import tensors as _tensors

if TYPE_CHECKING:
    from kvguard._protect.contract import Protected

_SWEEP_EVERY = 1024  # rows added since the last sweep, beyond the live ones then, before the next


def table_module() -> Optional[ModuleType]:
    """The compiled extension when it is loaded and has the table (never builds it)."""
    module = _records.compiled_describe()
    return module if module is not None and hasattr(module, "Table") else None


def _walked_tensors(found: Found) -> list[torch.Tensor]:
    """The tensors of a walk's leaves and runs, in order."""
    tensors: list[torch.Tensor] = []
    for item in found:
        if isinstance(item, _tree.Run):
            tensors += item.tensors
        else:
            tensors.append(item.tensor)
    return tensors


def _new_only(found: Found, again: list[tuple[int, int]]) -> Found:
    """A walk's leaves and runs less the tensors `Table.add` found protected already (`again`:
    their positions among the tensors), spelled out as leaves where there are any."""
    if not again:
        return found
    taken = {position for position, _ in again}
    return [leaf for i, leaf in enumerate(_tree.leaves_of(found)) if i not in taken]


class RowEntry(Entry):
    """A row of the table, as the judges and reports use an `Entry`; made when one needs it."""

    __slots__ = ("_owner", "row")

    def __init__(self, owner: NativeSet, row: int) -> None:  # noqa: D107 - no Entry.__init__: the table holds it
        self._owner = owner
        self.row = row
        self.path = owner._path(row)
        self.placed_at = owner._placed[row]
        self.aliases = ()
        self.detached = False

    def ref(self) -> Optional[torch.Tensor]:
        tensor: Optional[torch.Tensor] = self._owner._table.tensor(self.row)
        return tensor

    @property
    def record(self) -> _records.Record:
        owner = self._owner
        record = owner._py_records.get(self.row)
        return record if record is not None else owner._table.record(self.row)

    @record.setter
    def record(self, value: _records.Record) -> None:
        """Follow the tensor to its memory now: a Python-kept row keeps `value`; the table reads
        any other row's again from its tensor (what `value` was read from)."""
        owner = self._owner
        if self.row in owner._py_records:
            owner._py_records[self.row] = value
            owner._py_memory.invalidate()
        else:
            owner._table.refresh([self.row], False)

    @property
    def digest(self) -> _digest.Digest:
        owner = self._owner
        if self.row in owner._py_digests:
            return owner._py_digests[self.row]
        return owner._table.record(self.row).digest

    @digest.setter
    def digest(self, value: _digest.Digest) -> None:
        owner = self._owner
        if type(value) is int and self.row not in owner._py_records:
            owner._py_digests.pop(self.row, None)
            owner._table.set_digest(self.row, value)
        else:
            owner._table.set_digest(self.row, None)
            owner._py_digests[self.row] = value

    @property
    def explained(self) -> bool:
        owner = self._owner
        return bool(owner._table.flags(self.row) & owner._explained_flag)

    @explained.setter
    def explained(self, value: bool) -> None:
        owner = self._owner
        owner._table.set_flag(self.row, owner._explained_flag, bool(value))


class _Added(list[Entry]):
    """What one look protected: the rows from `first` on; the list holds the Python-kept ones among them."""

    __slots__ = ("first",)

    def __init__(self, first: int, python: list[Entry]) -> None:
        super().__init__(python)
        self.first = first

    def __bool__(self) -> bool:
        return True  # even with no new row: the watch changed, and the hook compares anew


class NativeSet(ProtectedSet):
    """`ProtectedSet`'s contract, its tensors kept as rows of a C++ table."""

    def __init__(self, root: object, name: str, keys: Optional[Collection[object]], ignore: Collection[object],
                 fingerprint: bool = True) -> None:  # noqa: D107 - ProtectedSet's, without its per-tensor state
        module = table_module()
        if module is None:
            raise RuntimeError("the compiled extension is not loaded")
        self._table = module.Table(_tensors.PLAIN, fingerprint)
        # The row flags Python reads, as the table exports them (`RowFlag` in csrc/table.h).
        self._explained_flag: int = module.ROW_EXPLAINED
        self._python_flag: int = module.ROW_PYTHON
        self._paths: list[Union[str, tuple[str, int], None]] = []  # per row: its path, or (prefix, first row) of a run's
        self._placed: list[Optional[str]] = []  # per row: where it was placed (None: there at entry)
        self._made: dict[int, RowEntry] = {}  # rows a hit or a report asked for
        self._py_records: dict[int, _records.Record] = {}  # rows the table cannot describe
        self._py_digests: dict[int, _digest.Digest] = {}  # digests Python took (another device)
        self._py_memory = MemoryIndex()  # the memory of the Python-kept rows
        self._identity_rows = False  # some row has no readable memory: writes are matched by identity
        self._swept_at = self._live_at_sweep = 0  # rows, and rows alive, when last swept
        self._watcher = Watcher(root, name, keys, ignore, runs=True)
        self._hear_stores(fingerprint)
        self._dirty = False
        self._walk: tuple[int, dict[int, list[str]]] = (0, {})  # the last full walk (`_scan_now`)
        self._applied: set[int] = set()  # rows whose entry took its paths from that walk
        self.on_index: Optional[Callable[[Added], None]] = None
        self.protected_count = 0
        self._fingerprint = fingerprint
        self._compiled = module
        self._scan(frames=None)
        self._entry_rows = len(self._table)  # the rows of what the object held at entry; placed ones follow
        self._hear_waits(fingerprint)

    # -- rows --------------------------------------------------------------------------

    def _path(self, row: int) -> str:
        """A row's path: kept as it is, or spelled from its run's prefix."""
        path = self._paths[row]
        if path is None or isinstance(path, str):
            return path or ""
        prefix, first = path
        return f"{prefix}[{row - first}]"

    def _entry(self, row: int) -> RowEntry:
        entry = self._made.get(row)
        if entry is None:
            entry = self._made[row] = RowEntry(self, row)
        return entry

    def entry_of(self, tensor: torch.Tensor) -> Optional[Entry]:
        row = self._table.row_of(tensor)
        return self._entry(row) if row >= 0 else None

    def _add_rows(self, found: Found, frames: Optional[list[types.FrameType]]) -> Optional[_Added]:
        """Protect newly reached tensors (a walk's leaves and runs) in one C++ call; returns what
        the hook must learn."""
        first, again, python = self._table.add(_walked_tensors(found))
        return self._took(first, _new_only(found, again), python, frames)

    def _took(self, first: int, found: Found, python: list[int],
              frames: Optional[list[types.FrameType]]) -> Optional[_Added]:
        """Rows from `first` on were made for `found` (leaves and runs, every tensor new): keep
        their paths and placements, a run's as one (prefix, first row) for all its rows."""
        paths, placed = self._paths, self._placed
        stored = self._stored_digests  # where a store was heard, its line: no source to search
        placements = _placements.Placements(frames) if frames is not None else None  # each frame read once
        row = first
        for item in found:
            if isinstance(item, _tree.Run):
                n = len(item.tensors)
                if not n:
                    continue
                paths += [(item.path, row)] * n
                sites = [self._stored_line(t) for t in item.tensors] if stored else None
                if sites is not None and None not in sites:
                    placed += sites
                else:
                    placed += [None] * n if placements is None else placements.placed_at_run(
                        item.chain, item.lst, item.tensors)
                row += n
            else:
                paths.append(item.path)
                site = self._stored_line(item.tensor) if stored else None
                placed.append(site if site is not None else None if placements is None
                              else placements.placed_at(item.chain, item.tensor))
                row += 1
        count = row - first
        if not count:
            return None
        self.protected_count += count
        table = self._table
        if not table.summary(first)[1]:
            self._identity_rows = True
        adopted = self._adopt_python(python) if python else []
        if stored:
            self._as_stored_rows(range(first, first + count))
        if len(table) - self._swept_at > self._live_at_sweep + _SWEEP_EVERY:  # O(1) a row, amortized
            self._sweep()
        del found
        return _Added(first, adopted)

    def _as_stored_rows(self, rows: range) -> None:
        """`ProtectedSet._as_stored` by row: a row whose digest is the one taken at its store costs
        a lookup and an int comparison, and gets no `RowEntry`."""
        table = self._table
        changed = []
        for row in rows:
            at_store = self._at_store(table.tensor(row))
            if at_store is None:
                continue
            if row in self._py_records or row in self._py_digests or type(at_store[1]) is not int \
                    or table.record(row).digest != at_store[1]:
                changed.append(self._entry(row))
        if changed:
            self._as_stored(changed)

    def _adopt_python(self, rows: list[int]) -> list[Entry]:
        """Records and digests for the new rows the table left to Python (few, as a rule)."""
        table = self._table
        python: list[Entry] = []
        pending: list[int] = []
        for row in rows:
            if table.flags(row) & self._python_flag:
                tensor = table.tensor(row)
                if tensor is None:
                    continue
                record = _records.describe([tensor], self._fingerprint, None)[0]
                self._py_records[row] = record
                self._py_digests[row] = record.digest
                python.append(self._entry(row))
                if not _records.has_memory(record):
                    self._identity_rows = True
            else:
                pending.append(row)
        if pending:
            for row, value in zip(pending, _digest.digests([table.tensor(row) for row in pending])):
                self._py_digests[row] = value
        if python:
            self._py_memory.invalidate()
        return python

    def _sweep(self) -> None:
        """Let go of the rows whose tensor died (their TensorImpl objects, their paths); once the
        dead outnumber the living, renumber the rows so that what is kept stays in proportion
        to what is alive."""
        table = self._table
        swept = table.sweep()
        for row in swept:
            self._forget_row(row)
        if swept:
            self._py_memory.invalidate()
        if len(table) - table.live() > table.live() + _SWEEP_EVERY:
            self._compact()
        self._swept_at, self._live_at_sweep = len(table), table.live()

    def _compact(self) -> None:
        kept = self._table.compact()
        new = {old: row for row, old in enumerate(kept)}
        self._paths = [self._path(old) for old in kept]
        self._placed = [self._placed[old] for old in kept]
        made: dict[int, RowEntry] = {}
        for old, entry in self._made.items():
            if old in new:
                entry.row = made_row = new[old]
                made[made_row] = entry
        self._made = made
        self._py_records = {new[old]: r for old, r in self._py_records.items() if old in new}
        self._py_digests = {new[old]: d for old, d in self._py_digests.items() if old in new}
        first, walked = self._walk
        self._walk = (sum(1 for old in kept if old < first),
                      {new[old]: paths for old, paths in walked.items() if old in new})
        self._applied = {new[old] for old in self._applied if old in new}
        self._entry_rows = sum(1 for old in kept if old < self._entry_rows)
        self._py_memory.invalidate()
        self._rebuild_index()  # the hook's view of the rows: republished

    def _forget_row(self, row: int) -> None:
        self._paths[row] = self._placed[row] = None
        self._made.pop(row, None)
        self._py_records.pop(row, None)
        self._py_digests.pop(row, None)

    # -- placement ---------------------------------------------------------------------

    def _place(self, frames: Optional[list[types.FrameType]], touched: Optional[list[int]] = None) -> None:
        leaves = self._watcher.placed(touched)
        if leaves is None:
            return self._scan_now(frames)
        added = self._add_rows(leaves, frames) if leaves else None
        del leaves
        self._placed_all()
        if added is not None:
            self._rebuild_index(added)
        else:
            self._rebuild_index(_Added(len(self._table), []))  # the watch changed: the hook compares anew

    def _scan_now(self, frames: Optional[list[types.FrameType]]) -> None:
        """A full walk: protect what it reaches for the first time, and note which rows it
        reached and by which paths, for `settle` (no per-tensor work for a tensor reached once)."""
        self._dirty = False
        leaves = self._watcher.walk_all()
        first, again, python = self._table.add(_walked_tensors(leaves))
        walked: dict[int, list[str]] = {}  # row -> its paths in this walk, beyond a new row's own
        if again:
            leaves = cast("Found", _tree.leaves_of(leaves))  # spelled out once: `_new_only` takes them so
            for position, row in again:
                walked.setdefault(row, []).append(leaves[position].path)
        self._took(first, _new_only(leaves, again), python, frames)
        self._placed_all()
        self._walk = (first, walked)
        self._applied = set()
        del leaves
        self._rebuild_index()

    def settle(self) -> None:
        """`ProtectedSet.settle` for the entries made so far, from the last full walk (`_scan_now`)."""
        watcher = self._watcher
        if watcher.partial or watcher.keys_changed() and not watcher.changed():
            self._scan(frames=list(_frames.user_frames(sys._getframe(1))))
        first, walked = self._walk
        for row, entry in self._made.items():
            if row in self._applied:
                continue
            self._applied.add(row)
            paths = walked.get(row)
            if row >= first:  # reached first by the path it was protected under (or placed since)
                entry.detached = False
                entry.aliases = tuple(p for p in paths or () if p != entry.path)
            elif paths is None:
                entry.detached, entry.aliases = True, ()
            else:
                entry.detached = False
                if entry.path not in paths:
                    entry.path = self._paths[row] = paths[0]
                entry.aliases = tuple(p for p in paths if p != entry.path)

    # -- what the hook learns -----------------------------------------------------------

    def publish(self, backend: Publisher, added: Added, replace: bool) -> bool:
        """Tell a write-hook backend the protected memory: all of it, or what `added` brought;
        whether some of it has no readable memory (see `ProtectedSet.publish`)."""
        first, python = self._batch(added)
        if backend is self._compiled:  # the module this table is of: it reads the rows in C++, no Python lists
            self._compiled.add_protected(self._table, first, replace)
        else:
            spans, impls = self._table.publication(first)
            backend.add_protected(spans, impls, replace)
        if python:
            records = [e.record for e in python]
            backend.add_protected(_records.intervals(records), _records.impls(records))
        return self._identity_rows

    def _batch(self, added: Added) -> tuple[int, Sequence[Entry]]:
        """The first row `added` brought, and the Python-kept entries among what it brought (None: all rows)."""
        if added is None:
            return 0, self._py_entries()
        return (added.first, added) if isinstance(added, _Added) else (len(self._table), added)

    def _py_entries(self) -> list[RowEntry]:
        return [self._entry(row) for row in self._py_records if self._table.tensor(row) is not None]

    def intervals(self) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = self._table.publication(0)[0]
        return spans + _records.intervals(e.record for e in self._py_entries())

    def identities(self) -> list[int]:
        found: list[int] = self._table.publication(0)[1]
        return found + _records.impls(e.record for e in self._py_entries())

    def holds_inference(self, added: Added = None) -> bool:
        first, python = self._batch(added)
        return bool(self._table.summary(first)[0]) or _records.holds_inference(e.record for e in python)

    @property
    def by_identity(self) -> bool:
        return self._identity_rows

    # -- lookup ------------------------------------------------------------------------

    def written_entries(self, written: Sequence[torch.Tensor], kind: str, resizes: bool = False) -> list[Entry]:
        self.look()
        table = self._table
        own: list[Entry] = [self._entry(row) for t in written if (row := table.row_of(t)) >= 0]
        if own:
            self._follow(own)
        found: list[Entry] = []
        if kind != "write" or self._may_touch(written):
            for tensor in written:
                found += [e for e in self.hits(tensor, kind, resizes) if e not in found]
        if table.met_dead():  # memory of a tensor that died, maybe another's now: the hook forgets it
            self._sweep()
            self._rebuild_index()
        if found and self._follow(found):  # memory it no longer owns: look again
            return self.written_entries(written, kind, resizes)
        return self._still_held(found) if found else found

    def _placed_here(self, entry: Entry) -> bool:
        return isinstance(entry, RowEntry) and entry.row >= self._entry_rows

    def _let_go(self, entries: list[Entry]) -> None:
        for entry in entries:
            if isinstance(entry, RowEntry):
                self._table.let_go(entry.row)  # dead to the table from now: the sweep forgets the row
        self._sweep()
        self._py_memory.invalidate()
        self._rebuild_index()

    def _may_touch(self, written: Sequence[torch.Tensor]) -> bool:
        if self._identity_rows:
            return True
        table = self._table
        for tensor in written:
            storage = storage_range(tensor)
            if storage is None or storage[0] == 0:
                return True
            if table.meets(storage[0], storage[1], tensor.device):
                return True
        if self._py_records:
            self._py_memory.ensure(self._py_entries())
            return self._py_memory.may_touch(written)
        return False

    def hits(self, written: torch.Tensor, kind: str = "write", resizes: bool = False) -> list[Entry]:
        if kind != "write":
            entry = self.entry_of(written)
            return [entry] if entry is not None else []
        table = self._table
        found: list[Entry] = []
        if self._identity_rows:
            row = table.row_of(written)
            if row >= 0 and row not in self._py_records:
                record = table.record(row)
                if not _records.has_memory(record) and (written.numel() > 0 or resizes):
                    found.append(self._entry(row))
        for span in _geometry.spans(written):
            if not isinstance(span.device, torch.device):
                continue
            for row in table.meeting(span.start, span.stop, span.device):
                entry = self._entry(row)
                if entry not in found and overlaps(span, written, entry):
                    found.append(entry)
        if self._py_records:
            self._py_memory.ensure(self._py_entries())
            found += [e for e in self._py_memory.hits(written, resizes) if e not in found]
        return found

    def _follow(self, entries: list[Entry]) -> bool:
        """`ProtectedSet._follow`, the table's rows read again in one C++ pass."""
        native = [e.row for e in entries if isinstance(e, RowEntry) and e.row not in self._py_records]
        python = [e for e in entries if not isinstance(e, RowEntry) or e.row in self._py_records]
        moved = bool(native) and bool(self._table.refresh(native, False)[1])
        if python and super()._follow(python):  # told the hook already
            return True
        if moved:
            self._rebuild_index()
        return moved

    def release(self, tensors: tuple[torch.Tensor, ...]) -> Callable[[], None]:
        """Drop the table's weak references to `tensors` for a moment (`torch.utils.swap_tensors`
        refuses a TensorImpl with weak references); the undo gives them back, to whatever each
        Python object holds then (a swap exchanges their insides)."""
        held = [(e, t) for t in tensors if (e := self.entry_of(t)) is not None]
        for entry, _ in held:  # torch also refuses weak references to the TensorImpl: ours go for the swap
            if isinstance(entry, RowEntry):
                self._table.let_go(entry.row)

        def restore() -> None:
            for entry, tensor in held:
                if isinstance(entry, RowEntry):
                    self._table.repoint(entry.row, tensor)
                    if entry.row in self._py_records:
                        self._py_records[entry.row] = self._records_of([tensor], digest=False)[0]
            if held:
                self._py_memory.invalidate()
                self._rebuild_index()
        return restore

    def _rebuild_index(self, added: Added = None) -> None:
        if self.on_index is not None:
            self.on_index(added)

    # -- values ------------------------------------------------------------------------

    def explain(self, entries: list[Entry], settled: bool = True) -> None:
        self._follow(entries)
        if settled and self._fingerprint:
            rows = [e.row for e in entries if isinstance(e, RowEntry) and e.row not in self._py_records
                    and e.row not in self._py_digests]
            if rows:
                marked = [r for r in rows if self._table.flags(r) & self._explained_flag]  # an earlier write landing later
                self._table.refresh(rows, True)
                for row in marked:
                    self._table.set_flag(row, self._explained_flag, True)
            rest = [e for e in entries if not isinstance(e, RowEntry) or e.row not in rows]
            for entry, digest in zip(rest, _digest.digests([e.ref() for e in rest])):
                entry.digest = digest
        else:
            for entry in entries:
                entry.explained = True

    def _changes_now(self) -> list[Change]:
        table = self._table
        changed, moved, python = table.refresh(None, self._fingerprint)
        found: list[Change] = []
        for row, was, now in changed:
            tensor = table.tensor(row)
            if tensor is not None:
                found.append(Change(self._entry(row), tensor, "values", was, now))
        for row, old in moved:
            tensor = table.tensor(row)
            if tensor is None or row in self._py_records:
                continue
            if table.flags(row) & self._python_flag:  # no longer plain memory: Python keeps it from now on
                self._py_records[row] = self._records_of([tensor], digest=False)[0]
                self._py_memory.invalidate()
                continue
            # As `ProtectedSet._compare`: a move whose values cannot be compared, before or now (a
            # storage freed with `resize_(0)` has no digest), is a change.
            lost = old.digest is None or table.record(row).digest is None
            if not self._fingerprint or lost and row not in self._py_digests:
                found.append(Change(self._entry(row), tensor, "memory", _records.layout_text(old),
                                    _records.tensor_text(tensor)))
        # The rows whose record or digest Python keeps: `ProtectedSet`'s comparison.
        live: list[tuple[Entry, torch.Tensor]] = [
            (self._entry(r), t) for r in python
            if (r in self._py_records or r in self._py_digests) and (t := table.tensor(r)) is not None]
        more, python_moved = self._compare(live) if live else ([], False)
        if moved or python_moved:
            self._rebuild_index()
        return found + more

    def boundary_changes(self, caller: Optional[types.FrameType], rescan: bool = True) -> list[Change]:
        """`ProtectedSet.boundary_changes`; without `rescan` (the exit), a look at the containers
        that changed walks only what was placed, not the whole object again."""
        if self.final and not rescan and not self._stored_digests:
            return self._final_changes()  # else what was placed has values to compare: rows first
        frames = list(_frames.user_frames(caller)) if caller is not None else None
        if rescan:
            self._scan(frames)
        elif self._watcher.changed():
            with collector_paused():
                self._place(frames)
        with collector_paused():
            found = self._changes_now()
        if found:
            self.settle()
            found = self._changes_still_held(found)
        self._sweep()
        return found

    def _final_changes(self) -> list[Change]:
        """The guard's exit: what changed in the rows protected so far. A tensor placed since
        the last look is counted (and its top-level key noted) but gets no row: first seen
        now, it has nothing to be compared with, and the set closes next. So the exit reads
        each protected byte once and walks only what was placed, not the whole object."""
        watcher = self._watcher
        placed = watcher.changed()
        count = 0
        if placed:
            leaves = watcher.placed(final=True)
            if leaves is None:  # only a full walk can tell (a store into a container it cannot diff)
                leaves = watcher.walk_all()
            row_of = self._table.row_of
            count = len({id(t) for t in _walked_tensors(leaves) if row_of(t) < 0})
            del leaves
            watcher.forget()  # what left the object dies now, unread, as after a full walk
        with collector_paused():
            found = self._changes_now()
            if not found:
                self.protected_count += count
            elif placed:  # a report names where each tensor is now: the tree as it is (paths,
                self._scan_now(None)  # aliases); the walk gives the placed tensors their rows and count
        if found:
            self.settle()
            found = self._changes_still_held(found)
        return found


    # -- exit ----------------------------------------------------------------------------

    def close(self) -> None:
        self._stop_hearing()
        self._table.clear()
        self._made.clear()
        self._paths, self._placed = [], []
        self._py_records.clear()
        self._py_digests.clear()
        self._py_memory.clear()
        self._watcher.close()
        self._walk = (0, {})


if TYPE_CHECKING:
    _meets: type[Protected] = NativeSet  # mypy checks the set against the contract here

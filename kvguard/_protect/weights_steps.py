"""The optimizer-step protocol of a model's weights: a step's writes are the trainer's, not findings.

Per step the guard calls `step_set(params)` (the step's entries, kept while they stay as
they are), `step_changes(step)` (what changed since the last step with no op reporting it:
the step would absorb it), `begin_step(step)` and `end_step(step)`. While a step runs its
parameters leave the write hook's memory, so its writes cost nothing; then their digests
start again from what the step left. With the compiled extension loaded a step's parameters
are rows of a C++ table (`StepSet.table`): compared and digested in one C++ pass each, the
table holding their digests from step to step (`_take`, given back by `_reclaim` whenever
Python code reads or sets them), and the write hook admits the step's writes in C++
(`write_hook.admit`): no Python per parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Optional, Protocol, Sequence, cast

import torch

from kvguard._protect import records as _records
from kvguard._protect.collector import collector_paused
from kvguard._protect.contract import Hook
from kvguard._protect.entries import Change, Entry
from kvguard._protect.protected import ProtectedSet
from kvguard._protect.records import Record
from kvguard._torch import tensors as _tensors

if TYPE_CHECKING:
    from kvguard._native.write_hook import Table

# What the write hook keeps publishing while a step is admitted: the other guards' memory.
OtherMemory = tuple[list[tuple[int, int]], list[int]]


class Admitter(Protocol):
    """A write hook that admits a step's writes in C++ (the compiled one: `write_hook.admit`)."""

    def admit(self, table: Optional[Table], intervals: Sequence[tuple[int, int]] = ...,
              identities: Sequence[int] = ...) -> bool: ...


class StepSet:
    """What one optimizer's step writes: its parameters' entries and the entries sharing their
    memory, kept from step to step while the entries stay as they are.

    `table`: the compiled extension's `write_hook.Table` of their tensors (row i for entry i),
    or None (not loaded, or a tensor Python must describe). With it, the comparison before
    a step and the digests after it are one C++ pass each, the table holding the digests
    between steps (`holding`), and the write hook admits the step's writes in C++
    (`admitted`, by `backend`) rather than have Python see each one.
    """

    __slots__ = ("admitted", "backend", "entries", "given", "holding", "ids", "key", "table")

    def __init__(self, entries: list[Entry], table: Optional[Table], key: tuple[int, ...] = ()) -> None:
        self.key = key  # the ids of the tensors it was made for, in the optimizer's order
        self.entries = entries
        self.ids = frozenset(map(id, entries))
        self.table = table
        self.holding = False
        self.admitted = False
        self.backend: Optional[Admitter] = None
        # The step's tensors while it runs (`begin_step` to `end_step`), as the optimizer lists
        # them: the table reads a row from there where it is that row's tensor, taking no
        # reference (see `Table.refresh`); None between steps, so nothing is held then.
        self.given: Optional[list[torch.Tensor]] = None


def _same_ids(objects: list[torch.Tensor], ids: tuple[int, ...]) -> bool:
    """Whether `objects` are, one for one, the objects whose ids `ids` lists (in C where the compiled
    extension is loaded)."""
    from kvguard._protect.native import table_module

    module = table_module()
    if module is not None and hasattr(module, "same_ids"):
        return bool(module.same_ids(objects, ids))
    return tuple(map(id, objects)) == ids


class DeviceComparisons:
    """Digest comparisons made on a device and read at the next boundary.

    Reading a comparison back at each optimizer step would synchronise the host with the
    device once per step; instead each set of entries keeps one flag per entry on its
    device ("changed at some comparison since the last boundary"), combined out of place.
    """

    def __init__(self) -> None:
        self._sets: dict[tuple[int, ...], tuple[list[Entry], torch.Tensor]] = {}

    def add(self, entries: list[Entry], was: list[torch.Tensor], now: list[torch.Tensor]) -> None:
        """Compare `was` with `now` (0-d digests on one device), entry by entry, on the device."""
        key = tuple(map(id, entries))
        differs = torch.stack(was) != torch.stack(now)
        held = self._sets.get(key)
        self._sets[key] = (entries, differs if held is None else held[1] | differs)

    def collect(self) -> list[Entry]:
        """The entries whose digests differed at some comparison since the last `collect` (one read
        per set: the host waits for the device here)."""
        sets, self._sets = self._sets, {}
        found: list[Entry] = []
        seen: set[int] = set()
        for entries, flags in sets.values():
            for entry, changed in zip(entries, flags.tolist()):
                if changed and id(entry) not in seen:
                    seen.add(id(entry))
                    found.append(entry)
        return found


class SteppingSet(ProtectedSet):
    """A protected set whose entries optimizer steps write (`weights.ModuleSet`'s lowest layer)."""

    def __init__(self, name: str, fingerprint: bool) -> None:
        self.steps = 0  # optimizer steps the set stepped aside for
        self._active: list[StepSet] = []  # the optimizer steps running now
        self._holding: list[StepSet] = []  # the step sets whose tables hold their entries' digests
        self._step_sets: dict[tuple[int, ...], StepSet] = {}  # a step's parameters (ids) -> what it writes
        # (how many, the first's id) -> the step set last found for such a list, checked whole by `same_ids`
        self._step_hints: dict[tuple[int, int], StepSet] = {}
        self._hook: Optional[Hook] = None  # the write hook this set is attached to (`attach_hook`), where one is
        self._later = DeviceComparisons()  # comparisons on a device, read at the next boundary
        super().__init__([], name, None, (), fingerprint=fingerprint)

    def _before_comparing(self) -> list[Change]:
        """Bring every digest up to date before a step's comparison: what changed meanwhile,
        found on the way (an intended write would have absorbed it)."""
        return []

    def _compare_soon(self, live: list[tuple[Entry, torch.Tensor]],
                      records: Optional[list[Record]] = None) -> tuple[list[Change], bool]:
        """`ProtectedSet._compare` without a host synchronisation: digests kept on a device are
        compared there and read at the next boundary (`DeviceComparisons`), which syncs anyway;
        the others now. Every entry's digest then starts again from its values now. `records`:
        the live tensors' records, read already."""
        if records is None:
            records = self._records_of([t for _, t in live])
        now_host: list[tuple[Entry, torch.Tensor, Record]] = []
        on_device: dict[torch.device, list[tuple[Entry, torch.Tensor, torch.Tensor]]] = {}
        moved = False
        for (entry, tensor), record in zip(live, records):
            was, now = entry.digest, record.digest
            if not (isinstance(was, torch.Tensor) and isinstance(now, torch.Tensor) and was.device == now.device):
                now_host.append((entry, tensor, record))
                continue
            if not entry.explained:  # (an explained change is no finding: its digest only starts again)
                on_device.setdefault(now.device, []).append((entry, was, now))
            if record.layout != entry.record.layout:
                entry.record, moved = record, True  # follow it to its memory now
            entry.digest, entry.explained = now, False
        for triples in on_device.values():
            self._later.add([e for e, _, _ in triples], [w for _, w, _ in triples], [n for _, _, n in triples])
        if not now_host:
            return [], moved
        found, host_moved = self._compare_records([(e, t) for e, t, _ in now_host], [r for _, _, r in now_host])
        return found, moved or host_moved

    def intervals(self) -> list[tuple[int, int]]:
        if not self._active:
            return super().intervals()
        return _records.intervals(e.record for e in self._entries.values() if not self._stepping(e))

    def identities(self) -> list[int]:
        if not self._active:
            return super().identities()
        return _records.impls(e.record for e in self._entries.values() if not self._stepping(e))

    def _stepping(self, entry: Entry) -> bool:
        """Whether a step running now writes `entry`."""
        key = id(entry)
        return any(key in step.ids for step in self._active)

    # -- optimizer steps -------------------------------------------------------------

    def step_set(self, tensors: Sequence[torch.Tensor]) -> StepSet:
        """What a step of an optimizer over `tensors` writes: their entries and the entries that
        share their memory (a buffer aliasing a parameter); made once per optimizer while the
        entries stay as they are (a rescan or a death forgets it)."""
        if self._must_look():
            self.look()
        hint = (len(tensors), id(tensors[0]) if tensors else 0)
        step = self._step_hints.get(hint)
        if step is not None and type(tensors) is list and _same_ids(tensors, step.key):
            return step  # the same parameters as last time, checked in C: no tuple of ids made
        key = tuple(map(id, tensors))
        step = self._step_sets.get(key)
        if step is None:
            entries = self._step_entries(tensors)
            step = self._step_sets[key] = StepSet(entries, self._step_table(entries), key)
        self._step_hints[hint] = step
        return step

    def _must_look(self) -> bool:
        """Whether the next look may change what a step writes (a protected tensor died)."""
        return self._dirty

    def _step_entries(self, tensors: Iterable[torch.Tensor]) -> list[Entry]:
        params = [e for t in tensors if (e := self.entry_of(t)) is not None]
        self._memory.ensure(self._entries.values())
        found = {id(e): e for e in params}
        for entry in params:
            tensor = entry.ref()
            if tensor is not None:
                found.update((id(e), e) for e in self._memory.hits(tensor))
        return list(found.values())

    def _step_table(self, entries: list[Entry]) -> Optional[Table]:
        """A `write_hook.Table` of `entries`' tensors, row i for entry i; None where the compiled
        extension is not loaded or a tensor is not plain host memory (Python compares those)."""
        from kvguard._protect.native import table_module

        module = table_module()
        tensors = [e.ref() for e in entries]
        if module is None or not tensors or any(t is None for t in tensors):
            return None
        table: Table = module.Table(_tensors.PLAIN, self._fingerprint)
        first, again, python = table.add(tensors)
        if first != 0 or again or python or len(table) != len(entries):
            table.clear()
            return None
        return table

    def step_changes(self, step: StepSet, tensors: Optional[list[torch.Tensor]] = None) -> list[Change]:
        """What changed, with no op reporting it, in what a step is about to write: the step takes
        their digests again when it is done, so a change made since the last one (a numpy
        view, a raw pointer) is found now or never. `tensors`: the list `step_set` was given,
        if the caller has it (read from there rather than through the table's weak references)."""
        if not self._fingerprint:
            return []
        early = self._before_comparing()
        if step.table is not None and self._take(step):
            found = self._step_refresh(step, report=True, tensors=tensors)
        else:
            with collector_paused():
                found, moved = self._compare_soon([(e, t) for e in step.entries if (t := e.ref()) is not None])
            if moved:
                self._rebuild_index()
        return early + found

    def _take(self, step: StepSet) -> bool:
        """`step`'s table holds its entries' digests from now on (until `_reclaim`); False where
        one of them is not a host digest (Python compares them)."""
        if step.holding:
            return True
        self._reclaim(step.entries)  # another step set holding some of them gives them back first
        digests = [e.digest for e in step.entries]
        if not all(d is None or type(d) is int for d in digests):
            return False
        assert step.table is not None
        step.table.set_digests(digests, [e.explained for e in step.entries])
        step.holding = True
        self._holding.append(step)
        return True

    def _reclaim(self, entries: Optional[Sequence[Entry]] = None) -> None:
        """The digests the step tables hold come back to their entries (those of `entries`; None:
        all), before Python code reads or sets them."""
        if not self._holding:
            return
        ids = None if entries is None else {id(e) for e in entries}
        for step in list(self._holding):
            if ids is None or not step.ids.isdisjoint(ids):
                step.holding = False
                self._holding.remove(step)
                assert step.table is not None
                for entry, digest in zip(step.entries, step.table.digests()):
                    entry.digest, entry.explained = digest, False

    def _step_refresh(self, step: StepSet, report: bool,
                      tensors: Optional[list[torch.Tensor]] = None) -> list[Change]:
        """One C++ pass over the step's table: digests compared (`report`: what changed is
        returned) and taken again, and memory followed (`ProtectedSet._compare_records`).
        `tensors`: a list holding the rows' tensors in row order, where the caller has one."""
        table = step.table
        assert table is not None
        changed, moved, python = table.refresh(None, self._fingerprint, tensors, report)
        entries = step.entries
        found = [Change(entries[row], t, "values", was, now) for row, was, now in changed
                 if (t := entries[row].ref()) is not None] if report else []
        if moved or python:
            for row, old in moved:
                entry, tensor = entries[row], entries[row].ref()
                if tensor is None:
                    continue
                record = table.record(row)
                if report and (old.digest is None or record.digest is None):
                    found.append(Change(entry, tensor, "memory", _records.layout_text(old),
                                        _records.tensor_text(tensor)))
                entry.record = _records.describe([tensor], False, self._compiled)[0] if python else record
            self._forget_steps()  # the next step makes its set anew, from the entries as they are now
            self._rebuild_index()
        return found

    def begin_step(self, step: StepSet, tensors: Optional[list[torch.Tensor]] = None) -> StepSet:
        """An optimizer step starts: what it writes steps aside until `end_step` (admitted by the
        write hook in C++ where it can, else left out of what is published). A step inside
        another (ZeroRedundancyOptimizer's step() steps its inner optimizer) is the same step.
        `tensors`: the list `step_set` was given, held until `end_step` reads the step's result."""
        if not self._active:
            self.steps += 1
        self._active.append(step)
        step.given = tensors
        if not step.entries:
            return step
        backend, kept = self._admitting() if step.table is not None else (None, ([], []))
        step.admitted = backend is not None and bool(backend.admit(step.table, *kept))
        step.backend = backend if step.admitted else None
        if not step.admitted:
            self._rebuild_index()  # the write hook no longer compares their memory
        return step

    def attach_hook(self, hook: Optional[Hook]) -> None:
        """The write hook engine this set is attached to (None: detached); it calls this."""
        self._hook = hook

    def _admitting(self) -> tuple[Optional[Admitter], OtherMemory]:
        """The compiled write hook this set is published to, and what the other guards on it
        protect (kept while a step is admitted); None where there is none."""
        hook = self._hook
        if hook is None or not hasattr(hook.backend, "admit"):
            return None, ([], [])
        intervals: list[tuple[int, int]] = []
        identities: list[int] = []
        for judge in hook.judges:
            if judge.protected is not self:
                intervals += judge.protected.intervals()
                identities += judge.protected.identities()
        return cast(Admitter, hook.backend), (intervals, identities)

    def end_step(self, step: StepSet) -> None:
        """The step is done: its entries are protected again, from their values now."""
        if step in self._active:
            self._active.remove(step)
        given, step.given = step.given, None
        if not step.entries:
            return
        restored = step.admitted and step.backend is not None and bool(step.backend.admit(None))
        step.admitted, step.backend = False, None
        if step.table is not None and (step.holding or not self._fingerprint):
            self._step_refresh(step, report=False, tensors=given)  # digests (and memory) as the step left them
        else:
            self.explain(step.entries)
        if not restored:
            self._rebuild_index()

    def _forget_steps(self) -> None:
        """Let the step sets go (their entries changed): the digests they hold go back first."""
        self._reclaim()
        for step in self._step_sets.values():
            if step not in self._active and step.table is not None:
                step.table.clear()  # its weak references go now (`swap_tensors` refuses them)
                step.table = None
        self._step_sets = {}
        self._step_hints = {}

    def explain(self, entries: list[Entry], settled: bool = True) -> None:
        self._reclaim(entries)
        super().explain(entries, settled)

    def drifted(self, entries: list[Entry]) -> list[Entry]:
        self._reclaim(entries)
        return super().drifted(entries)

    def release(self, tensors: tuple[torch.Tensor, ...]) -> Callable[[], None]:
        self._forget_steps()  # the tables' weak references too
        for step in self._active:
            if step.table is not None:
                step.table.clear()
                step.table = None
        return super().release(tensors)

    def close(self) -> None:
        for step in self._active:
            if step.admitted and step.backend is not None:
                step.backend.admit(None)
                step.admitted, step.backend = False, None
        self._forget_steps()
        self._active.clear()
        self._later = DeviceComparisons()
        super().close()

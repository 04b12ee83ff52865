"""A model's weights as a protected set: `guard_module`'s tensors, and the writes a trainer means.

Every parameter and buffer of the guarded modules, named as `named_parameters()` and
`named_buffers()` print them under the guard's name (`model.layers.0.mlp.weight`). Writes
a trainer means are not reported:

- inside an optimizer's `step()` (`begin_step`: the step's parameters leave the write
  hook's memory for the step, so its writes cost nothing, then their digests start again;
  they are compared first, so that what changed since the last step is not absorbed). A
  step's parameters are known before it runs: with the compiled extension loaded they are
  rows of a C++ table (`StepSet`), compared and digested in one C++ pass each, and the
  write hook admits the step's writes in C++ (`write_hook.admit`): no Python per parameter;
- inside `load_state_dict` of a guarded module (it exists to write weights);
- a module's own `forward` updating its own buffers (batch norm's running statistics), or
  its forward hooks doing so (the classic `spectral_norm`'s `weight_u`, `weight_v`), and
  one of torch.nn's modules updating its own parameters (an Embedding with `max_norm`);
- DistributedDataParallel's own broadcasts of the guarded module's buffers and parameters.

The last three are read from the stack of the writing op, which only a write that hits
protected memory pays for.
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

import torch

from kvguard import _torch
from kvguard._protect import digest as _digest
from kvguard._protect import records as _records
from kvguard._protect.collector import collector_paused
from kvguard._protect.entries import Change, Entry
from kvguard._protect.protected import ProtectedSet
from kvguard._protect.records import DIGEST, LAYOUT

# Functions whose writes to a guarded module's weights are its own (any module of the guarded tree).
_LOADING = frozenset({"load_state_dict", "_load_from_state_dict", "load_weights"})  # torch's, vLLM's
# How far up from the judge `_own_write` looks for the writing module's `forward` (the hook's
# own frames, then the op's callers: torch.nn.functional.batch_norm, BatchNorm's forward).
_OWN_DEPTH = 12


class _Root(NamedTuple):
    name: str
    ref: Any  # weakref.ref to the module (or the loose parameter)
    holders: Optional[set[Any]]


class ModuleSet(ProtectedSet):
    """The parameters and buffers of `modules` (name, module), protected as entries."""

    lets_go_of_what_left = False  # a module's weights are its own: what it held stays protected
    holds_weights = True  # a blocked write's hint names the optimizer step

    def __init__(self, modules: Sequence[tuple[str, torch.nn.Module]], fingerprint: bool = True) -> None:
        # (name, module, holders) of each guarded module, and of each parameter no named module
        # holds: holders are the optimizers (their keys) it is protected for, None for the
        # guard's life. Holders let go wait in `_released` (a finalizer may run on any thread).
        self._roots: list[_Root] = [_Root(n, weakref.ref(m), None) for n, m in modules]
        self._loose: list[_Root] = []
        self._released: list[Any] = []
        # id(entry) -> the module whose own forward may write it: a buffer's module; a parameter's
        # when that module is one of torch.nn's (an Embedding with max_norm renormalises its weight)
        self._owner: dict[int, weakref.ref[torch.nn.Module]] = {}
        self._active: list[StepSet] = []  # the optimizer steps running now
        self._holding: list[StepSet] = []  # the step sets whose tables hold their entries' digests
        self._guarded_modules: set[int] = set()  # ids of every module of the guarded trees
        self._step_sets: dict[tuple[int, ...], StepSet] = {}  # a step's parameters (ids) -> what it writes
        self._hook: Any = None  # the write hook this set is attached to (`attach_hook`), where one is
        # Level "light" (no op is seen): the buffers that their modules update themselves are
        # taken again at each comparison, not compared (`_absorb_own_updates`).
        self.light = False
        # Level "full": entries an intended write (batch norm's forward, a load) is writing, whose
        # digests are taken again once it is done (at the next write looked at, step or boundary);
        # and what changed in them, with no op reporting it, before that write would absorb it.
        self._pending: dict[int, Entry] = {}
        self._early: list[Change] = []
        self._later = DeviceComparisons()  # such comparisons on a device, read at the next boundary
        # id(tensor) -> (entry, data_ptr) of each buffer that only its own entry's memory holds and
        # that a module may update in its own forward: the writes `_own_write` decides without
        # the memory index or the whole stack (None: made again at the next write, from the index).
        self._own_writes: Optional[dict[int, tuple[Entry, int]]] = None
        self._own_groups: dict[int, tuple[Any, list[Entry]]] = {}
        super().__init__([], modules[0][0] if modules else "model", None, (), fingerprint=fingerprint)

    # -- entries ---------------------------------------------------------------------

    def _named_tensors(self) -> list[tuple[str, torch.Tensor, Optional[torch.nn.Module]]]:
        """(path, tensor, the module whose forward may write it, if any) of every module's parameters
        and buffers, each tensor once."""
        found: list[tuple[str, torch.Tensor, Optional[torch.nn.Module]]] = []
        seen: set[int] = set()
        modules: set[int] = set()
        for name, ref, _ in self._roots:
            root = ref()
            if root is None:
                continue
            for prefix, module in root.named_modules(prefix=name):
                modules.add(id(module))
                own_params = type(module).__module__.startswith("torch.nn.")
                for pname, param in module.named_parameters(recurse=False):
                    if id(param) not in seen:
                        seen.add(id(param))
                        found.append((f"{prefix}.{pname}", param, module if own_params else None))
                for bname, buf in module.named_buffers(recurse=False):
                    if buf is not None and id(buf) not in seen:
                        seen.add(id(buf))
                        found.append((f"{prefix}.{bname}", buf, module))
        for path, loose, _ in self._loose:
            tensor = loose()
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                found.append((path, tensor, None))
        self._guarded_modules = modules
        return found

    def add(self, modules: Sequence[tuple[str, torch.nn.Module]], loose: Sequence[tuple[str, torch.Tensor]] = (),
            holder: Any = None) -> None:
        """Protect more modules (and parameters no module holds) from now on, for `holder` (an
        optimizer's key: until `holder_gone(holder)`; None: for the guard's life)."""
        for name, obj in modules:
            self._hold(self._roots, name, obj, holder)
        for path, tensor in loose:
            self._hold(self._loose, path, tensor, holder)
        with collector_paused():
            self._scan_now(None)

    @staticmethod
    def _hold(roots: list[_Root], name: str, obj: Any, holder: Any) -> None:
        for i, root in enumerate(roots):
            if root.ref() is obj:
                if holder is None:
                    roots[i] = root._replace(holders=None)
                elif root.holders is not None:
                    root.holders.add(holder)
                return
        roots.append(_Root(name, weakref.ref(obj), None if holder is None else {holder}))

    def holder_gone(self, holder: Any) -> None:
        """`holder` is gone (an optimizer freed): what only it held is let go at the next look."""
        self._released.append(holder)
        self._dirty = True

    def _drop_released_holders(self) -> None:
        released = set(self._released)
        del self._released[: len(released)]
        for roots in (self._roots, self._loose):
            for root in roots:
                if root.holders is not None:
                    root.holders.difference_update(released)
            roots[:] = [r for r in roots if r.holders is None or r.holders]
        self._scan_now(None)

    def _scan_now(self, frames: Optional[list[Any]]) -> None:
        """Every parameter and buffer as the modules hold them now: new ones protected, replaced ones let go."""
        self._dirty = False
        self._forget_steps()
        self._drop_dead()
        named = self._named_tensors()
        entries = self._entries
        kept = {id(t) for _, t, _ in named}
        for key in [k for k in entries if k not in kept]:  # a parameter the module no longer holds
            self._owner.pop(id(entries.pop(key)), None)
        new = [(path, t, owner) for path, t, owner in named
               if (e := entries.get(id(t))) is None or e.ref() is not t]
        if new:
            records = self._records_of([t for _, t, _ in new])
            for (path, tensor, owner), record in zip(new, records):
                entry = entries[id(tensor)] = Entry(path, record, weakref.ref(tensor, self._on_death), None)
                if owner is not None:
                    self._owner[id(entry)] = weakref.ref(owner)
            self.protected_count += len(new)
        for path, tensor, _ in named:  # a renamed or re-registered module: its path as it is now
            known = entries.get(id(tensor))
            if known is not None and known.path != path:
                known.path = path
        self._rebuild_index()

    def _drop_dead(self) -> bool:
        dropped = super()._drop_dead()
        if dropped:
            self._forget_steps()  # keyed by the ids of tensors, one of which died
            self._own_writes = None
        return dropped

    def _rebuild_index(self, added: Optional[list[Entry]] = None) -> None:
        self._own_writes = None  # the memory changed: which buffers hold their memory alone, read again
        super()._rebuild_index(added)

    def look(self) -> None:
        if self._released:
            with collector_paused():
                self._drop_released_holders()
        elif self._dirty:
            self._forget_dead()

    def settle(self) -> None:
        """Paths are the modules' names, kept current by each scan."""

    def boundary_changes(self, caller: Optional[types.FrameType], rescan: bool = True) -> list[Any]:
        """At a boundary the modules are read again (a parameter replaced or added), then compared."""
        self._reclaim()
        with collector_paused():
            self._scan_now(None)
        self._settle()
        self._absorb_own_updates()
        found = super().boundary_changes(caller, rescan=False)
        early, self._early = self._early, []
        later = [Change(e, t, "values", None, None) for e in self._later.collect() if (t := e.ref()) is not None]
        return early + later + found

    def _compare_soon(self, live: list[tuple[Entry, torch.Tensor]],
                      records: Optional[list[_records.Record]] = None) -> tuple[list[Change], bool]:
        """`ProtectedSet._compare` without a host synchronisation: digests kept on a device are
        compared there and read at the next boundary (`DeviceComparisons`), which syncs anyway;
        the others now. Every entry's digest then starts again from its values now. `records`:
        the live tensors' records, read already."""
        if records is None:
            records = self._records_of([t for _, t in live])
        now_host: list[tuple[Entry, torch.Tensor, Any]] = []
        on_device: dict[Any, list[tuple[Entry, Any, Any]]] = {}
        moved = False
        for (entry, tensor), record in zip(live, records):
            was, now = entry.digest, record[DIGEST]
            if not (isinstance(was, torch.Tensor) and isinstance(now, torch.Tensor) and was.device == now.device):
                now_host.append((entry, tensor, record))
                continue
            if not entry.explained:  # (an explained change is no finding: its digest only starts again)
                on_device.setdefault(now.device, []).append((entry, was, now))
            if record[LAYOUT] != entry.record[LAYOUT]:
                entry.record, moved = record, True  # follow it to its memory now
            entry.digest, entry.explained = now, False
        for triples in on_device.values():
            self._later.add([e for e, _, _ in triples], [w for _, w, _ in triples], [n for _, _, n in triples])
        if not now_host:
            return [], moved
        found, host_moved = self._compare_records([(e, t) for e, t, _ in now_host], [r for _, _, r in now_host])
        return found, moved or host_moved

    def _settle(self, intended: Sequence[Entry] = ()) -> None:
        """The intended writes looked at so far are done: their entries' digests start again from
        now (and their memory is followed, as `explain` does).

        Then `intended`, entries that an intended write (batch norm's forward, a load) is about
        to change: what changed in them since their digests, with no op reporting it, is found
        now (`_early`: the write would hide it), and their digests are taken again once it is
        done (at the next call). Both from one description of their tensors (`records.describe`).
        """
        pending = self._pending
        if not pending and not intended:
            return
        fingerprint = self._fingerprint
        if self._holding:  # first: a step table gives back their digests and marks
            self._reclaim([*pending.values(), *intended])
        done = [(e, t) for e in pending.values() if (t := e.ref()) is not None]
        fresh = [(e, t) for e in intended if id(e) not in pending and not e.explained
                 and (t := e.ref()) is not None] if fingerprint else []
        pending.clear()
        records = self._records_of([t for _, t in done] + [t for _, t in fresh]) if done or fresh else []
        moved = False
        for (entry, _), record in zip(done, records):
            if record[LAYOUT] != entry.record[LAYOUT]:
                entry.record, moved = record, True  # the write moved it (a sparse `add_` reallocates)
            if fingerprint:
                entry.digest = record[DIGEST]
            entry.explained = not fingerprint
        if fresh:
            rest: list[tuple[tuple[Entry, torch.Tensor], _records.Record]] = []
            for (entry, tensor), record in zip(fresh, records[len(done):]):
                was, now = entry.digest, record[DIGEST]
                if type(was) is int and type(now) is int and record[LAYOUT] == entry.record[LAYOUT]:
                    if was != now:  # host digests where the tensor was: `_compare_soon`'s common case
                        self._early.append(Change(entry, tensor, "values", was, now))
                    entry.digest = now
                else:
                    rest.append(((entry, tensor), record))
            if rest:
                found, fresh_moved = self._compare_soon([p for p, _ in rest], [r for _, r in rest])
                self._early += found
                moved = moved or fresh_moved
        if moved:
            self._rebuild_index()
        for entry in intended:
            entry.explained = True  # until the next `_settle`: a boundary check meanwhile does not count it
            pending[id(entry)] = entry

    def _absorb_own_updates(self) -> None:
        """Level "light": the buffers a module updates in its own forward or its hooks (batch norm's
        statistics, spectral norm's `weight_u`, a quantization observer's range) may have changed
        in any forward since the last comparison, which this level cannot see: their digests start
        again, with no report. Other buffers and every parameter are compared."""
        if not self.light:
            return
        from kvguard import _torch

        own = []
        for entry in self._entries.values():
            ref = self._owner.get(id(entry))
            owner = ref() if ref is not None else None
            tensor = entry.ref()
            if owner is not None and tensor is not None and not isinstance(tensor, torch.nn.Parameter) \
                    and _torch.updates_own_buffers(owner):
                own.append(entry)
        if own:
            with collector_paused():
                self.explain(own)

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
    #
    # Per step: `step_set(params)` (the step's entries, kept while they stay as they are),
    # `step_changes(step)` (what changed since the last step), `begin_step(step)` and
    # `end_step(step)`. With a step set's table (`StepSet.table`) the entries' digests live in
    # the table from its first step on (`_take`), and come back to the entries whenever
    # Python code reads or sets them (`_reclaim`: a boundary, a write that hits them).

    def step_set(self, tensors: Sequence[torch.Tensor]) -> StepSet:
        """What a step of an optimizer over `tensors` writes: their entries and the entries that
        share their memory (a buffer aliasing a parameter); made once per optimizer while the
        entries stay as they are (a rescan or a death forgets it)."""
        if self._released or self._dirty:
            self.look()
        key = tuple(map(id, tensors))
        step = self._step_sets.get(key)
        if step is None:
            entries = self._step_entries(tensors)
            step = self._step_sets[key] = StepSet(entries, self._step_table(entries))
        return step

    def _step_entries(self, tensors: Iterable[torch.Tensor]) -> list[Entry]:
        params = [e for t in tensors if (e := self.entry_of(t)) is not None]
        self._memory.ensure(self._entries.values())
        found = {id(e): e for e in params}
        for entry in params:
            tensor = entry.ref()
            if tensor is not None:
                found.update((id(e), e) for e in self._memory.hits(tensor))
        return list(found.values())

    def _step_table(self, entries: list[Entry]) -> Any:
        """A `write_hook.Table` of `entries`' tensors, row i for entry i; None where the compiled
        extension is not loaded or a tensor is not plain host memory (Python compares those)."""
        from kvguard._protect.native import table_module

        module = table_module()
        tensors = [e.ref() for e in entries]
        if module is None or not tensors or any(t is None for t in tensors):
            return None
        table = module.Table(_torch.PLAIN, self._fingerprint)
        first, again, python = table.add(tensors)
        if first != 0 or again or python or len(table) != len(entries):
            table.clear()
            return None
        return table

    def step_changes(self, step: StepSet) -> list[Change]:
        """What changed, with no op reporting it, in what a step is about to write: the step takes
        their digests again when it is done, so a change made since the last one (a numpy
        view, a raw pointer) is found now or never."""
        if not self._fingerprint:
            return []
        self._settle()
        self._absorb_own_updates()
        if step.table is not None and self._take(step):
            found = self._step_refresh(step, report=True)
        else:
            with collector_paused():
                found, moved = self._compare_soon([(e, t) for e in step.entries if (t := e.ref()) is not None])
            if moved:
                self._rebuild_index()
        early, self._early = self._early, []
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
                for entry, digest in zip(step.entries, step.table.digests()):
                    entry.digest, entry.explained = digest, False

    def _step_refresh(self, step: StepSet, report: bool) -> list[Change]:
        """One C++ pass over the step's table: digests compared (`report`: what changed is
        returned) and taken again, and memory followed (`ProtectedSet._compare_records`)."""
        changed, moved, python = step.table.refresh(None, self._fingerprint)
        entries = step.entries
        found = [Change(entries[row], t, "values", was, now) for row, was, now in changed
                 if (t := entries[row].ref()) is not None] if report else []
        if moved or python:
            for row, old in moved:
                entry, tensor = entries[row], entries[row].ref()
                if tensor is None:
                    continue
                record = step.table.record(row)
                if report and (old[DIGEST] is None or record[DIGEST] is None):
                    found.append(Change(entry, tensor, "memory", _records.layout_text(old),
                                        _records.tensor_text(tensor)))
                entry.record = _records.describe([tensor], False, self._compiled)[0] if python else record
            self._forget_steps()  # the next step makes its set anew, from the entries as they are now
            self._rebuild_index()
        return found

    def begin_step(self, step: StepSet) -> StepSet:
        """An optimizer step starts: what it writes steps aside until `end_step` (admitted by the
        write hook in C++ where it can, else left out of what is published). A step inside
        another (ZeroRedundancyOptimizer's step() steps its inner optimizer) is the same step."""
        if not self._active:
            self.steps += 1
        self._active.append(step)
        if not step.entries:
            return step
        backend, kept = self._admitting() if step.table is not None else (None, ([], []))
        step.admitted = backend is not None and bool(backend.admit(step.table, *kept))
        step.backend = backend if step.admitted else None
        if not step.admitted:
            self._rebuild_index()  # the write hook no longer compares their memory
        return step

    def attach_hook(self, hook: Any) -> None:
        """The write hook engine this set is attached to (None: detached); it calls this."""
        self._hook = hook

    def _admitting(self) -> tuple[Any, tuple[list[tuple[int, int]], list[int]]]:
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
        return hook.backend, (intervals, identities)

    def end_step(self, step: StepSet) -> None:
        """The step is done: its entries are protected again, from their values now."""
        if step in self._active:
            self._active.remove(step)
        if not step.entries:
            return
        restored = step.admitted and bool(step.backend.admit(None))
        step.admitted, step.backend = False, None
        if step.table is not None and (step.holding or not self._fingerprint):
            self._step_refresh(step, report=False)  # digests (and memory) as the step left them
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

    def written_entries(self, written: Sequence[torch.Tensor], kind: str, resizes: bool = False) -> list[Entry]:
        if kind == "write" and not (resizes or self._released or self._dirty or self._active) \
                and self._own_write(written, sys._getframe(1)):
            return []
        if self._pending:
            self._settle()  # the write looked at before this one is done
        hit = super().written_entries(written, kind, resizes)
        if self._active:
            hit = [e for e in hit if not self._stepping(e)]
        if not hit:
            return hit
        intended = self._intended(hit, sys._getframe(1))
        if intended:
            self._settle(intended)
        return [e for e in hit if e not in intended]

    def _own_write(self, written: Sequence[torch.Tensor], frame: Optional[types.FrameType]) -> bool:
        """Whether `written` are buffers of the module whose `forward` runs nearest on the stack
        (batch norm's statistics, in each training forward), each in memory no other entry
        shares: then the write is intended, as `_intended` would find, decided here from what
        `_own_candidates` made once per index and a few frames, without the memory index or
        the whole stack. False: the full path decides (a view, another module's forward, a
        hook, a tensor moved with no op seen: anything else).

        Digests as for any intended write (`_settle`), once per forward: its first write checks
        every buffer of the module that this path covers, and leaves them all pending, so the
        forward's later writes (`batch_norm` after `num_batches_tracked.add_(1)`) cost no read.
        """
        own = self._own_writes
        if own is None:
            own = self._own_candidates()
        if not own:
            return False
        for tensor in written:
            item = own.get(id(tensor))
            # The tensor itself, where its memory was (moved with no op seen: the full path follows it).
            if item is None or item[0].ref() is not tensor or tensor.data_ptr() != item[1]:
                return False
        for _ in range(_OWN_DEPTH):  # the op's caller, and its callers: the nearest `forward`
            if frame is None:
                return False
            code = frame.f_code
            if code.co_name == "forward" and code.co_argcount and code.co_varnames[0] == "self":
                break
            frame = frame.f_back
        else:
            return False
        owner = frame.f_locals.get("self")
        group = self._own_groups.get(id(owner))
        if group is None or group[0]() is not owner:
            return False  # not a module of the guarded trees holding buffers: the full path walks on
        held = group[1]
        pending = self._pending
        first = False
        for tensor in written:
            entry = own[id(tensor)][0]
            if entry not in held:
                return False  # another module's buffer: the full path decides
            first = first or id(entry) not in pending
        if first:
            self._settle(held)  # the pending writes done; this module's buffers checked, then pending
        return True

    def _own_candidates(self) -> dict[int, tuple[Entry, int]]:
        """id(tensor) -> (entry, its data pointer) of the buffers `_own_write` may pass: plain host
        tensors held as a buffer by a module of the guarded trees, in memory no other entry
        shares (a write to one touches its entry alone); and per such module (`_own_groups`),
        its weak reference and the entries of those it holds."""
        memory = self._memory
        memory.ensure(self._entries.values())
        found: dict[int, tuple[Entry, int]] = {}
        groups: dict[int, tuple[Any, list[Entry]]] = {}
        seen: set[int] = set()
        for _, ref, _ in self._roots:
            root = ref()
            for module in root.modules() if root is not None else ():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                held: list[Entry] = []
                for tensor in _own_buffers(module):
                    entry = self.entry_of(tensor)
                    if entry is None or type(tensor) is not torch.Tensor:
                        continue
                    try:
                        if id(tensor) not in found:
                            if tensor.device.type != "cpu" or tensor.is_inference() or memory.hits(tensor) != [entry]:
                                continue
                            found[id(tensor)] = (entry, tensor.data_ptr())
                    except Exception:  # noqa: BLE001 - a tensor that refuses a read: the full path judges it
                        continue
                    held.append(entry)
                if held:
                    groups[id(module)] = (weakref.ref(module), held)
        self._own_writes, self._own_groups = found, groups
        return found

    def _intended(self, hit: list[Entry], frame: Optional[types.FrameType]) -> list[Entry]:
        """The entries of `hit` that the code on the stack owns the right to write."""
        from torch.nn.parallel import DistributedDataParallel

        owners = {id(e): ref() for e in hit if (ref := self._owner.get(id(e))) is not None}
        modules = self._guarded_modules
        intended: list[Entry] = []
        while frame is not None and len(intended) < len(hit):
            code = frame.f_code
            if code.co_argcount and code.co_varnames[0] == "self":
                # `type()`, never `isinstance`: a `self` may refuse every attribute read (`__class__`)
                owner = frame.f_locals.get("self")
                name = code.co_name
                if id(owner) in modules and name in _LOADING:
                    return hit  # load_state_dict of a guarded module: every write is its own
                if id(owner) in modules and name == "_apply" and _is_conversion(frame):
                    return hit  # a conversion (`to`, `half`) re-points with `.data =`; `converting` follows
                if issubclass(type(owner), DistributedDataParallel) and id(getattr(owner, "module", None)) in modules:
                    return hit  # DDP's broadcast of the module's buffers and parameters
                if name == "forward" and owner is not None:
                    own = _own_buffers(owner)
                    intended += [e for e in hit if e not in intended and (owners.get(id(e)) is owner or any(
                        _torch.same_elements(b, e.ref()) for b in own))]
                elif name == "_call_impl" and owner is not None:  # its hooks: spectral_norm's power iteration
                    intended += [e for e in hit if e not in intended and owners.get(id(e)) is owner
                                 and not isinstance(e.ref(), torch.nn.Parameter)]
            frame = frame.f_back
        return intended

    def converting(self, module: torch.nn.Module, fn: Any) -> Callable[[], list[Change]]:
        """`module._apply(fn)` starts; returns what to call once it is done, which says what changed.

        It re-points the weights with `p.data = ...`. One of Module's own conversions (`to`,
        `half`, `cpu`...) is a write the trainer means: the entries follow their memory and
        values. `to_empty` leaves uninitialised memory: every weight that held values is a
        change. Any other function is judged by values: a weight whose dtype and device stay
        and whose values differ is a change.
        """
        from kvguard import _torch

        if id(module) not in self._guarded_modules:
            return list
        self._forget_steps()  # every digest back in its entry; no weak reference of a table left
        kind = _torch.module_apply_kind(fn)
        # path -> dtype, device, meta, digest; and the entry with its own digest then: an op that
        # reports its write on the way (`.data =` at level "full") moves it: not reported twice.
        before: dict[str, tuple[Any, Any, bool, Any, Entry, Any]] = {}
        if kind != "conversion":
            with collector_paused():
                self._settle()
                entries = self._entries_of(module)
                tensors = [e.ref() for e in entries]
                for entry, tensor, digest in zip(entries, tensors, _digest.digests(tensors)):
                    if tensor is not None:
                        before[entry.path] = (tensor.dtype, tensor.device, tensor.is_meta, digest, entry,
                                              entry.digest)

        def after() -> list[Change]:
            with collector_paused():
                self._scan_now(None)
                entries = self._entries_of(module)
                found = []
                if kind != "conversion":
                    live = [(e, t) for e in entries if (t := e.ref()) is not None]
                    now = _digest.digests([t for _, t in live])
                    for (entry, tensor), digest in zip(live, now):
                        was = before.get(entry.path)
                        if was is None or was[2] or (entry is was[4] and entry.digest is not was[5]):
                            continue  # new, a meta tensor (no values to lose), or reported at its op
                        if kind == "empty" or ((tensor.dtype, tensor.device) == was[:2]
                                               and not _digest.same_all([was[3]], [digest])[0]):
                            found.append(Change(entry, tensor, "values", was[3], digest))
                self.explain(entries)  # the entries follow their memory and values from now on
            return found
        return after

    def converted(self, module: torch.nn.Module) -> None:
        """`module` was loaded (`load_state_dict`, seen so at level "light"): a write the trainer
        means. Its entries follow their memory and values from now on."""
        if id(module) not in self._guarded_modules:
            return
        with collector_paused():
            self._scan_now(None)
            self.explain(self._entries_of(module))

    def _entries_of(self, module: torch.nn.Module) -> list[Entry]:
        """The entries of `module`'s parameters and buffers, its submodules' included."""
        tensors = {id(t) for _, m in module.named_modules() for t in (*m.parameters(recurse=False),
                                                                         *m.buffers(recurse=False))}
        return [e for e in self._entries.values() if id(e.ref()) in tensors]

    def close(self) -> None:
        for step in self._active:
            if step.admitted:
                step.backend.admit(None)
                step.admitted, step.backend = False, None
        self._forget_steps()
        self._active.clear()
        self._pending.clear()
        self._early = []
        self._later = DeviceComparisons()
        self._owner.clear()
        self._roots = []
        super().close()


class StepSet:
    """What one optimizer's step writes: its parameters' entries and the entries sharing their
    memory, kept from step to step while the entries stay as they are.

    `table`: the compiled extension's `write_hook.Table` of their tensors (row i for entry i),
    or None (not loaded, or a tensor Python must describe). With it, the comparison before
    a step and the digests after it are one C++ pass each, the table holding the digests
    between steps (`holding`), and the write hook admits the step's writes in C++
    (`admitted`, by `backend`) rather than have Python see each one.
    """

    __slots__ = ("admitted", "backend", "entries", "holding", "ids", "table")

    def __init__(self, entries: list[Entry], table: Any) -> None:
        self.entries = entries
        self.ids = frozenset(map(id, entries))
        self.table = table
        self.holding = False
        self.admitted = False
        self.backend: Any = None


def _own_buffers(obj: Any) -> list[torch.Tensor]:
    """The buffers a module holds itself: its own forward may update them (batch norm's
    statistics), whichever module they were guarded under (`load_state_dict(state,
    assign=True)` puts the loaded tensors, views of the first module's, into the new one)."""
    if not issubclass(type(obj), torch.nn.Module):
        return []
    try:
        buffers = object.__getattribute__(obj, "__dict__").get("_buffers") or {}
        return [b for b in buffers.values() if b is not None]
    except Exception:  # noqa: BLE001 - a module that refuses attribute reads owns nothing here
        return []


def _is_conversion(frame: types.FrameType) -> bool:
    """Whether the `Module._apply` running in `frame` converts dtype or device: one of Module's own
    conversions, or a caller's function whose result has another dtype or device (`to_empty`,
    or a function that keeps both, is not: its values are new)."""
    from kvguard import _torch

    local = frame.f_locals
    kind = _torch.module_apply_kind(local.get("fn"))
    if kind != "other":
        return kind == "conversion"
    old, new = local.get("param"), local.get("param_applied")
    try:
        return old is not None and new is not None and (old.dtype, old.device) != (new.dtype, new.device)
    except Exception:  # noqa: BLE001 - not tensors: not a conversion we can tell
        return False


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

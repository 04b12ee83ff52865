"""The writes to a model's weights that a trainer means, recognised from the writing op's stack.

Not reported: inside a load (`weights_loads`: `load_weights` and a rollout engine's
weight-update entry points, entered by activation; `load_state_dict` of a guarded module,
found on the stack), the writes to the weights of the modules it loads, except one to an
element the same load wrote already (`written_twice`: it overwrites what the load just
loaded; a tensor the module holds under two names, a tied embedding, is written once per
name and is no such write); a
module's own `forward` updating its own buffers (batch norm's running statistics), or its
forward hooks doing so (the classic `spectral_norm`'s `weight_u`, `weight_v`); one of
torch.nn's modules updating its own parameters (an Embedding with `max_norm`);
DistributedDataParallel's own broadcasts of the guarded module's buffers and parameters;
Module's own conversions (`to`, `half`). Only a write that hits protected memory pays for
reading the stack, and batch norm's writes in each forward take a shorter path
(`_own_write`). What changed in an entry before an intended write would absorb it is found
first (`_settle`), as a finding of its own.
"""

from __future__ import annotations

import os
import sys
import types
import weakref
from typing import Callable, Optional, Sequence

import torch

from kvguard._protect import digest as _digest
from kvguard._protect.collector import collector_paused
from kvguard._protect.contract import Added
from kvguard._protect.entries import Change, Entry
from kvguard._protect import frames as _frames
from kvguard._protect import weights_loads as _loads
from kvguard._protect.records import Record
from kvguard._protect.weights_received import ReceivedSet
from kvguard._report.events import WRITTEN_TWICE, EventKind
from kvguard._torch import patches as _patches
from kvguard._torch import tensors as _tensors
from kvguard._torch import training as _training

# Functions whose writes to a guarded module's weights are its own (any module of the guarded tree).
_LOADING = frozenset({"load_state_dict", "_load_from_state_dict", "load_weights"})  # torch's, vLLM's
_STATE_DICT = frozenset({"load_state_dict", "_load_from_state_dict"})
TWICE_DIFF = ("{load} wrote these elements already ({first}); this write overwrites what the load had just "
              "loaded")
TWICE_FIX = ("a load writes each weight once: do not copy back what was saved before it (a buffer that views a "
             "weight is stale then); a post-load transform meant to rewrite the weights goes in a kvguard.allow('why') "
             "block")
# How far up from the judge `_own_write` looks for the writing module's `forward` (the hook's
# own frames, then the op's callers: torch.nn.functional.batch_norm, BatchNorm's forward).
_OWN_DEPTH = 12


class IntendedWritesSet(ReceivedSet):
    """A stepping set that lets through the writes its modules' own code means (`weights.ModuleSet`'s middle layer)."""

    def __init__(self, name: str, fingerprint: bool) -> None:
        # id(entry) -> the module whose own forward may write it: a buffer's module; a parameter's
        # when that module is one of torch.nn's (an Embedding with max_norm renormalises its weight)
        self._owner: dict[int, weakref.ref[torch.nn.Module]] = {}
        self._guarded_modules: set[int] = set()  # ids of every module of the guarded trees
        # Level "light" (no op is seen): the buffers that their modules update themselves are
        # taken again at each comparison, not compared (`_absorb_own_updates`).
        self.light = False
        # Level "full": entries an intended write (batch norm's forward, a load) is writing, whose
        # digests are taken again once it is done (at the next write looked at, step or boundary);
        # and what changed in them, with no op reporting it, before that write would absorb it.
        self._pending: dict[int, Entry] = {}
        self._early: list[Change] = []
        # id(tensor) -> (entry, data_ptr) of each buffer that only its own entry's memory holds and
        # that a module may update in its own forward: the writes `_own_write` decides without
        # the memory index or the whole stack (None: made again at the next write, from the index).
        self._own_writes: Optional[dict[int, tuple[Entry, int]]] = None
        self._own_groups: dict[int, tuple[weakref.ref[torch.nn.Module], list[Entry]]] = {}
        # ids of the tensors a guarded module holds under several names (a tied embedding): a load
        # writes them once per name
        self._tied: set[int] = set()
        # id(entry) -> (kind, why) of the findings of this set's own in the writes just judged
        # (`written_twice`), read once by the judge (`findings`)
        self._notes: dict[int, tuple[EventKind, str]] = {}
        super().__init__(name, fingerprint)
        # A load_state_dict's writes are one load until its outermost call returns.
        self._unlisten_loads = _patches.on_load_state_dict(_loads.state_dict_loaded)

    def _root_modules(self) -> list[torch.nn.Module]:
        """The guarded modules, each the root of a tree (`weights.ModuleSet`'s)."""
        return []

    def _rebuild_index(self, added: Added = None) -> None:
        self._own_writes = None  # the memory changed: which buffers hold their memory alone, read again
        super()._rebuild_index(added)

    def _before_comparing(self) -> list[Change]:
        self._settle()
        self._absorb_own_updates()
        early, self._early = self._early, []
        return early

    def written_entries(self, written: Sequence[torch.Tensor], kind: str, resizes: bool = False) -> list[Entry]:
        if kind == "write" and not (resizes or self._must_look() or self._active) \
                and self._own_write(written, sys._getframe(1)):
            return []
        if self._pending:
            self._settle()  # the write looked at before this one is done
        hit = super().written_entries(written, kind, resizes)
        if self._active:
            hit = [e for e in hit if not self._stepping(e)]
        if not hit:
            return hit
        intended, load = self._intended(hit, sys._getframe(1))
        if load is not None and intended and kind == "write":
            twice = self._written_twice(load, intended, written)
            if twice:
                intended = [e for e in intended if e not in twice]
        if intended:
            self._settle(intended)
        return [e for e in hit if e not in intended]

    def _written_twice(self, load: _loads.Load, intended: list[Entry], written: Sequence[torch.Tensor]) -> list[Entry]:
        """Of the entries `load` writes now, those whose elements it wrote already; each noted as a
        `written_twice` finding for the judge (`findings`). A tied tensor is written once per name."""
        here = _frames.first_user_line(sys._getframe(2))
        where = f"{os.path.basename(here[0])}:{here[1]}" if here is not None else "?"
        first = load.wrote(written, where)
        if first is None:
            return []
        twice = [e for e in intended if id(e.ref()) not in self._tied]
        why = TWICE_DIFF.format(load=load.said, first=f"at {first}" if first != where else "at this line")
        for entry in twice:
            self._notes[id(entry)] = (WRITTEN_TWICE, why)
        return twice

    def findings(self, hit: Sequence[Entry]) -> tuple[dict[int, tuple[EventKind, str]], dict[int, str]]:
        """The judge asks, for the entries a write hit: this set's own findings on them (kind, why),
        and the fix a stopped write's hint says, by entry."""
        found, fixes = super().findings(hit)
        notes = self._notes
        for entry in hit:
            note = notes.pop(id(entry), None)
            if note is not None:
                found[id(entry)] = note
                fixes[id(entry)] = TWICE_FIX
        return found, fixes

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
            if record.layout != entry.record.layout:
                entry.record, moved = record, True  # the write moved it (a sparse `add_` reallocates)
            if fingerprint:
                entry.digest = record.digest
            entry.explained = not fingerprint
        if fresh:
            rest: list[tuple[tuple[Entry, torch.Tensor], Record]] = []
            for (entry, tensor), record in zip(fresh, records[len(done):]):
                was, now = entry.digest, record.digest
                if type(was) is int and type(now) is int and record.layout == entry.record.layout:
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
        own = []
        for entry in self._entries.values():
            ref = self._owner.get(id(entry))
            owner = ref() if ref is not None else None
            tensor = entry.ref()
            if owner is not None and tensor is not None and not isinstance(tensor, torch.nn.Parameter) \
                    and _training.updates_own_buffers(owner):
                own.append(entry)
        if own:
            with collector_paused():
                self.explain(own)

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
        groups: dict[int, tuple[weakref.ref[torch.nn.Module], list[Entry]]] = {}
        seen: set[int] = set()
        for root in self._root_modules():
            for module in root.modules():
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

    def _intended(self, hit: list[Entry], frame: Optional[types.FrameType]
                  ) -> tuple[list[Entry], Optional[_loads.Load]]:
        """The entries of `hit` that the code running owns the right to write, and the load they
        belong to (if a load writes them). A received tensor is never a write meant."""
        weights = [e for e in hit if not self.is_received(e)]
        load = _loads.current()
        if load is not None:  # a load runs on this thread: its writes to what it loads are its own
            own = [e for e in weights if load.covers(e.ref())]
            if len(own) == len(weights):
                return own, load
            rest, _ = self._intended_on_stack([e for e in weights if e not in own], frame)
            return own + rest, load
        return self._intended_on_stack(weights, frame)

    def _intended_on_stack(self, hit: list[Entry], frame: Optional[types.FrameType]
                           ) -> tuple[list[Entry], Optional[_loads.Load]]:
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
                    # load_state_dict of a guarded module: every write is its own, one load till it returns
                    return hit, (self._state_dict_load(frame) if name in _STATE_DICT else None)
                if id(owner) in modules and name == "_apply" and _is_conversion(frame):
                    return hit, None  # a conversion (`to`, `half`) re-points with `.data =`; `converting` follows
                if issubclass(type(owner), DistributedDataParallel) and id(getattr(owner, "module", None)) in modules:
                    return hit, None  # DDP's broadcast of the module's buffers and parameters
                if name == "forward" and owner is not None:
                    own = _own_buffers(owner)
                    intended += [e for e in hit if e not in intended and (owners.get(id(e)) is owner or any(
                        _tensors.same_elements(b, e.ref()) for b in own))]
                elif name == "_call_impl" and owner is not None:  # its hooks: spectral_norm's power iteration
                    intended += [e for e in hit if e not in intended and owners.get(id(e)) is owner
                                 and not isinstance(e.ref(), torch.nn.Parameter)]
            frame = frame.f_back
        return intended, None

    def _state_dict_load(self, frame: Optional[types.FrameType]) -> _loads.Load:
        """The load of the outermost `load_state_dict` of a guarded module running from `frame` outwards."""
        outer: Optional[tuple[torch.nn.Module, types.FrameType]] = None
        modules = self._guarded_modules
        while frame is not None:
            code = frame.f_code
            if code.co_name == "load_state_dict" and code.co_argcount and code.co_varnames[0] == "self":
                owner = _frames.frame_names(frame, ("self",)).get("self")
                if id(owner) in modules and issubclass(type(owner), torch.nn.Module):
                    outer = (owner, frame)  # type: ignore[assignment]  # a Module, by the check above
            frame = frame.f_back
        if outer is None:
            return _loads.state_dict_load(torch.nn.Module(), _frames.UNKNOWN_SITE, 0)
        module, at = outer
        caller = next(_frames.user_frames(at.f_back), None)
        return _loads.state_dict_load(module, _frames.site_of(caller), id(at))

    def load_ended(self, load: _loads.Load) -> None:
        """A load is over: the weights it wrote are placed there (a stray write later names it)."""
        super().load_ended(load)
        placed = f"{load.site.short} (loaded by {load.what})"
        for entry in list(self._entries.values()):
            if not self.is_received(entry) and entry.placed_at != placed and load.covers(entry.ref()):
                entry.placed_at = placed

    def converting(self, module: torch.nn.Module, fn: object) -> Callable[[], list[Change]]:
        """`module._apply(fn)` starts; returns what to call once it is done, which says what changed.

        It re-points the weights with `p.data = ...`. One of Module's own conversions (`to`,
        `half`, `cpu`...) is a write the trainer means: the entries follow their memory and
        values. `to_empty` leaves uninitialised memory: every weight that held values is a
        change. Any other function is judged by values: a weight whose dtype and device stay
        and whose values differ is a change.
        """
        if id(module) not in self._guarded_modules:
            return list
        self._forget_steps()  # every digest back in its entry; no weak reference of a table left
        kind = _training.module_apply_kind(fn)
        # path -> dtype, device, meta, digest; and the entry with its own digest then: an op that
        # reports its write on the way (`.data =` at level "full") moves it: not reported twice.
        before: dict[str, tuple[torch.dtype, torch.device, bool, _digest.Digest, Entry, _digest.Digest]] = {}
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
        self._unlisten_loads()
        self._pending.clear()
        self._early = []
        self._owner.clear()
        self._notes.clear()
        super().close()


def _own_buffers(obj: object) -> list[torch.Tensor]:
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
    local = frame.f_locals
    kind = _training.module_apply_kind(local.get("fn"))
    if kind != "other":
        return kind == "conversion"
    old, new = local.get("param"), local.get("param_applied")
    try:
        return old is not None and new is not None and bool((old.dtype, old.device) != (new.dtype, new.device))
    except Exception:  # noqa: BLE001 - not tensors: not a conversion we can tell
        return False

"""The C bridge of autograd's saved tensors: packs in C, memory told to the compiled write hook.

With the compiled extension loaded, `write_hook.SavedHooks` packs plain tensors without
Python and registers each as one of the write hook's saved rows; what needs Python goes
to the set's own `pack`, `unpack` and `read`. While the set's guard is attached to the
compiled write hook, what a Python pack queued is told to the hook at the next write op
(`BridgedSet._tell`), its entry made only when Python is next asked about a write: writes to
other memory never enter Python for it. Dead saved tensors are dropped by name and the hook
told the rest from a per-entry cache (`_published`), so backward, which frees one node's
tensors at a time, costs in proportion to what died.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

from kvguard._protect import frames as _frames
from kvguard._protect import records as _records
from kvguard._protect.contract import Added, Publisher
from kvguard._protect.entries import Entry
from kvguard._protect.queued import QueuedSet
from kvguard._protect.records import Record
from kvguard._protect.saved_composed import Lent
from kvguard._protect.saved_packs import Burst, Saved, State, TensorOf
from kvguard._torch import tensors as _tensors

if TYPE_CHECKING:
    from kvguard._native.write_hook import SavedHooks

DESCRIBED_MAX = 4096  # saved tensors told to the write hook whose entries wait for Python, at most
SAVED_TYPES: tuple[type, ...] = (Saved,)  # and the C pack's (`BridgedSet.native_pair`)
HOOKS_TYPE: Optional[type] = None  # kvguard._native.write_hook.SavedHooks, once used
_PLAIN = (torch.Tensor, torch.nn.Parameter)
SavedRef = Union[TensorOf, Lent]  # how a saved set holds what autograd keeps


def native_hooks() -> Optional[ModuleType]:
    """`kvguard._native.write_hook`, when it is loaded and has the C saved-tensor hooks."""
    module = sys.modules.get("kvguard._native.write_hook")
    return module if module is not None and hasattr(module, "SavedHooks") else None


def in_rows(ref: SavedRef) -> bool:
    """Whether an entry's Saved is one of the write hook's saved rows (made by the C pack, its
    set still attached): the hook checks writes to it, and forgets it when it dies."""
    saved = ref.saved() if type(ref) is TensorOf else None
    return saved is not None and type(saved) is not Saved and bool(saved.registered)  # type: ignore[attr-defined]


def has_memory(tensor: torch.Tensor) -> bool:
    """Whether a write to `tensor` may change, or bump the counter of, a tensor the C pack saved:
    not when its storage has no memory (a fresh empty tensor, which the write hook sends to
    Python for its identity; what C packs always has element memory, and its views share it)."""
    try:
        return tensor.layout != torch.strided or type(tensor) not in _PLAIN or tensor.untyped_storage().data_ptr() != 0
    except Exception:  # noqa: BLE001 - a subclass without a storage: looked at
        return True


class BridgedSet(QueuedSet[SavedRef]):
    """A queued set of saved tensors, packed in C and told to the compiled write hook where it can."""

    def __init__(self, name: str, fingerprint: bool = False) -> None:
        self._thread = threading.get_ident()
        self.closed = False
        # The C hooks (`native_pair`), once made: they pack plain tensors without Python, and keep `_state`.
        self._hooks_c: Optional[SavedHooks] = None
        self._state: Union[State, SavedHooks] = State()
        # The compiled write hook, while this set is attached to it (`attach_backend`): each saved
        # tensor's memory is published to it at pack time, so no write op has a pending list to
        # compare and enter Python for (`QueuedSet._described`).
        self._fast: Optional[ModuleType] = None
        self._dead: list[SavedRef] = []  # references that died since the last look: their entries go
        self._dead_scan = False  # a death no reference names (a composed owner's): scan every entry
        self._stale = False  # a tensor told to the hook died before its entry was made
        self._garbage = 0  # dead entries the lookup index still holds (harmless: their tensor is gone)
        # What the write hook is told, per entry (id): (intervals, identities); None: read from the entries again
        self._published: Optional[dict[int, tuple[list[tuple[int, int]], list[int]]]] = {}
        super().__init__(name, fingerprint=fingerprint)

    def native_pair(self, pack: Callable[[torch.Tensor], object], unpack: Callable[[object], torch.Tensor],
                    read: Callable[[Saved], None]) -> Optional[SavedHooks]:
        """The C hooks around `pack`, `unpack` and `read` (made once; None where the compiled
        extension is not loaded): they take over the counts `_state` kept so far."""
        native = native_hooks()
        if native is None:
            return None
        if self._hooks_c is None:
            global SAVED_TYPES, HOOKS_TYPE
            SAVED_TYPES, HOOKS_TYPE = (Saved, native.Saved), native.SavedHooks
            state = self._state
            hooks: SavedHooks = native.SavedHooks(self, pack, unpack, read, _frames._internal_files,
                                                  _frames.first_user_line, Burst, torch.nn.Parameter)
            hooks.backward_since_pack, hooks.burst = state.backward_since_pack, state.burst
            hooks.bursts, hooks.bursts_read, hooks.tasks = state.bursts, state.bursts_read, state.tasks
            self._hooks_c = self._state = hooks
            self._sync()
        return self._hooks_c

    def _sync(self) -> None:
        """C packs while the compiled hook is attached and no nested block's set shares the packs."""
        hooks = self._hooks_c
        if hooks is not None:
            hooks.fast = self._fast is not None and not self.closed and not self._shares_packs()

    def _shares_packs(self) -> bool:
        """Whether the sets of blocks entered inside this one take its packs too (then Python packs)."""
        return False

    def look(self) -> None:
        """Before a write op, when packs wait (the write hook's watch): with the compiled hook, only
        their memory is told to it, in one batch (`_tell`); their entries are made when Python is
        next asked about a write, or at a boundary (`_flush`)."""
        if self._fast is None:
            super().look()
        elif self._pending:
            self._tell()
            if self._pending:  # what it could not tell: protected the usual way, now
                super()._flush()
        if len(self._described) >= DESCRIBED_MAX and threading.get_ident() == self._thread:
            self._flush()

    def _tell(self) -> None:
        """Tell the compiled write hook the memory of what waits; what it cannot describe (sparse,
        meta, subclasses) or must watch otherwise (inference tensors) is protected the usual way.

        What C packs made is drained here too: the hook knows it already (a saved row), so it is
        described for its entry, not told again."""
        fast = self._fast
        assert fast is not None
        live: list[tuple[SavedRef, torch.Tensor]] = [(ref, tensor) for ref in self._pending
                                                     if (tensor := ref()) is not None]
        self._pending.clear()  # the watch compares it with an empty snapshot again
        hooks = self._hooks_c
        if hooks is not None:
            for saved in hooks.drain():
                drained = TensorOf(saved, self._on_death)
                if (tensor := drained()) is not None:
                    live.append((drained, tensor))
        if not live:
            return
        records: list[Optional[Record]]
        try:
            records = fast.describe([tensor for _, tensor in live], _tensors.PLAIN, False)
        except Exception:  # noqa: BLE001 - Python describes them (`_flush`)
            records = [None] * len(live)
        spans: list[tuple[int, int]] = []
        impls: list[int] = []
        told: list[tuple[SavedRef, Record]] = []
        for (ref, _), record in zip(live, records):
            if record is not None and record.stop and record.device is not None and not record.inference:
                if not in_rows(ref):
                    spans.append((record.start, record.stop))
                    if record.impl is not None:
                        impls.append(record.impl)
                told.append((ref, record))
            else:
                self._pending.append(ref)
        del live
        if told:
            try:
                if spans or impls:
                    fast.add_protected(spans, impls, False)
                self._described += told
            except Exception:  # noqa: BLE001 - protected the usual way
                self._pending += [ref for ref, _ in told]

    def _flush(self) -> None:
        if self._fast is not None and (self._pending or self._hooks_c is not None):
            self._tell()  # the hook first: what it could not tell is described again below
        super()._flush()

    def attach_backend(self, backend: Optional[Publisher]) -> None:
        """The write hook this set's guard is attached to (None: detached). The compiled one is
        told each saved tensor's memory as it is packed (see `SavedSet.adopt`)."""
        fast = backend if isinstance(backend, ModuleType) and hasattr(backend, "describe") else None
        if fast is not None and self._compiled is None and not self._entries and not self._pending:
            self._compiled = _records.bind(fast)  # records from the one source the set reads them with
        if self._fast is not None and fast is None:
            try:
                self._flush()  # what it was told becomes entries: a later publication includes them
            except Exception:  # noqa: BLE001
                pass
            self._release()
        self._fast = fast if fast is not None and self._compiled is fast else None
        self._sync()

    def _release(self) -> None:
        """C packs' rows leave the write hook: their entries are published the usual way from now."""
        if self._hooks_c is not None:
            self._hooks_c.release()
            self._published = None

    # -- deaths, and what the write hook is told ---------------------------------------
    #
    # Backward frees saved tensors one node at a time, and the allocator hands their memory to
    # the next tensors, which are written in place (gradients accumulate): each such write
    # meets memory the hook still has, and enters Python. There the dead entries are dropped
    # by name (the references that died), not by a scan of every entry, and the hook is told
    # the rest from a per-entry cache; the lookup index keeps the dead (they match nothing, their
    # tensor is gone) until they outnumber the living.

    def _on_death(self, ref: object) -> None:
        self._dirty = True
        if getattr(ref, "key", None) is not None:
            self._dead.append(ref)  # type: ignore[arg-type]  # an entry's reference: it has a key
        elif type(ref) is not TensorOf:  # a composed owner died (`Lent.owner`): its entry is not named
            self._dead_scan = True
        else:  # told to the hook, no entry yet: the hook's memory is stale all the same
            self._stale = True

    def _forget_dead(self) -> None:
        self._dirty = False
        if self._drop_dead() or self._stale:
            self._stale = False
            self._republish()

    def _drop_dead(self) -> bool:
        dead = self._dead
        self._dead = []
        entries, published = self._entries, self._published
        dropped = 0
        if self._dead_scan:
            self._dead_scan = False
            keys = [k for k, e in entries.items() if e.ref() is None]
        else:
            keys = []
            for ref in dead:
                key = ref.key
                entry = entries.get(key)
                if entry is not None and entry.ref is ref:  # not a tensor protected since at the same address
                    keys.append(key)
        for key in keys:
            entry = entries.pop(key, None)
            if entry is not None:
                dropped += 1
                if published is not None:
                    published.pop(id(entry), None)
        self._garbage += dropped
        return dropped > 0

    def _republish(self) -> None:
        """Tell the write hook the protected memory without the dead; the lookup index keeps them
        (matching nothing) until they outnumber the living."""
        if self._garbage > len(self._entries) + 64:
            self._garbage = 0
            self._memory.invalidate()
        if self.on_index is not None:
            self.on_index(None)

    def _entered(self, added: list[Entry], known: list[Entry]) -> None:
        """Only what the write hook was not told of at pack time is published now; the lookup
        index takes both."""
        self._remember(known)
        self._memory.add(known)
        if added:
            self._rebuild_index(added)

    def _remember(self, entries: list[Entry]) -> None:
        """Keep what the write hook is told of `entries` (for the next whole publication)."""
        published = self._published
        if published is not None:
            for entry in entries:
                record = entry.record
                if _in_rows(entry):
                    continue  # the write hook's saved rows have it, for as long as it lives
                if record.spans is None:  # from C++: one span
                    published[id(entry)] = ([(record.start, record.stop)] if record.stop else [],
                                            [record.impl] if record.impl is not None else [])
                else:
                    published[id(entry)] = (_records.intervals((record,)), _records.impls((record,)))

    def _rebuild_index(self, added: Added = None) -> None:
        if added is None:
            self._garbage = 0
            self._published = None  # records may have changed: read them again
        else:
            self._remember(added)
        super()._rebuild_index(added)

    def _publication(self) -> dict[int, tuple[list[tuple[int, int]], list[int]]]:
        published = self._published
        if published is None:
            published = self._published = {
                id(e): (_records.intervals((e.record,)), _records.impls((e.record,))) for e in self._entries.values()
                if not _in_rows(e)}
        return published

    def intervals(self) -> list[tuple[int, int]]:
        """The protected memory (`ProtectedSet.intervals`), with what was told to the hook at pack time."""
        return [iv for ivs, _ in self._publication().values() for iv in ivs] + [
            (record.start, record.stop) for ref, record in self._described if ref() is not None and not in_rows(ref)]

    def identities(self) -> list[int]:
        return [impl for _, impls in self._publication().values() for impl in impls] + [
            record.impl for ref, record in self._described
            if record.impl is not None and ref() is not None and not in_rows(ref)]


def _in_rows(entry: Entry) -> bool:
    """`in_rows` of an entry's reference (a saved set's entries hold a `SavedRef`)."""
    ref = entry.ref
    return type(ref) is TensorOf and in_rows(ref)

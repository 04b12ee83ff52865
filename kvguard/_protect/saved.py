"""What autograd saved for backward, as a protected set: `guard_autograd`'s tensors.

A pair of `saved_tensors_hooks` sees every tensor an op saves (aten ops, custom
Functions' `save_for_backward`, checkpoint inputs). The pack hook keeps a `Saved`: the
tensor detached (the same memory and version counter, without a reference back to its
`grad_fn`, so no cycle keeps a graph alive), its version, and the forward line that saved
it. The tensor is protected for as long as autograd holds the `Saved`: until the backward
that needs it has run, or its graph is freed.

Hooks do not nest, so saved-tensor hooks pushed while these are innermost (non-reentrant
checkpointing, first forward and recomputation; `save_on_cpu`; offloading) are composed
with them (`Composed`): theirs keep what they keep, and the tensor each saved is protected,
held weakly, for as long as both it and what their pack kept live.

Installing hooks switches PyTorch's own version check off, so the unpack hook makes it
itself, with PyTorch's words and kvguard's explanation added. Which node saved a tensor is
found only when a report names it, by a walk of the graph from recently saved tensors and
the caller's variables that reads each node's saved slots without unpacking them.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import types
import weakref
from typing import Any, Optional, Sequence

import torch

from kvguard._protect import frames as _frames
from kvguard._protect import records as _records
from kvguard._protect.entries import Entry
from kvguard._protect.queued import QueuedSet
from kvguard._protect.records import DEVICE, IMPL, INFERENCE, START, STOP
from kvguard._report.events import SAVED_PREFIX
from kvguard._text import say
from kvguard._torch import autograd as _autograd
from kvguard._torch import tensors as _tensors

FLUSH_EVERY = 256  # saved tensors waiting for the next look at most (a forward with no write op)
_DESCRIBED_MAX = 4096  # saved tensors told to the write hook whose entries wait for Python, at most
MAX_WALK = 200_000  # nodes a search for savers visits at most
_ROOTS = 64  # recently saved tensors kept (weakly) as starting points of that search
TORCH_CHECK = ("one of the variables needed for gradient computation has been modified by an inplace "
               "operation")
TORCH_HINT = ("Hint: the backtrace further above shows the operation that failed to compute its gradient. "
              "The variable in question was changed in there or anywhere later. Good luck!")


class Saved:
    """What one pack kept: the tensor autograd reads back, its version then, where it was saved.

    Under composed hooks (`Composed`) it keeps no tensor (`tensor` is None): theirs keep it."""

    __slots__ = ("tensor", "version", "site", "saver", "writes", "read_by", "burst", "task", "__weakref__")

    def __init__(self, tensor: Optional[torch.Tensor], site: Optional[tuple[str, int]]) -> None:
        # Shares memory and version counter; no grad_fn: no cycle.
        self.tensor = tensor.detach() if tensor is not None else None
        self.version = tensor._version if tensor is not None else 0
        self.site = site  # (co_filename, line), shown as `file.py:LINE` (`site_text`)
        self.saver: Optional[str] = None  # "SigmoidBackward0: result", once a report needed it
        self.writes: list[str] = []  # the writes kvguard reported on it, for backward's error
        self.read_by: Optional[int] = None  # the backward node that last unpacked it (`_autograd.node_serial`)
        self.burst: Optional[_Burst] = None  # the forward stretch that saved it (`SavedSet.graphs`)
        self.task: Optional[int] = None  # the backward pass that first read it



def _path(saved: Any) -> str:
    """How a report names a saved tensor: `<saved by SigmoidBackward0: result>`."""
    return f"{SAVED_PREFIX}{saved.saver}>" if saved.saver else f"{SAVED_PREFIX}a node not found>"


class _State:
    """What a set counts of its forward stretches and backward passes (`SavedSet.graphs`): kept by
    the C hooks (`kvguard._native.write_hook.SavedHooks`, the same attributes) where they pack."""

    __slots__ = ("backward_since_pack", "burst", "bursts", "bursts_read", "tasks", "_recent")

    def __init__(self) -> None:
        self.backward_since_pack = True
        self.burst: Optional[_Burst] = None  # the forward stretch saving now (`graphs`)
        self.bursts = self.bursts_read = self.tasks = 0
        self._recent: collections.deque[int] = collections.deque(maxlen=64)

    def count_task(self, task: int) -> bool:
        """Count backward pass `task` unless it is one of the last 64 counted."""
        if task in self._recent:
            return False
        self._recent.append(task)
        self.tasks += 1
        return True


def _native_hooks() -> Any:
    """`kvguard._native.write_hook`, when it is loaded and has the C saved-tensor hooks."""
    module = sys.modules.get("kvguard._native.write_hook")
    return module if module is not None and hasattr(module, "SavedHooks") else None


class _Burst:
    """Tensors saved outside backward with no backward in between: one forward stretch."""

    __slots__ = ("read",)

    def __init__(self) -> None:
        self.read = False  # a backward pass read one of them (that pass counts the graph)


class Kept:
    """What autograd holds under composed hooks: what their pack returned, and kvguard's `Saved`."""

    __slots__ = ("inner", "saved", "__weakref__")

    def __init__(self, inner: Any, saved: Saved) -> None:
        self.inner = inner
        self.saved = saved


class _Lent(weakref.ref):  # type: ignore[type-arg]
    """An entry's reference under composed hooks: weak to the saved tensor (or to the alias their
    hook keeps), and to the `Kept` that autograd holds when the tensor outlives it (`owner`).

    A saved view is often a temporary (the 2-D view `linear` makes of a 3-D input) that dies
    at once: then the reference is weak to its base, and a detached alias of the view (the
    same memory and version counter, no reference to the base) is held until the base dies.
    """

    def __new__(cls, tensor: torch.Tensor, callback: Any, saved: Saved, owner: Optional[Kept]) -> _Lent:
        base = _autograd.view_base(tensor)
        return super().__new__(cls, base if base is not None else tensor, _lent_died)

    def __init__(self, tensor: torch.Tensor, callback: Any, saved: Saved, owner: Optional[Kept]) -> None:
        base = _autograd.view_base(tensor)  # `__new__` set the referent and the callback
        self.view = tensor.detach() if base is not None else None
        self.info = saved
        self.on_death = callback
        self.owner = weakref.ref(owner, callback) if owner is not None else None

    def __call__(self) -> Optional[torch.Tensor]:
        owner = self.owner
        if owner is not None and owner() is None:
            self.view = None  # what it kept is gone: so is our hold on its memory
            return None
        tensor = super().__call__()
        if tensor is None:
            return None
        return self.view if self.view is not None else tensor

    def saved(self) -> Optional[Saved]:
        return self.info if self() is not None else None


def _lent_died(ref: _Lent) -> None:
    ref.view = None  # the base died: let its memory go
    ref.on_death(ref)


class Composed:
    """Other saved-tensor hooks pushed while kvguard's were innermost, with kvguard's around them.

    Their pack runs and keeps what it keeps (a checkpoint's placeholder, a CPU copy, a
    recomputed alias); the tensor is protected besides, held weakly: for as long as the
    alias their hook keeps lives, else for as long as both the tensor and what autograd
    holds do. Their unpack runs as it would, with no version check added: what it returns
    is theirs to vouch for (a CPU copy, a recomputation), as without kvguard.
    """

    __slots__ = ("their_pack", "their_unpack", "owner")

    def __init__(self, pack: Any, unpack: Any, owner: SavedSet) -> None:
        self.their_pack, self.their_unpack, self.owner = pack, unpack, owner

    def pack(self, tensor: torch.Tensor) -> Any:
        inner = self.their_pack(tensor)  # may raise: a checkpoint stops its recomputation so
        owner = self.owner
        if owner.closed or _autograd.allowing_mutation_on_saved_tensors():
            return inner  # writes are legal there (autograd keeps a copy): theirs alone
        try:
            saved = Saved(None, _frames.first_user_line(sys._getframe(1)))
            kept = Kept(inner, saved)
            # An alias their hook keeps (a recomputation's `x.detach()`) is protected while it lives.
            alias = isinstance(inner, torch.Tensor) and inner is not tensor and _autograd.shares_version_counter(
                inner, tensor)
            owner.lend(saved, inner if alias else tensor, None if alias else kept)
        except Exception:  # noqa: BLE001 - never fail the user's forward; but never call it clean
            owner.unprotected += 1
            return inner
        return kept

    def unpack(self, kept: Any) -> Any:
        if type(kept) is not Kept:
            return self.their_unpack(kept)
        self.owner.read(kept.saved)
        return self.their_unpack(kept.inner)


class _TensorOf(weakref.ref):  # type: ignore[type-arg]
    """An entry's reference: weak to the `Saved` (its death is the entry's), calling gives the tensor.

    `key`: the entry's key in the set, once it has one (its death drops just that entry)."""

    __slots__ = ("key",)

    def __call__(self) -> Optional[torch.Tensor]:
        saved = super().__call__()
        return saved.tensor if saved is not None else None

    def saved(self) -> Optional[Saved]:
        return super().__call__()


class SavedSet(QueuedSet):
    """The tensors autograd saved while the guard's hooks were installed, as protected entries.

    `pack` and `unpack` are the hooks. Packs wait in a list the write hook watches like a
    guarded container, so the next write op (or the next boundary) protects them in one batch.
    """

    # Batch norm's running statistics are saved and then updated by the same op; a
    # training-mode backward never reads them, and autograd's check never counts the update.
    judges_uncounted = False
    # What autograd saved matters only through the values backward reads: a re-pointing to the
    # same values (a memory-format conversion) changes nothing it computes.
    values_only = True

    def __init__(self, name: str, fingerprint: bool = False) -> None:
        # Packs wait in `_pending` (`_TensorOf`s, and `_Lent`s under composed hooks), held weakly: a
        # backward that runs before the next look frees what it read as it goes, as it would without
        # kvguard (the peak memory stays autograd's).
        self._roots: collections.deque[weakref.ref[torch.Tensor]] = collections.deque(maxlen=_ROOTS)
        self._thread = threading.get_ident()
        self.counter_only: frozenset[int] = frozenset()
        self.followers: list[SavedSet] = []  # sets of guard_autograd blocks entered inside this one
        # The C hooks (`hooks`), once made: they pack plain tensors without Python, and keep `_state`.
        self._hooks_c: Any = None
        self._counted = 0  # tensors protected by the Python pack (`protected_count`)
        self._state: Any = _State()
        self.unprotected = 0  # other hooks' stretches not composed with ours, and tensors a composed pack could not hold
        self.closed = False
        # The compiled write hook, while this set is attached to it (`attach_backend`): each saved
        # tensor's memory is published to it at pack time, so no write op has a pending list to
        # compare and enter Python for (`QueuedSet._described`).
        self._fast: Any = None
        self._dead: list[Any] = []  # references that died since the last look: their entries go
        self._dead_scan = False  # a death no reference names (a composed owner's): scan every entry
        self._stale = False  # a tensor told to the hook died before its entry was made
        self._garbage = 0  # dead entries the lookup index still holds (harmless: their tensor is gone)
        # What the write hook is told, per entry (id): (intervals, identities); None: read from the entries again
        self._published: Optional[dict[int, tuple[list[tuple[int, int]], list[int]]]] = {}
        super().__init__(name, fingerprint=fingerprint)

    # -- the hooks -------------------------------------------------------------------

    def hooks(self) -> tuple[Any, Any]:
        """The (pack, unpack) pair to install: in C where the compiled write hook is loaded
        (`kvguard._native.write_hook.SavedHooks`, which leaves to `pack`/`unpack` what needs
        Python), else `pack` and `unpack` themselves."""
        native = _native_hooks()
        if native is None:
            return self.pack, self.unpack
        if self._hooks_c is None:
            global _SAVED_TYPES, _HOOKS_TYPE
            _SAVED_TYPES, _HOOKS_TYPE = (Saved, native.Saved), native.SavedHooks
            state = self._state
            hooks = native.SavedHooks(self, self.pack, self.unpack, self.read, _frames._internal_files,
                                      _frames.first_user_line, _Burst, torch.nn.Parameter)
            hooks.backward_since_pack, hooks.burst = state.backward_since_pack, state.burst
            hooks.bursts, hooks.bursts_read, hooks.tasks = state.bursts, state.bursts_read, state.tasks
            self._hooks_c = self._state = hooks
            self._sync()
        return self._hooks_c.pack, self._hooks_c.unpack

    def _sync(self) -> None:
        """C packs while the compiled hook is attached and no nested block's set shares the packs."""
        hooks = self._hooks_c
        if hooks is not None:
            hooks.fast = self._fast is not None and not self.closed and not self.followers

    @property
    def protected_count(self) -> int:
        """Tensors protected so far, by either pack."""
        hooks = self._hooks_c
        return self._counted + (hooks.packed if hooks is not None else 0)

    @protected_count.setter
    def protected_count(self, value: int) -> None:
        hooks = self._hooks_c
        self._counted = value - (hooks.packed if hooks is not None else 0)

    def pack(self, tensor: torch.Tensor) -> Any:
        try:
            saved = Saved(tensor, _frames.first_user_line(sys._getframe(1)))
        except Exception:  # noqa: BLE001 - never fail the user's forward (a subclass that refuses detach)
            return tensor
        if type(tensor) is not _TENSOR and not _ATTRIBUTES_SAID:
            _say_attributes(tensor)
        if not self.followers and not self.closed:
            self.adopt(_TensorOf(saved, self._on_death), saved, tensor)
        else:
            for target in self._protecting():
                target.adopt(_TensorOf(saved, target._on_death), saved, tensor)
        return saved

    def lend(self, saved: Saved, tensor: torch.Tensor, owner: Optional[Kept]) -> None:
        """Protect `tensor`, saved under composed hooks, weakly (see `Composed`)."""
        for target in self._protecting():
            target.adopt(_Lent(tensor, target._on_death, saved, owner), saved, tensor)

    def _protecting(self) -> list[SavedSet]:
        """This set (unless closed) and the sets of guard_autograd blocks entered inside it."""
        return ([] if self.closed else [self]) + self.followers

    def adopt(self, ref: Any, saved: Saved, tensor: torch.Tensor) -> None:
        """Protect what `ref` gives from now on: its memory told to the compiled write hook now
        (its entry made at the next look), or, where that cannot be, from the next look on."""
        if saved.burst is None and _autograd.current_graph_task_id() == -1:  # saved inside backward: its pass counts it
            state = self._state
            if state.backward_since_pack or state.burst is None:
                state.backward_since_pack = False
                state.burst = _Burst()
                state.bursts += 1
            saved.burst = state.burst
        self._pending.append(ref)
        self.protected_count += 1  # protected from now: a write looks at what waits first
        if tensor.requires_grad:  # a start for the search of savers (`_find_savers`)
            self._roots.append(weakref.ref(tensor))
        if len(self._pending) >= FLUSH_EVERY and threading.get_ident() == self._thread:
            try:
                self.look()
            except Exception:  # noqa: BLE001 - the next look tries again
                pass

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
        if len(self._described) >= _DESCRIBED_MAX and threading.get_ident() == self._thread:
            self._flush()

    def _tell(self) -> None:
        """Tell the compiled write hook the memory of what waits; what it cannot describe (sparse,
        meta, subclasses) or must watch otherwise (inference tensors) is protected the usual way.

        What C packs made is drained here too: the hook knows it already (a saved row), so it is
        described for its entry, not told again."""
        fast = self._fast
        live = [(ref, tensor) for ref in self._pending if (tensor := ref()) is not None]
        self._pending.clear()  # the watch compares it with an empty snapshot again
        hooks = self._hooks_c
        if hooks is not None:
            for saved in hooks.drain():
                ref = _TensorOf(saved, self._on_death)
                if (tensor := ref()) is not None:
                    live.append((ref, tensor))
        if not live:
            return
        try:
            records = fast.describe([tensor for _, tensor in live], _tensors.PLAIN, False)
        except Exception:  # noqa: BLE001 - Python describes them (`_flush`)
            records = [None] * len(live)
        spans: list[tuple[int, int]] = []
        impls: list[int] = []
        told = []
        for (ref, _), record in zip(live, records):
            if record is not None and record[STOP] and record[DEVICE] is not None and not record[INFERENCE]:
                if not _in_rows(ref):
                    spans.append((record[START], record[STOP]))
                    if record[IMPL] is not None:
                        impls.append(record[IMPL])
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

    def attach_backend(self, backend: Any) -> None:
        """The write hook this set's guard is attached to (None: detached). The compiled one is
        told each saved tensor's memory as it is packed (see `adopt`)."""
        fast = backend if backend is not None and hasattr(backend, "describe") else None
        if fast is not None and self._compiled is None and not self._entries and not self._pending:
            self._compiled = fast  # records from the one source the set reads them with (`records`)
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

    def unpack(self, saved: Any) -> torch.Tensor:
        if type(saved) not in _SAVED_TYPES:
            return saved  # type: ignore[no-any-return]  # a tensor pack could not keep
        tensor = saved.tensor
        assert tensor is not None  # kept by our pack (a composed one's comes back through `Composed.unpack`)
        if tensor._version != saved.version:
            raise RuntimeError(self._version_error(saved))
        self.read(saved)
        return tensor  # type: ignore[no-any-return]  # a Saved of either pack

    def read(self, saved: Saved) -> None:
        """Backward unpacked `saved`: counted with its graph, and its node may now use it as scratch."""
        node = _autograd.current_autograd_node()
        if node is not None:  # its own backward may now write it (Megatron's cross-entropy does)
            saved.read_by = _autograd.node_serial(node)
        task = _autograd.current_graph_task_id()
        if task == -1 or saved.task is not None:
            return  # read outside backward (`grad_fn._saved_x`), or again (retain_graph)
        state = self._state
        state.backward_since_pack = True
        saved.task = task
        for target in [self, *self.followers]:
            target._state.count_task(task)
        burst = saved.burst
        if burst is not None and not burst.read:
            burst.read = True
            state.bursts_read += 1

    @property
    def graphs(self) -> int:  # type: ignore[override]
        """Graphs that saved what this set protected: each backward pass that read a tensor no
        other had read, and each forward stretch whose tensors no backward read."""
        state = self._state
        return int(state.tasks + state.bursts - state.bursts_read)

    def _version_error(self, saved: Saved) -> str:
        """PyTorch's words for a saved tensor written since, then what kvguard saw."""
        tensor = saved.tensor
        assert tensor is not None
        node = _autograd.current_autograd_node()
        name = type(node).__name__ if node is not None else "its node"
        head = (f"{TORCH_CHECK}: [{_type_text(tensor)} {_shape_text(tensor)}], which {name} saved, is at version "
                f"{tensor._version}; expected version {saved.version} instead. {TORCH_HINT}")
        where = f" at {_site_text(saved.site)}" if saved.site else ""
        if saved.writes:
            said = "; ".join(dict.fromkeys(saved.writes))
            return f"{head}\n\nkvguard: the tensor {name} saved{where} was written by {said}"
        return (f"{head}\n\nkvguard: the tensor {name} saved{where} was written where kvguard did not watch: "
                "after guard_autograd ended, on another thread, or by code no dispatched op shows")

    # -- entries ---------------------------------------------------------------------

    def _entry(self, ref: Any, tensor: torch.Tensor, record: Any) -> Entry:
        info = ref.saved()
        site = info.site if info is not None else None
        ref.key = id(tensor)  # its death drops this entry (`_forget_dead`)
        return Entry(_UNNAMED, record, ref, _site_text(site) if site is not None else None)

    # -- deaths, and what the write hook is told ---------------------------------------
    #
    # Backward frees saved tensors one node at a time, and the allocator hands their memory to
    # the next tensors, which are written in place (gradients accumulate): each such write
    # meets memory the hook still has, and enters Python. There the dead entries are dropped
    # by name (the references that died), not by a scan of every entry, and the hook is told
    # the rest from a per-entry cache; the lookup index keeps the dead (they match nothing, their
    # tensor is gone) until they outnumber the living.

    def _on_death(self, ref: Any) -> None:
        self._dirty = True
        if getattr(ref, "key", None) is not None:
            self._dead.append(ref)
        elif type(ref) is not _TensorOf:  # a composed owner died (`_Lent.owner`): its entry is not named
            self._dead_scan = True
        else:  # told to the hook, no entry yet: the hook's memory is stale all the same
            self._stale = True

    def _forget_dead(self) -> None:
        self._dirty = False
        if self._drop_dead() or self._stale:
            self._stale = False
            self._republish()

    def _drop_dead(self) -> bool:
        dead: list[Any] = self._dead
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
                if _in_rows(entry.ref):
                    continue  # the write hook's saved rows have it, for as long as it lives
                if record.spans is None:  # from C++: one span
                    published[id(entry)] = ([(record.start, record.stop)] if record.stop else [],
                                            [record.impl] if record.impl is not None else [])
                else:
                    published[id(entry)] = (_records.intervals((record,)), _records.impls((record,)))

    def _rebuild_index(self, added: Optional[list[Entry]] = None) -> None:
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
                if not _in_rows(e.ref)}
        return published

    def intervals(self) -> list[tuple[int, int]]:
        """The protected memory (`ProtectedSet.intervals`), with what was told to the hook at pack time."""
        return [iv for ivs, _ in self._publication().values() for iv in ivs] + [
            (record[START], record[STOP]) for ref, record in self._described if ref() is not None and not _in_rows(ref)]

    def identities(self) -> list[int]:
        return [impl for _, impls in self._publication().values() for impl in impls] + [
            record[IMPL] for ref, record in self._described
            if record[IMPL] is not None and ref() is not None and not _in_rows(ref)]

    def boundary_changes(self, caller: Optional[types.FrameType], rescan: bool = True) -> list[Any]:
        """Nothing to compare at a boundary: fingerprints are off (a saved tensor's values are the
        version counter's to vouch for, checked at unpack), and no code of the user's holds
        the saved (detached) tensor objects to re-point them. Protects what waits, forgets the dead."""
        if self._pending or self._described or self._hooks_c is not None:
            self._flush()
        return super().boundary_changes(caller, rescan)

    def settle(self) -> None:
        """Paths are named when a write hits (`written_entries`); nothing else moves them."""

    @property
    def alive(self) -> int:
        """Saved tensors protected now."""
        undrained = self._hooks_c.alive()[1] if self._hooks_c is not None else 0
        return sum(1 for e in self._entries.values() if e.ref() is not None) + sum(
            1 for ref in self._pending if ref() is not None) + sum(
            1 for ref, _ in self._described if ref() is not None) + undrained

    # -- writes ----------------------------------------------------------------------

    def written_entries(self, written: Sequence[torch.Tensor], kind: str, resizes: bool = False) -> list[Entry]:
        """The saved tensors a write changes, or (`counter_only`) whose version counter alone it bumps.

        A write to a sibling slice of a saved view's base changes no saved element, but
        views share one version counter, so autograd's check at backward fails all the same.
        """
        self.counter_only = frozenset()
        if self._pending or self._described or (self._hooks_c is not None and any(map(_has_memory, written))):
            self._flush()  # their entries: the lookup needs them (what C packed: only where it may be met)
        if kind == "write" and any(t.layout == torch.sparse_coo for t in written):
            written = [_values_of(t) for t in written]
        hit = super().written_entries(written, kind, resizes)
        if not hit:
            # A metadata or re-pointing op (`t_`, `unsqueeze_`, `set_`, `detach_`) changes a tensor
            # object, not the detached one autograd keeps; its version counter is theirs alike.
            hit = self._sharing_counter(written)
            if kind == "write":
                self.counter_only = frozenset(map(id, hit))
            else:
                self.counter_only = frozenset(id(e) for e in hit if not _same_view(e, written))
        if hit and (node := _autograd.current_autograd_node()) is not None:
            hit = self._not_read_by(_autograd.node_serial(node), hit)
        return self._named(hit) if hit else hit

    def _not_read_by(self, serial: Optional[int], hit: list[Entry]) -> list[Entry]:
        """`hit` less what the backward node running now has unpacked: a node's backward may
        use its saved tensors as scratch once it has read them (autograd checked them then)."""
        return [e for e in hit if (s := self.saved_of(e)) is None or s.read_by is None or s.read_by != serial]

    def _sharing_counter(self, written: Sequence[torch.Tensor]) -> list[Entry]:
        if self._memory.stale:
            self._memory.ensure(self._entries.values())
        found = []
        for tensor in written:
            for entry in self._memory.in_storage_of(tensor):
                saved = entry.ref()
                if saved is not None and entry not in found and _autograd.shares_version_counter(tensor, saved):
                    found.append(entry)
        return found

    def _named(self, hit: list[Entry]) -> list[Entry]:
        """`hit` with each entry's saver named, one entry per tensor saved more than once (the
        other savers as aliases)."""
        self._find_savers()
        first: dict[Any, Entry] = {}
        kept = []
        for entry in sorted(hit, key=lambda e: (s := self.saved_of(e)) is None or s.saver is None):  # named first
            saved = self.saved_of(entry)
            if saved is not None:
                entry.path = _path(saved)
            key = _memory_key(entry)
            same = first.get(key)
            if same is None:
                first[key] = entry
                kept.append(entry)
                entry.aliases = ()
            elif entry.path != same.path and entry.path not in same.aliases:
                same.aliases += (entry.path,)
        return kept

    @staticmethod
    def saved_of(entry: Entry) -> Optional[Saved]:
        ref = entry.ref
        return ref.saved() if isinstance(ref, (_TensorOf, _Lent)) else None

    def note(self, entry: Entry, what: str) -> None:
        """A write reported on `entry`: backward's error will name it."""
        saved = self.saved_of(entry)
        if saved is not None and len(saved.writes) < 8:
            saved.writes.append(what)

    def _find_savers(self) -> None:
        """Name the node and slot of every saved tensor not named yet, from the graph."""
        unnamed = {id(s): s for e in self._entries.values() if (s := self.saved_of(e)) is not None and s.saver is None}
        if not unnamed:
            return
        roots = [t for ref in self._roots if (t := ref()) is not None] + _caller_tensors(sys._getframe(2))
        if self._hooks_c is not None:
            roots += self._hooks_c.roots()
        stack = [n for t in roots if (n := _grad_fn(t)) is not None]
        kept: list[Any] = []  # wrappers held while walked, so their ids stay theirs
        seen: set[int] = set()
        while stack and unnamed and len(kept) < MAX_WALK:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            kept.append(node)
            for slot, data in _autograd.saved_slots(node):
                if type(data) is Kept:  # saved under composed hooks
                    data = data.saved
                if type(data) in _SAVED_TYPES and data.saver is None:
                    data.saver = f"{type(node).__name__}: {slot}"
                    unnamed.pop(id(data), None)
            stack += _autograd.next_nodes(node)

    def close(self) -> None:
        self.closed = True
        self.followers.clear()
        self._release()
        self._pending.clear()
        self._described.clear()
        self._dead.clear()
        self._published = {}
        self._fast = None
        self._roots.clear()
        super().close()


_TENSOR = torch.Tensor
_SAVED_TYPES: tuple[type, ...] = (Saved,)  # and the C pack's (`SavedSet.hooks`)
_HOOKS_TYPE: Optional[type] = None  # kvguard._native.write_hook.SavedHooks, once used
_ATTRIBUTES_SAID = False
ATTRIBUTES_LINE = (
    "kvguard: autograd: a Parameter saved for backward carries Python attributes ({names}); under "
    "saved-tensor hooks (this guard's, save_on_cpu, checkpointing) a custom Function's ctx.saved_tensors "
    "gives a new tensor without them, and one set there never reaches the Parameter (megatron-core's "
    "gradient_accumulation_fusion with overlap_grad_reduce then fails): docs/autograd.md, "
    "'ctx.saved_tensors under saved-tensor hooks'")


def _say_attributes(tensor: torch.Tensor) -> None:
    """Say once a process that a saved Parameter has Python attributes that backward's
    `ctx.saved_tensors` will not carry (inherent to any saved-tensor hooks)."""
    global _ATTRIBUTES_SAID
    try:
        if not isinstance(tensor, torch.nn.Parameter):
            return
        names = sorted(k for k in vars(tensor) if not k.startswith("_") or k == "__fsdp_param__")
    except Exception:  # noqa: BLE001 - a diagnostic only
        return
    if names:
        _ATTRIBUTES_SAID = True
        say(ATTRIBUTES_LINE.format(names=", ".join(names[:6]) + (", ..." if len(names) > 6 else "")))


def _has_memory(tensor: torch.Tensor) -> bool:
    """Whether a write to `tensor` may change, or bump the counter of, a tensor the C pack saved:
    not when its storage has no memory (a fresh empty tensor, which the write hook sends to
    Python for its identity; what C packs always has element memory, and its views share it)."""
    try:
        return tensor.layout != torch.strided or type(tensor) not in _PLAIN or tensor.untyped_storage().data_ptr() != 0
    except Exception:  # noqa: BLE001 - a subclass without a storage: looked at
        return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _values_of(tensor: torch.Tensor) -> torch.Tensor:
    """What a value write to `tensor` can change of a saved tensor: a sparse COO tensor's values.

    Its indices may be a saved tensor's memory (an embedding's sparse gradient keeps the
    saved `indices`); accumulating into it builds new indices, and no version counter that
    autograd checks moves.
    """
    try:
        parts = _tensors.sparse_parts(tensor)
    except Exception:  # noqa: BLE001 - a subclass without parts: judged whole
        return tensor
    return parts[-1] if parts else tensor


def _memory_key(entry: Entry) -> Any:
    """The same for two entries of one tensor's elements (a detached alias and the tensor itself)."""
    tensor = entry.ref()
    if tensor is None or tensor.layout != torch.strided:
        return entry.record[0]
    try:
        return (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
    except Exception:  # noqa: BLE001 - no storage (meta, a wrapper subclass)
        return entry.record[0]


def _same_view(entry: Entry, written: Sequence[torch.Tensor]) -> bool:
    """Whether one of `written` is the saved tensor itself (same memory and layout), not a sibling view."""
    saved = entry.ref()
    return saved is not None and any(
        t.data_ptr() == saved.data_ptr() and t.shape == saved.shape and t.stride() == saved.stride()
        for t in written if t.layout == torch.strided and saved.layout == torch.strided)


def set_of(pack: Any) -> Optional[SavedSet]:
    """The `SavedSet` behind a pack hook of kvguard's (its own, or composed with another's)."""
    owner: Any = getattr(pack, "__self__", None)
    if type(owner) is Composed or (_HOOKS_TYPE is not None and type(owner) is _HOOKS_TYPE):
        owner = getattr(owner, "owner", None)
    return owner if isinstance(owner, SavedSet) else None


def is_own_pack(pack: Any) -> bool:
    """Whether `pack` is a guard_autograd's own pack hook (not one composed with another's)."""
    owner = getattr(pack, "__self__", None)
    return isinstance(owner, SavedSet) or (_HOOKS_TYPE is not None and type(owner) is _HOOKS_TYPE)


def count_set_aside(pack: Any) -> None:
    """A torch.func transform set this guard's hooks aside: what it saves is not looked at."""
    owner = set_of(pack)
    if owner is not None:
        owner.unprotected += 1


def _in_rows(ref: Any) -> bool:
    """Whether an entry's Saved is one of the write hook's saved rows (made by the C pack, its
    set still attached): the hook checks writes to it, and forgets it when it dies."""
    saved: Any = ref.saved() if type(ref) is _TensorOf else None
    return saved is not None and type(saved) is not Saved and bool(saved.registered)


def compose(pack: Any, unpack: Any) -> Optional[tuple[Any, Any]]:
    """Hooks being pushed: composed with kvguard's when those are innermost (see `Composed`)."""
    if set_of(pack) is not None:
        return None  # kvguard's own (a guard entered, or set back after a torch.func transform)
    top = _autograd.top_saved_tensors_pack()
    owner = set_of(top) if top is not None else None
    if owner is None or owner.closed:
        return None
    if _autograd.inlineable_hook(pack) or _autograd.inlineable_hook(unpack):
        owner.unprotected += 1  # torch.compile inlines these into its graph: left as they are
        return None
    composed = Composed(pack, unpack, owner)
    return composed.pack, composed.unpack


def _grad_fn(tensor: torch.Tensor) -> Any:
    try:
        return tensor.grad_fn
    except Exception:  # noqa: BLE001
        return None


def _caller_tensors(frame: Optional[types.FrameType], depth: int = 12) -> list[torch.Tensor]:
    """Tensors with a graph in the user's frames (and one level into their containers)."""
    found = []
    for _, frame in zip(range(depth), _frames.user_frames(frame)):
        for value in _frames.frame_namespace(frame).values():
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (
                value,)
            for v in list(values)[:1000]:
                if isinstance(v, torch.Tensor) and v.grad_fn is not None:
                    found.append(v)
    return found


def _site_text(site: tuple[str, int]) -> str:
    """`file.py:LINE`, as reports show where a tensor was saved (the same few lines, over and over)."""
    text = _SITE_TEXT.get(site)
    if text is None:
        if len(_SITE_TEXT) > 4096:
            _SITE_TEXT.clear()
        text = _SITE_TEXT[site] = f"{os.path.basename(site[0])}:{site[1]}"
    return text


_SITE_TEXT: dict[tuple[str, int], str] = {}
_UNNAMED = SAVED_PREFIX + "…>"  # until a report names the saving node


def _shape_text(tensor: torch.Tensor) -> str:
    """`[4, 3]`; a nested tensor (which has no sizes) as its components' shapes."""
    try:
        return str(list(tensor.shape))
    except Exception:  # noqa: BLE001 - NestedTensorImpl refuses sizes()
        try:
            return "nested " + ", ".join(str(list(t.shape)) for t in tensor.unbind())
        except Exception:  # noqa: BLE001
            return "(shape unknown)"


def _type_text(tensor: torch.Tensor) -> str:
    try:
        return tensor.type()
    except Exception:  # noqa: BLE001
        return type(tensor).__name__

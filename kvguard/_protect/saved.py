"""What autograd saved for backward, as a protected set: `guard_autograd`'s tensors.

A pair of `saved_tensors_hooks` sees every tensor an op saves (aten ops, custom
Functions' `save_for_backward`, checkpoint inputs). The pack hook keeps a `Saved`
(`saved_packs`): the tensor detached (the same memory and version counter, without a
reference back to its `grad_fn`, so no cycle keeps a graph alive), its version, and the
forward line that saved it. The tensor is protected for as long as autograd holds the
`Saved`: until the backward that needs it has run, or its graph is freed. The unpack hook
redoes PyTorch's version check, which installing hooks switches off.

The rest lives beside it: hooks pushed inside these are composed with them
(`saved_composed`), the C packs and the compiled write hook's pack-time view are
`saved_bridge`, and the node that saved a tensor is found when a report names it
(`saved_savers`).
"""

from __future__ import annotations

import collections
import sys
import threading
import types
import weakref
from typing import TYPE_CHECKING, Optional, Sequence, cast

import torch

from kvguard._protect import frames as _frames
from kvguard._protect import saved_bridge as _bridge
from kvguard._protect import saved_savers as _savers
from kvguard._protect.entries import Change, Entry
from kvguard._protect.records import Record
from kvguard._protect.saved_bridge import BridgedSet, SavedRef
from kvguard._protect.saved_composed import Composed, Kept, Lent, Pack, Unpack
from kvguard._protect.saved_packs import UNNAMED, Burst, Saved, TensorOf, site_text, version_error
from kvguard._text import say
from kvguard._torch import autograd as _autograd
from kvguard._torch import tensors as _tensors

if TYPE_CHECKING:
    from kvguard._protect.contract import Protected

FLUSH_EVERY = 256  # saved tensors waiting for the next look at most (a forward with no write op)


class SavedSet(BridgedSet):
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
        # Packs wait in `_pending` (`TensorOf`s, and `Lent`s under composed hooks), held weakly: a
        # backward that runs before the next look frees what it read as it goes, as it would without
        # kvguard (the peak memory stays autograd's).
        self._roots: collections.deque[weakref.ref[torch.Tensor]] = collections.deque(maxlen=_savers.ROOTS)
        self.counter_only: frozenset[int] = frozenset()
        self.followers: list[SavedSet] = []  # sets of guard_autograd blocks entered inside this one
        self._counted = 0  # tensors protected by the Python pack (`protected_count`)
        self.unprotected = 0  # other hooks' stretches not composed with ours, and tensors a composed pack could not hold
        super().__init__(name, fingerprint=fingerprint)

    # -- the hooks -------------------------------------------------------------------

    def hooks(self) -> tuple[Pack, Unpack]:
        """The (pack, unpack) pair to install: in C where the compiled write hook is loaded
        (`kvguard._native.write_hook.SavedHooks`, which leaves to `pack`/`unpack` what needs
        Python), else `pack` and `unpack` themselves."""
        native = self.native_pair(self.pack, self.unpack, self.read)
        if native is None:
            return self.pack, self.unpack
        return native.pack, native.unpack

    def _shares_packs(self) -> bool:
        return bool(self.followers)

    @property
    def protected_count(self) -> int:
        """Tensors protected so far, by either pack."""
        hooks = self._hooks_c
        return self._counted + (hooks.packed if hooks is not None else 0)

    @protected_count.setter
    def protected_count(self, value: int) -> None:
        hooks = self._hooks_c
        self._counted = value - (hooks.packed if hooks is not None else 0)

    def pack(self, tensor: torch.Tensor) -> object:
        try:
            saved = Saved(tensor, _frames.first_user_line(sys._getframe(1)))
        except Exception:  # noqa: BLE001 - never fail the user's forward (a subclass that refuses detach)
            return tensor
        if type(tensor) is not _TENSOR and not _ATTRIBUTES_SAID:
            _say_attributes(tensor)
        if not self.followers and not self.closed:
            self.adopt(TensorOf(saved, self._on_death), saved, tensor)
        else:
            for target in self._protecting():
                target.adopt(TensorOf(saved, target._on_death), saved, tensor)
        return saved

    def lend(self, saved: Saved, tensor: torch.Tensor, owner: Optional[Kept]) -> None:
        """Protect `tensor`, saved under composed hooks, weakly (see `Composed`)."""
        for target in self._protecting():
            target.adopt(Lent(tensor, target._on_death, saved, owner), saved, tensor)

    def _protecting(self) -> list[SavedSet]:
        """This set (unless closed) and the sets of guard_autograd blocks entered inside it."""
        return ([] if self.closed else [self]) + self.followers

    def adopt(self, ref: SavedRef, saved: Saved, tensor: torch.Tensor) -> None:
        """Protect what `ref` gives from now on: its memory told to the compiled write hook now
        (its entry made at the next look), or, where that cannot be, from the next look on."""
        if saved.burst is None and _autograd.current_graph_task_id() == -1:  # saved inside backward: its pass counts it
            state = self._state
            if state.backward_since_pack or state.burst is None:
                state.backward_since_pack = False
                state.burst = Burst()
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

    def unpack(self, saved: object) -> torch.Tensor:
        if type(saved) not in _bridge.SAVED_TYPES:
            return cast(torch.Tensor, saved)  # a tensor pack could not keep
        kept = cast(Saved, saved)  # a Saved of either pack (the C pack's has the same attributes)
        tensor = kept.tensor
        assert tensor is not None  # kept by our pack (a composed one's comes back through `Composed.unpack`)
        if tensor._version != kept.version:
            raise RuntimeError(version_error(kept))
        self.read(kept)
        return tensor

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

    # -- entries ---------------------------------------------------------------------

    def _entry(self, ref: SavedRef, tensor: torch.Tensor, record: Record) -> Entry:
        info = ref.saved()
        site = info.site if info is not None else None
        ref.key = id(tensor)  # its death drops this entry (`_forget_dead`)
        return Entry(UNNAMED, record, ref, site_text(site) if site is not None else None)

    def boundary_changes(self, caller: Optional[types.FrameType], rescan: bool = True) -> list[Change]:
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
        if self._pending or self._described or (self._hooks_c is not None and any(map(_bridge.has_memory, written))
                                                and self._rows_met(written)):
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

    def _rows_met(self, written: Sequence[torch.Tensor]) -> bool:
        """Whether the write may reach what C packed and Python has no entry for yet: its storage
        meets a live saved row (the write hook's own test). A batch norm's statistics, written in
        every forward and sent to Python for the weights guard, meet none: the packs wait."""
        if self._fast is None:
            return True
        try:
            return bool(self._fast.meets_saved(written))
        except Exception:  # noqa: BLE001 - an extension without it (a stale build): look
            return True

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
        return _savers.named(hit)

    saved_of = staticmethod(_savers.saved_of)

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
        roots = [t for ref in self._roots if (t := ref()) is not None] + _savers.caller_tensors(sys._getframe(2))
        if self._hooks_c is not None:
            roots += self._hooks_c.roots()
        _savers.find_savers(unnamed, roots, _bridge.SAVED_TYPES)

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


def _same_view(entry: Entry, written: Sequence[torch.Tensor]) -> bool:
    """Whether one of `written` is the saved tensor itself (same memory and layout), not a sibling view."""
    saved = entry.ref()
    return saved is not None and any(
        t.data_ptr() == saved.data_ptr() and t.shape == saved.shape and t.stride() == saved.stride()
        for t in written if t.layout == torch.strided and saved.layout == torch.strided)


# -- which set a pack hook is, and other hooks composed with it -----------------------------


def set_of(pack: object) -> Optional[SavedSet]:
    """The `SavedSet` behind a pack hook of kvguard's (its own, or composed with another's)."""
    owner = getattr(pack, "__self__", None)
    if type(owner) is Composed or (_bridge.HOOKS_TYPE is not None and type(owner) is _bridge.HOOKS_TYPE):
        owner = getattr(owner, "owner", None)
    return owner if isinstance(owner, SavedSet) else None


def is_own_pack(pack: object) -> bool:
    """Whether `pack` is a guard_autograd's own pack hook (not one composed with another's)."""
    owner = getattr(pack, "__self__", None)
    return isinstance(owner, SavedSet) or (_bridge.HOOKS_TYPE is not None and type(owner) is _bridge.HOOKS_TYPE)


def count_set_aside(pack: object) -> None:
    """A torch.func transform set this guard's hooks aside: what it saves is not looked at."""
    owner = set_of(pack)
    if owner is not None:
        owner.unprotected += 1


def compose(pack: Pack, unpack: Unpack) -> Optional[tuple[Pack, Unpack]]:
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


if TYPE_CHECKING:
    _meets: type[Protected] = SavedSet  # mypy checks the set against the contract here

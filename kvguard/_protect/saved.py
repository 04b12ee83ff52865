"""What autograd saved for backward, as a protected set: `guard_autograd`'s tensors.

A pair of `saved_tensors_hooks` sees every tensor an op saves (aten ops, custom
Functions' `save_for_backward`, checkpoint inputs). The pack hook keeps a `Saved`: the
tensor detached (the same memory and version counter, without a reference back to its
`grad_fn`, so no cycle keeps a graph alive), its version, and the forward line that saved
it. The tensor is protected for as long as autograd holds the `Saved`: until the backward
that needs it has run, or its graph is freed.

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

from kvguard import _torch
from kvguard._protect import frames as _frames
from kvguard._protect.collector import collector_paused
from kvguard._protect.entries import Entry
from kvguard._protect.protected import ProtectedSet
from kvguard._report.events import SAVED_PREFIX

FLUSH_EVERY = 256  # saved tensors waiting for the next look at most (a forward with no write op)
MAX_WALK = 200_000  # nodes a search for savers visits at most
_ROOTS = 64  # recently saved tensors kept (weakly) as starting points of that search
TORCH_CHECK = ("one of the variables needed for gradient computation has been modified by an inplace "
               "operation")
TORCH_HINT = ("Hint: the backtrace further above shows the operation that failed to compute its gradient. "
              "The variable in question was changed in there or anywhere later. Good luck!")


class Saved:
    """What one pack kept: the tensor autograd reads back, its version then, where it was saved."""

    __slots__ = ("tensor", "version", "site", "saver", "writes", "read_by", "__weakref__")

    def __init__(self, tensor: torch.Tensor, site: Optional[tuple[str, int]]) -> None:
        self.tensor = tensor.detach()  # shares memory and version counter; no grad_fn: no cycle
        self.version = tensor._version
        self.site = site  # (co_filename, line), shown as `file.py:LINE` (`site_text`)
        self.saver: Optional[str] = None  # "SigmoidBackward0: result", once a report needed it
        self.writes: list[str] = []  # the writes kvguard reported on it, for backward's error
        self.read_by: Optional[int] = None  # the backward node that last unpacked it (`_torch.node_serial`)

    def path(self) -> str:
        return f"{SAVED_PREFIX}{self.saver}>" if self.saver else f"{SAVED_PREFIX}a node not found>"


class _TensorOf(weakref.ref):  # type: ignore[type-arg]
    """An entry's reference: weak to the `Saved` (its death is the entry's), calling gives the tensor."""

    __slots__ = ()

    def __call__(self) -> Optional[torch.Tensor]:
        saved = super().__call__()
        return saved.tensor if saved is not None else None

    def saved(self) -> Optional[Saved]:
        return super().__call__()


class SavedSet(ProtectedSet):
    """The tensors autograd saved while the guard's hooks were installed, as protected entries.

    `pack` and `unpack` are the hooks. Packs wait in a list the write hook watches like a
    guarded container, so the next write op (or the next boundary) protects them in one batch.
    """

    # Batch norm's running statistics are saved and then updated by the same op; a
    # training-mode backward never reads them, and autograd's check never counts the update.
    judges_uncounted = False

    def __init__(self, name: str, fingerprint: bool = False) -> None:
        # Packs not protected yet, held weakly: a backward that runs before the next look frees
        # what it read as it goes, as it would without kvguard (the peak memory stays autograd's).
        self._pending: list[_TensorOf] = []
        self._roots: collections.deque[weakref.ref[torch.Tensor]] = collections.deque(maxlen=_ROOTS)
        self._thread = threading.get_ident()
        self.counter_only: frozenset[int] = frozenset()
        self.followers: list[SavedSet] = []  # sets of guard_autograd blocks entered inside this one
        self.graphs = 0  # forward passes: packs that came after a backward (or first)
        self._backward_since_pack = True
        self.closed = False
        super().__init__(self._pending, name, None, (), fingerprint=fingerprint)

    # -- the hooks -------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> Any:
        try:
            saved = Saved(tensor, _frames.first_user_line(sys._getframe(1)))
        except Exception:  # noqa: BLE001 - never fail the user's forward (a subclass that refuses detach)
            return tensor
        if not self.closed:
            self.adopt(saved, tensor)
        for follower in self.followers:  # a guard_autograd entered inside this one protects it too
            follower.adopt(saved, tensor)
        return saved

    def adopt(self, saved: Saved, tensor: torch.Tensor) -> None:
        """Protect `saved` from the next look on (or now, when many wait)."""
        if self._backward_since_pack:
            self._backward_since_pack = False
            self.graphs += 1
        self._pending.append(_TensorOf(saved, self._on_death))
        self.protected_count += 1  # protected from now: a write looks at what waits first
        if tensor.requires_grad:  # a start for the search of savers (`_find_savers`)
            self._roots.append(weakref.ref(tensor))
        if len(self._pending) >= FLUSH_EVERY and threading.get_ident() == self._thread:
            try:
                self._flush()
            except Exception:  # noqa: BLE001 - the next look tries again
                pass

    def unpack(self, saved: Any) -> torch.Tensor:
        if type(saved) is not Saved:
            return saved  # type: ignore[no-any-return]  # a tensor pack could not keep
        self._backward_since_pack = True
        tensor = saved.tensor
        if tensor._version != saved.version:
            raise RuntimeError(self._version_error(saved))
        node = _torch.current_autograd_node()
        if node is not None:  # its own backward may now write it (Megatron's cross-entropy does)
            saved.read_by = _torch.node_serial(node)
        return tensor

    def _version_error(self, saved: Saved) -> str:
        """PyTorch's words for a saved tensor written since, then what kvguard saw."""
        tensor = saved.tensor
        node = _torch.current_autograd_node()
        name = type(node).__name__ if node is not None else "its node"
        head = (f"{TORCH_CHECK}: [{_type_text(tensor)} {list(tensor.shape)}], which {name} saved, is at version "
                f"{tensor._version}; expected version {saved.version} instead. {TORCH_HINT}")
        where = f" at {_site_text(saved.site)}" if saved.site else ""
        if saved.writes:
            said = "; ".join(dict.fromkeys(saved.writes))
            return f"{head}\n\nkvguard: the tensor {name} saved{where} was written by {said}"
        return (f"{head}\n\nkvguard: the tensor {name} saved{where} was written where kvguard did not watch: "
                "after guard_autograd ended, on another thread, or by code no dispatched op shows")

    # -- entries ---------------------------------------------------------------------

    def look(self) -> None:
        if self._pending:
            self._flush()  # which forgets the dead first
        elif self._dirty:
            self._forget_dead()

    def _flush(self) -> None:
        if self._dirty:  # forget the dead first: entries of freed graphs never pile up
            self._forget_dead()
        with collector_paused():  # a batch of new objects: no collection over the whole heap midway
            live = [(ref, saved) for ref in self._pending if (saved := ref.saved()) is not None]
            self._pending.clear()  # the watch compares it with an empty snapshot again
            records = self._records_of([saved.tensor for _, saved in live])
            entries = self._entries
            added = []
            for (ref, saved), record in zip(live, records):
                site = saved.site
                entry = entries[id(saved.tensor)] = Entry(_UNNAMED, record, ref,
                                                          _site_text(site) if site is not None else None)
                added.append(entry)
            del live
            # The lookup index is built when Python is next asked about a write (rarely, for what
            # autograd saved); the write hook learns the new memory now.
            self._memory.invalidate()
            self._rebuild_index(added)

    def _scan_now(self, frames: Optional[list[Any]]) -> None:
        self._dirty = False
        if not self._watcher.watching:
            self._watcher.walk_all()  # the pending list, empty: what the write hook compares
        if self._pending:
            self._flush()
        if self._drop_dead():
            self._rebuild_index()

    def boundary_changes(self, caller: Optional[types.FrameType], rescan: bool = True) -> list[Any]:
        """Nothing to compare at a boundary: fingerprints are off (a saved tensor's values are the
        version counter's to vouch for, checked at unpack), and no code of the user's holds
        the saved (detached) tensor objects to re-point them. Protects what waits, forgets the dead."""
        self.look()
        return []

    def settle(self) -> None:
        """Paths are named when a write hits (`written_entries`); nothing else moves them."""

    @property
    def alive(self) -> int:
        """Saved tensors protected now."""
        return sum(1 for e in self._entries.values() if e.ref() is not None) + sum(
            1 for ref in self._pending if ref.saved() is not None)

    # -- writes ----------------------------------------------------------------------

    def written_entries(self, written: Sequence[torch.Tensor], kind: str, resizes: bool = False) -> list[Entry]:
        """The saved tensors a write changes, or (`counter_only`) whose version counter alone it bumps.

        A write to a sibling slice of a saved view's base changes no saved element, but
        views share one version counter, so autograd's check at backward fails all the same.
        """
        self.counter_only = frozenset()
        hit = super().written_entries(written, kind, resizes)
        if not hit and kind == "write":
            hit = self._sharing_counter(written)
            self.counter_only = frozenset(map(id, hit))
        if hit and (node := _torch.current_autograd_node()) is not None:
            hit = self._not_read_by(_torch.node_serial(node), hit)
        return self._named(hit) if hit else hit

    def _not_read_by(self, serial: Optional[int], hit: list[Entry]) -> list[Entry]:
        """`hit` less what the backward node running now has unpacked: a node's backward may
        use its saved tensors as scratch once it has read them (autograd checked them then)."""
        return [e for e in hit if (s := self.saved_of(e)) is None or s.read_by is None or s.read_by != serial]

    def _sharing_counter(self, written: Sequence[torch.Tensor]) -> list[Entry]:
        found = []
        for tensor in written:
            for entry in self._memory.in_storage_of(tensor):
                saved = entry.ref()
                if saved is not None and entry not in found and _torch.shares_version_counter(tensor, saved):
                    found.append(entry)
        return found

    def _named(self, hit: list[Entry]) -> list[Entry]:
        """`hit` with each entry's saver named, one entry per tensor saved more than once (the
        other savers as aliases)."""
        self._find_savers()
        first: dict[Any, Entry] = {}
        kept = []
        for entry in hit:
            saved = self.saved_of(entry)
            if saved is not None:
                entry.path = saved.path()
            same = first.get(entry.record[0])
            if same is None:
                first[entry.record[0]] = entry
                kept.append(entry)
                entry.aliases = ()
            elif entry.path != same.path and entry.path not in same.aliases:
                same.aliases += (entry.path,)
        return kept

    @staticmethod
    def saved_of(entry: Entry) -> Optional[Saved]:
        ref = entry.ref
        return ref.saved() if isinstance(ref, _TensorOf) else None

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
        stack = [n for t in roots if (n := _grad_fn(t)) is not None]
        kept: list[Any] = []  # wrappers held while walked, so their ids stay theirs
        seen: set[int] = set()
        while stack and unnamed and len(kept) < MAX_WALK:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            kept.append(node)
            for slot, data in _torch.saved_slots(node):
                if type(data) is Saved and data.saver is None:
                    data.saver = f"{type(node).__name__}: {slot}"
                    unnamed.pop(id(data), None)
            stack += _torch.next_nodes(node)

    def close(self) -> None:
        self.closed = True
        self.followers.clear()
        self._pending.clear()
        self._roots.clear()
        super().close()


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


def _type_text(tensor: torch.Tensor) -> str:
    try:
        return tensor.type()
    except Exception:  # noqa: BLE001
        return type(tensor).__name__

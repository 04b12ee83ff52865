"""A protected set fed one tensor at a time from outside the guarded object.

Autograd's packs (`saved.SavedSet`) and a dataset's returns (`samples.SampleSet`) arrive
one by one, not by placement into a container the guard walks. Each waits, held weakly, in
a list the write hook watches like a guarded container; the next write op (or boundary)
protects what waits in one batch.

A subclass that can tell the write hook a tensor's memory as it arrives (`_described`:
autograd's packs, with the compiled hook) keeps it out of the watched list: the hook
already stops at writes to it, and its entry is made at the next time Python is asked
about a write (or a boundary), so writes to other memory never enter Python for it.
"""

from __future__ import annotations

import types
from typing import Callable, Generic, Optional, TypeVar

import torch

from kvguard._protect.collector import collector_paused
from kvguard._protect.entries import Change, Entry
from kvguard._protect.protected import ProtectedSet
from kvguard._protect.records import Record

# How a queued set holds what waits: a weak reference of its own kind, calling it gives the tensor.
Ref = TypeVar("Ref", bound=Callable[[], Optional[torch.Tensor]])


class QueuedSet(ProtectedSet, Generic[Ref]):
    """Protects what `_pending` holds (weak references) at the next look; subclasses name each entry."""

    lets_go_of_what_left = False  # nothing is placed: each tensor is protected while it lives

    def __init__(self, name: str, fingerprint: bool = False) -> None:
        self._pending: list[Ref] = []  # weak references not protected yet: the watched container
        # (weak reference, record) of tensors the write hook knows already, their entries not made yet
        self._described: list[tuple[Ref, Record]] = []
        super().__init__(self._pending, name, None, (), fingerprint=fingerprint)

    def _entry(self, ref: Ref, tensor: torch.Tensor, record: Record) -> Entry:
        """The entry for `tensor`, queued as `ref`."""
        raise NotImplementedError

    def look(self) -> None:
        if self._pending or self._described:
            self._flush()  # which forgets the dead first
        elif self._dirty:
            self._forget_dead()

    def _flush(self) -> None:
        if self._dirty:  # forget the dead first: entries of freed tensors never pile up
            self._forget_dead()
        if not self._pending and not self._described:
            return  # nothing waits: the lookup index stands
        with collector_paused():  # a batch of new objects: no collection over the whole heap midway
            live = [(ref, tensor) for ref in self._pending if (tensor := ref()) is not None]
            self._pending.clear()  # the watch compares it with an empty snapshot again
            records = self._records_of([tensor for _, tensor in live])
            entries = self._entries
            added = []
            for (ref, tensor), record in zip(live, records):
                entry = entries[id(tensor)] = self._entry(ref, tensor, record)
                added.append(entry)
            known = []  # the write hook has their memory already
            for ref, record in self._described:
                tensor = ref()
                if tensor is not None:
                    entry = entries[id(tensor)] = self._entry(ref, tensor, record)
                    known.append(entry)
            self._described.clear()
            del live
            tensor = None  # no reference kept past the look
            # The new entries are merged into the lookup index (a rebuild per flush made every write
            # Python judges while packs arrive, batch norm's statistics in each forward, sort the
            # whole set again); the write hook learns the new memory now.
            self._entered(added, known)

    def _entered(self, added: list[Entry], known: list[Entry]) -> None:
        """Entries were made: `added` for tensors the write hook does not know yet, `known` for
        those it was told of as they arrived."""
        if added or known:
            self._rebuild_index(added + known)

    def _scan_now(self, frames: Optional[list[types.FrameType]]) -> None:
        self._dirty = False
        if not self._watcher.watching:
            self._watcher.walk_all()  # the pending list, empty: what the write hook compares
        if self._pending or self._described:
            self._flush()
        if self._drop_dead():
            self._rebuild_index()

    def boundary_changes(self, caller: Optional[types.FrameType], rescan: bool = True) -> list[Change]:
        """Nothing to compare at a boundary (fingerprints are off: these tensors' values are their
        writes' to tell); protects what waits and forgets the dead."""
        self.look()
        return []

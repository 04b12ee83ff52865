"""A protected set fed one tensor at a time from outside the guarded object.

Autograd's packs (`saved.SavedSet`) and a dataset's returns (`samples.SampleSet`) arrive
one by one, not by placement into a container the guard walks. Each waits, held weakly, in
a list the write hook watches like a guarded container; the next write op (or boundary)
protects what waits in one batch.
"""

from __future__ import annotations

import types
from typing import Any, Optional

import torch

from kvguard._protect.collector import collector_paused
from kvguard._protect.entries import Entry
from kvguard._protect.protected import ProtectedSet
from kvguard._protect.records import Record


class QueuedSet(ProtectedSet):
    """Protects what `_pending` holds (weak references) at the next look; subclasses name each entry."""

    def __init__(self, name: str, fingerprint: bool = False) -> None:
        self._pending: list[Any] = []  # weak references not protected yet: the watched container
        super().__init__(self._pending, name, None, (), fingerprint=fingerprint)

    def _entry(self, ref: Any, tensor: torch.Tensor, record: Record) -> Entry:
        """The entry for `tensor`, queued as `ref`."""
        raise NotImplementedError

    def look(self) -> None:
        if self._pending:
            self._flush()  # which forgets the dead first
        elif self._dirty:
            self._forget_dead()

    def _flush(self) -> None:
        if self._dirty:  # forget the dead first: entries of freed tensors never pile up
            self._forget_dead()
        with collector_paused():  # a batch of new objects: no collection over the whole heap midway
            live = [(ref, tensor) for ref in self._pending if (tensor := ref()) is not None]
            self._pending.clear()  # the watch compares it with an empty snapshot again
            records = self._records_of([tensor for _, tensor in live])
            entries = self._entries
            added = []
            for (ref, tensor), record in zip(live, records):
                entry = entries[id(tensor)] = self._entry(ref, tensor, record)
                added.append(entry)
            del live
            # The lookup index is built when Python is next asked about a write (rarely, for what
            # arrives this way); the write hook learns the new memory now.
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
        """Nothing to compare at a boundary (fingerprints are off: these tensors' values are their
        writes' to tell); protects what waits and forgets the dead."""
        self.look()
        return []

"""What the protected set keeps per tensor (`Entry`) and what a boundary check finds on one (`Change`)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

from kvguard._protect import digest as _digest
from kvguard._protect import geometry as _geometry
from kvguard._protect import records as _records


class Change(NamedTuple):
    """What a boundary check found on one entry: `values` changed (digests), or its `memory` moved (texts)."""

    entry: Entry
    tensor: torch.Tensor
    kind: str
    was: Any
    now: Any


class Entry:
    """One protected tensor: its path, placement, memory and layout (a `records` record) and digest."""

    __slots__ = ("path", "ref", "record", "placed_at", "digest", "explained", "aliases", "detached")

    def __init__(self, path: str, record: _records.Record, ref: Callable[[], Optional[torch.Tensor]],
                 placed_at: Optional[str]) -> None:
        self.path = path
        self.ref = ref
        self.record = record
        self.placed_at = placed_at
        self.digest: _digest.Digest = record.digest  # its values when last looked at (see `digest`)
        self.explained = False  # an op event reported a write since then
        self.aliases: tuple[str, ...] = ()  # other paths to the same tensor object
        self.detached = False  # no longer reachable from the guarded object

    @property
    def spans(self) -> list[_geometry.Span]:
        return _records.spans(self.record)


class StrongRef:
    """Stands in for a weak reference while one must not exist."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __call__(self) -> torch.Tensor:
        return self.tensor

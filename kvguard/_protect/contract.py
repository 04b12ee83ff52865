"""The protected set's contract: what the guard, the judge and the write-hook engines use of one.

Two implementations keep the protected tensors (`protected.ProtectedSet`, entries in
Python; `native.NativeSet`, rows of a C++ table), and each guard kind feeds its own
(`saved.SavedSet`, `weights.ModuleSet`, `samples.SampleSet`). Code outside this room
reads a set only through `Protected`, and asks what a set is by its capabilities (the
attributes of `Capabilities`), never by its class. mypy checks every set against
`Protected` (each module's last lines), and `tests/test_protected_contract.py` compares
their signatures.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, AbstractSet, Callable, Hashable, Optional, Protocol, Sequence, TypeAlias

if TYPE_CHECKING:
    import torch

    from kvguard._protect.entries import Change, Entry
    from kvguard._report.events import EventKind

# What one look protected, as a set tells its engine (`on_index`) and the engine hands back
# (`publish`, `holds_inference`): the new entries; None: the protected memory changed otherwise.
Added: TypeAlias = Optional[list["Entry"]]
# A watched container and what it held, as the compiled hook compares them before each write.
SnapshotPairs: TypeAlias = Optional[list[tuple[tuple[object, ...], tuple[object, ...]]]]


class Publisher(Protocol):
    """Where a set publishes its memory: a write-hook backend (`kvguard._engine.backend.Backend`)."""

    def add_protected(self, intervals: Sequence[tuple[int, int]], identities: Sequence[int],
                      replace: bool = False) -> None: ...


class Judging(Protocol):
    """One guard's judge, as another set on the same hook sees it."""

    @property
    def protected(self) -> Protected: ...


class Hook(Protocol):
    """A write-hook engine, as a set attached to it sees it (`kvguard._engine.hooks.HookEngine`)."""

    @property
    def backend(self) -> Publisher: ...

    @property
    def judges(self) -> Sequence[Judging]: ...


class Capabilities:
    """What a set can do or counts beyond protecting tensors, with a plain guard's answers.

    A kind's set says otherwise where it differs (autograd's in `saved`, the weights' in
    `weights`); the judge and the guard read these instead of asking for a class.
    """

    # Whether writes that no version counter sees (`OpFacts.uncounted`: batch norm's running
    # statistics) concern this set: not for autograd's, whose check never sees them either.
    judges_uncounted = True
    # Whether only the values matter, as backward reads them: a re-pointing to the same values
    # changes nothing, and a write autograd's version counter misses is worth saying (autograd's).
    values_only = False
    # Whether it holds a model's weights: a blocked write's hint names the optimizer step (the weights').
    holds_weights = False
    # Entries of the last `written_entries` whose elements the write misses but whose version
    # counter it bumps: only autograd's saved tensors have such.
    counter_only: frozenset[int] = frozenset()
    graphs = 0  # forward passes that saved what the set protects (autograd's)
    steps = 0  # optimizer steps the set stepped aside for (the weights')
    unprotected = 0  # stretches it could not protect, under other saved-tensor hooks (autograd's)

    @property
    def buffer_count(self) -> int:
        """Receive buffers watched for refills so far (the weights' on a rollout engine's side)."""
        return 0

    def attach_backend(self, backend: Optional[Publisher]) -> None:
        """The write-hook backend this set's guard is attached to (None: detached). Only a set that
        publishes what it protects as it arrives (autograd's packs) keeps it."""

    def attach_hook(self, hook: Optional[Hook]) -> None:
        """The write-hook engine this set's guard is attached to (None: detached). Only a set that
        has the hook admit a known batch of writes (an optimizer step's) keeps it."""

    def findings(self, hit: Sequence[Entry]) -> tuple[dict[int, tuple[EventKind, str]], dict[int, str]]:
        """The set's own findings on the entries a write hit, (kind, why) by entry id, and the fix a
        stopped write's hint says, by entry id: none but a kind's (the weights' `written_twice`)."""
        return {}, {}

    def stored_since_look(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether one of `tensors` was stored into the guarded object since the last look, heard
        at its store (Python 3.12+): a re-pointing no op shows (`swap_tensors`) looks first then."""
        return False


class Protected(Protocol):
    """What code outside `kvguard._protect` uses of a protected set (see the module docstring)."""

    # -- capabilities (`Capabilities`) -------------------------------------------------

    @property
    def judges_uncounted(self) -> bool: ...

    @property
    def values_only(self) -> bool: ...

    @property
    def holds_weights(self) -> bool: ...

    @property
    def counter_only(self) -> frozenset[int]: ...

    @property
    def graphs(self) -> int: ...

    @property
    def steps(self) -> int: ...

    @property
    def unprotected(self) -> int: ...

    @property
    def buffer_count(self) -> int: ...

    def attach_backend(self, backend: Optional[Publisher]) -> None: ...

    def attach_hook(self, hook: Optional[Hook]) -> None: ...

    def findings(self, hit: Sequence[Entry]) -> tuple[dict[int, tuple[EventKind, str]], dict[int, str]]: ...

    def stored_since_look(self, tensors: Sequence[torch.Tensor]) -> bool: ...

    # -- what the engines use: placements, and the memory they publish -------------------

    on_index: Optional[Callable[[Added], None]]  # told when the protected memory changes

    @property
    def watching(self) -> bool: ...

    def look(self) -> None: ...

    def snapshot_pairs(self) -> SnapshotPairs: ...

    def publish(self, backend: Publisher, added: Added, replace: bool) -> bool: ...

    def holds_inference(self, added: Added = None) -> bool: ...

    def intervals(self) -> list[tuple[int, int]]: ...

    def identities(self) -> list[int]: ...

    # -- what the judge uses: the entries a write touches, and what it did to them -------

    def written_entries(self, written: Sequence[torch.Tensor], kind: str, resizes: bool = False) -> list[Entry]: ...

    def entry_of(self, tensor: torch.Tensor) -> Optional[Entry]: ...

    def tensor_of(self, entry: Entry) -> Optional[torch.Tensor]: ...

    def tensors_at(self, path: str) -> list[torch.Tensor]: ...

    def settle(self) -> None: ...

    def drifted(self, entries: list[Entry]) -> list[Entry]: ...

    def explain(self, entries: list[Entry], settled: bool = True) -> None: ...

    def relayout(self, entry: Entry) -> None: ...

    def note(self, entry: Entry, what: str) -> None: ...

    def release(self, tensors: tuple[torch.Tensor, ...]) -> Callable[[], None]: ...

    # -- what the guard uses: boundaries, counts, the end ---------------------------------

    final: bool  # set just before the exit check: nothing is compared after it

    @property
    def protected_count(self) -> int: ...

    @property
    def keys_seen(self) -> AbstractSet[Hashable]: ...

    def boundary_changes(self, caller: Optional[types.FrameType], rescan: bool = True) -> list[Change]: ...

    def close(self) -> None: ...

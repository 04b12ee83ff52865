"""Other saved-tensor hooks pushed while `guard_autograd`'s are innermost, composed with them.

Hooks do not nest, so hooks pushed inside the guard's (non-reentrant checkpointing, first
forward and recomputation; `save_on_cpu`; offloading) would replace them. `Composed` runs
theirs inside kvguard's: their pack keeps what it keeps, and the tensor it saved is
protected besides, held weakly (`Lent`) for as long as both it and what their pack kept
live. `saved.compose` decides when to compose.
"""

from __future__ import annotations

import sys
import weakref
from typing import Callable, Optional, Protocol

import torch

from kvguard._protect import frames as _frames
from kvguard._protect.saved_packs import Saved
from kvguard._torch import autograd as _autograd

Pack = Callable[[torch.Tensor], object]  # a saved-tensor pack hook
Unpack = Callable[[object], torch.Tensor]  # its unpack hook


class Lender(Protocol):
    """The set a `Composed` pair protects what it saves for (`saved.SavedSet`)."""

    closed: bool
    unprotected: int

    def lend(self, saved: Saved, tensor: torch.Tensor, owner: Optional[Kept]) -> None: ...

    def read(self, saved: Saved) -> None: ...


class Kept:
    """What autograd holds under composed hooks: what their pack returned, and kvguard's `Saved`."""

    __slots__ = ("inner", "saved", "__weakref__")

    def __init__(self, inner: object, saved: Saved) -> None:
        self.inner = inner
        self.saved = saved


class Lent(weakref.ref):  # type: ignore[type-arg]
    """An entry's reference under composed hooks: weak to the saved tensor (or to the alias their
    hook keeps), and to the `Kept` that autograd holds when the tensor outlives it (`owner`).

    A saved view is often a temporary (the 2-D view `linear` makes of a 3-D input) that dies
    at once: then the reference is weak to its base, and a detached alias of the view (the
    same memory and version counter, no reference to the base) is held until the base dies.
    """

    key: int  # the entry's key in the set, once it has one (see `saved_packs.TensorOf`)

    def __new__(cls, tensor: torch.Tensor, callback: Callable[[Lent], None], saved: Saved,
                owner: Optional[Kept]) -> Lent:
        base = _autograd.view_base(tensor)
        return super().__new__(cls, base if base is not None else tensor, _lent_died)

    def __init__(self, tensor: torch.Tensor, callback: Callable[[Lent], None], saved: Saved,
                 owner: Optional[Kept]) -> None:
        base = _autograd.view_base(tensor)  # `__new__` set the referent and the callback
        self.view = tensor.detach() if base is not None else None
        self.info = saved
        self.on_death = callback
        self.owner = weakref.ref(owner, callback) if owner is not None else None  # type: ignore[arg-type]

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


def _lent_died(ref: Lent) -> None:
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

    def __init__(self, pack: Pack, unpack: Unpack, owner: Lender) -> None:
        self.their_pack, self.their_unpack, self.owner = pack, unpack, owner

    def pack(self, tensor: torch.Tensor) -> object:
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
            owner.lend(saved, inner if alias and isinstance(inner, torch.Tensor) else tensor,
                       None if alias else kept)
        except Exception:  # noqa: BLE001 - never fail the user's forward; but never call it clean
            owner.unprotected += 1
            return inner
        return kept

    def unpack(self, kept: object) -> torch.Tensor:
        if type(kept) is not Kept:
            return self.their_unpack(kept)
        self.owner.read(kept.saved)
        return self.their_unpack(kept.inner)

"""The guard kinds a `KVGUARD_TARGETS` word switches on for a whole process, each one object. Stdlib only.

`autograd`, `weights` and `data` each watch what no function argument names (what autograd
saves, every optimizer's parameters, what every dataset returns): one guard per process,
whose writes are counted under the kind's word and dated by its moment (a forward pass, an
optimizer step). Everything that differs between kinds *in words* lives here, so the
settings, the tally, the exit lines and `kvguard report` read it from one place; what
differs *in behaviour* lives in the kind's guard class (`Kind.guard`, in `kvguard/_guard/`),
its protected set (in `kvguard/_protect/`, meeting `kvguard._protect.contract`) and its
activation (`Kind.activation`, in `kvguard/_activate/`). docs/architecture.md has the
checklist for adding one.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Optional

from kvguard._text import plural


@dataclasses.dataclass(frozen=True)
class Moment:
    """What a kind's writes are dated by: `forward pass 3`, `after optimizer step 2`."""

    one: str  # `forward pass`
    many: str  # `forward passes`
    word: str  # how the watched line joins them: `in` 12 forward passes, `over` 12 optimizer steps
    none: str = ""  # said instead when there were none (`(no optimizer step)`); empty: `in 0 …`
    at_sites: bool = False  # whether a site's exit line counts them too (`… in 3 forward passes (first: …)`)

    def count(self, n: int) -> str:
        return f"{self.word} {plural(n, self.one, self.many)}" if n or not self.none else self.none


@dataclasses.dataclass(frozen=True)
class Kind:
    """One process-wide guard kind: its word, what it watches, and how its lines say it."""

    word: str  # the KVGUARD_TARGETS word, and the label its guard is counted under
    what: str  # what it protects, for help and docs: `what autograd saves, in every forward pass`
    held: tuple[str, str]  # what it counts, one and many: (`saved tensor`, `saved tensors`)
    verb: str  # `protected`, `watched`
    guard: str  # its guard class, `module:Class`, imported when the kind starts
    activation: str = "kvguard._activate.process_kind"  # the module that starts and stops it
    moment: Optional[Moment] = None  # what its writes are dated by; None: not dated
    # Said instead of "no in-place writes" when the guard ran but never held a tensor
    # (a launcher that imports torch, a main process whose DataLoader workers did the loading).
    nothing_seen: str = ""
    # Said when the switch was on and torch loaded, but the guard never started.
    never_started: str = ""
    # How a site's first write is dated in the exit line, from its moment (None: not known).
    first_when: Callable[[Optional[int]], str] = lambda moment: ""

    def watched(self, protected: int, moments: int) -> str:
        """`1,204 saved tensors protected in 12 forward passes`."""
        text = f"{plural(protected, *self.held)} {self.verb}"
        return f"{text} {self.moment.count(moments)}" if self.moment is not None else text

    def guard_class(self) -> type:
        """The kind's guard class (importing it imports torch)."""
        module, _, name = self.guard.partition(":")
        cls: type = getattr(importlib.import_module(module), name)
        return cls


AUTOGRAD = Kind(
    "autograd", "what autograd saves for backward, in every forward pass", ("saved tensor", "saved tensors"),
    "protected", "kvguard._guard.autograd:AutogradGuard",
    moment=Moment("forward pass", "forward passes", "in", at_sites=True),
    nothing_seen="no forward pass saved a tensor for backward here, so no write was checked",
    never_started="the guard never started here, so nothing was saved for backward",
    first_when=lambda moment: f", forward pass {moment}" if moment else "",
)
WEIGHTS = Kind(
    "weights", "every optimizer's parameters and buffers outside its step, and every module's weights from its "
    "first load on (load_state_dict, load_weights, a rollout engine's weight sync), with what a load receives",
    ("parameter and buffer", "parameters and buffers"), "watched",
    "kvguard._guard.module:ModuleGuard", activation="kvguard._activate.weights",
    moment=Moment("optimizer step", "optimizer steps", "over", "(no optimizer step)"),
    nothing_seen="no parameter or buffer was watched here, so no write was checked",
    first_when=lambda moment: "" if moment is None else (
        ", before the first optimizer step" if moment == 0 else f", after optimizer step {moment}"),
)
DATA = Kind(
    "data", "what every dataset returns, from then on", ("tensor returned by datasets", "tensors returned by datasets"),
    "protected", "kvguard._guard.data:DataGuard",
    nothing_seen="no dataset returned a tensor here, so no write was checked (DataLoader workers say their own)",
)

KINDS: dict[str, Kind] = {kind.word: kind for kind in (AUTOGRAD, WEIGHTS, DATA)}


def kind_of(label: str) -> Optional[Kind]:
    """The kind a tally label is, or None for a function's or a named guard's label."""
    return KINDS.get(label)


def register(kind: Kind) -> Callable[[], None]:
    """Add a kind (a plugin's, a test's toy); returns its removal."""
    if kind.word in KINDS or kind.word in ("all",):
        raise ValueError(f"a guard kind named {kind.word!r} exists already")
    KINDS[kind.word] = kind

    def remove() -> None:
        if KINDS.get(kind.word) is kind:
            del KINDS[kind.word]
    return remove

"""`MutationGuardMode`: see every op, find the ones that write protected memory.

The mode turns a protected write into a `MutationEvent` and hands it to a callback; what
to do about it (raise, warn, record) is the caller's policy. With `block=True` the
callback runs before the op, so raising there leaves the data intact.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvguard import _diff, _frames, _torch
from kvguard._events import MutationEvent
from kvguard._protect import Entry, ProtectedSet

_facts_cache = _torch._facts_cache
_op_facts = _torch.op_facts
_COPY = torch.ops.aten.copy_.default
FREED_DIFF = "values not compared (the tensor was freed before they could be read)"
# What a write's report compares against: the values it could change, copied just before
# it (None when they could not be read), and which flat index ranges those are (None: all).
_Copy = tuple[Optional[torch.Tensor], Optional[list[tuple[int, int]]]]


class MutationGuardMode(TorchDispatchMode):
    """Reports every op that writes memory of a `ProtectedSet`.

    Ops that write nothing cost one dict lookup on top of the dispatch itself; stacks
    are captured only for a protected write.
    """

    def __init__(self, protected: ProtectedSet, on_event: Callable[..., None],
                 block: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.protected = protected
        self.on_event = on_event
        self.block = block
        self.ops = 0  # ops dispatched under the mode: none means the guarded code did no tensor work

    def __enter__(self) -> MutationGuardMode:
        self._unhook_swap = _torch.on_swap_tensors(self._on_swap)
        try:
            return super().__enter__()  # type: ignore[no-untyped-call,no-any-return]
        except BaseException:
            self._unhook_swap()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            self.unhook()

    def unhook(self) -> None:
        """Stop wrapping `swap_tensors` for this mode (also when it leaves the stack out of order)."""
        self._unhook_swap()

    def _on_swap(self, t1: torch.Tensor, t2: torch.Tensor) -> Callable[[bool], None]:
        """`torch.utils.swap_tensors` on a protected tensor: report it like `set_` (if it swapped)."""
        protected = self.protected
        hit = [e for e in (protected.entry_of(t1), protected.entry_of(t2)) if e is not None]
        if not hit:
            return lambda swapped: None
        site = _frames.user_site()
        for entry in protected.drifted(hit):  # a change no op saw, which the swap would hide
            self.on_event(self._drift_event(entry, site), True)
        before = {id(e): _describe(protected.tensor_of(e)) for e in hit}
        if self.block:
            for entry in hit:
                self.on_event(self._event(_torch.SWAP_OP, "repoint", entry, site, blocked=True))
        restore = protected.release((t1, t2))

        def after(swapped: bool) -> None:
            restore()
            if not swapped:  # torch refused: nothing changed, nothing to report
                return
            protected.explain(hit)
            for entry in hit:
                self.on_event(self._event(_torch.SWAP_OP, "repoint", entry, site, blocked=False,
                                          before_meta=before[id(entry)]))
        return after

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        cached = _facts_cache.get(id(func))
        facts = cached[1] if cached is not None else _op_facts(func)
        if not facts.written:
            return func(*args, **(kwargs or {}))
        return self._on_write(func, facts, args, kwargs or {})

    def _on_write(self, func: Any, facts: _torch.OpFacts, args: Any, kwargs: dict[str, Any]) -> Any:
        protected = self.protected
        written: Sequence[torch.Tensor]
        if facts.self_only and args:
            written = (args[0],)
        else:
            written = _torch.written_tensors(facts, args, kwargs)
        hit = protected.written_entries(written, facts.kind, facts.resizes)
        if not hit or (func is _COPY and _is_self_copy(args)):
            return func(*args, **kwargs)

        site = _frames.user_site()
        for entry in protected.drifted(hit):  # changed since the last look, by nothing we saw:
            self.on_event(self._drift_event(entry, site), True)  # too late to stop, so never raised
        if self.block:
            for entry in hit:
                self.on_event(self._event(func, facts.kind, entry, site, blocked=True))
            # The callback chose not to stop the write: fall through and report it.
        # A copy of what this write can change in each entry, taken just before it and
        # dropped once the event is built: memory in proportion to the write, held briefly.
        copies: dict[int, _Copy] = {}
        if facts.kind == "write":
            windows = _torch.write_windows(written)
            for entry in hit:
                tensor = protected.tensor_of(entry)
                if tensor is not None:
                    ranges = _torch.flat_ranges(tensor, windows)
                    copies[id(entry)] = (_diff.snapshot(tensor, ranges), ranges)
        before_meta = {} if facts.kind == "write" else {
            id(e): _describe(protected.tensor_of(e)) for e in hit}
        out = func(*args, **kwargs)
        # Reported here, not again by the next boundary check; c10d writes land at `wait()`.
        protected.explain(hit, settled=getattr(func, "namespace", "") != "c10d")
        for entry in hit:
            if facts.kind != "write":
                protected.relayout(entry)
            event = self._event(func, facts.kind, entry, site, blocked=False,
                                before_meta=before_meta.get(id(entry)), copy=copies.pop(id(entry), None))
            self.on_event(event)
        return out

    def _drift_event(self, entry: Entry, site: _frames.Site) -> MutationEvent:
        """A change no op reported, found just before a reported write would hide it."""
        tensor = self.protected.tensor_of(entry)
        return MutationEvent(
            path=entry.path, op="(no dispatched op)", kind="unobserved", blocked=False,
            filename=site.filename, lineno=site.lineno, code=site.code, function=site.function,
            placed_at=entry.placed_at, tensor=_describe(tensor), before="(a digest)", after=_values(tensor),
            diff="values changed before this line's write with no dispatched write: a numpy view, a raw "
                 "pointer, another thread or a compiled kernel?",
            aliases=tuple(entry.aliases), detached=entry.detached,
        )

    def _event(self, func: Any, kind: str, entry: Entry, site: _frames.Site, blocked: bool,
               before_meta: Optional[str] = None, copy: Optional[_Copy] = None) -> MutationEvent:
        """The event for one protected entry; its summaries never raise (see `_diff`)."""
        tensor = self.protected.tensor_of(entry)
        described = _describe(tensor)
        if blocked:
            before = _values(tensor)
            after = None
            diff = "not applied: raised before the write, the data is intact"
        elif kind == "write":
            # Show the values where this write starts changing them, not just the first few.
            values, ranges = copy if copy is not None else (None, None)
            if tensor is None:
                first, diff = 0, FREED_DIFF
                before = _diff.values(values) if values is not None else _diff.NO_COPY
            else:
                first, diff = _diff.compare(tensor, values, ranges)
                before = _diff.values(tensor, first, before=values, ranges=ranges) if values is not None else (
                    _diff.NO_COPY)
            after = _values(tensor, first)
        else:
            before = before_meta or described
            after = described
            diff = "metadata only: the values were not written" if kind == "metadata" else (
                "the tensor now refers to other memory (its values are no longer the guarded ones)")
        return MutationEvent(
            path=entry.path, op=_torch.short_op_name(func), kind=kind, blocked=blocked,
            filename=site.filename, lineno=site.lineno, code=site.code, function=site.function,
            placed_at=entry.placed_at, tensor=described, before=before, after=after, diff=diff,
            aliases=tuple(entry.aliases), detached=entry.detached,
        )


def _describe(tensor: Optional[torch.Tensor]) -> str:
    return _diff.describe(tensor) if tensor is not None else "<freed>"


def _values(tensor: Optional[torch.Tensor], around: int = 0) -> str:
    return _diff.values(tensor, around) if tensor is not None else "<freed>"


def _is_self_copy(args: Any) -> bool:
    """`k[-1] += r` ends with `copy_(view, view)`: a no-op that is not a new write."""
    if len(args) < 2 or not isinstance(args[1], torch.Tensor):
        return False
    dst, src = args[0], args[1]
    try:
        return bool(dst.dtype == src.dtype and dst.device == src.device and dst.shape == src.shape
                and dst.stride() == src.stride() and dst.data_ptr() == src.data_ptr()
                and dst.is_conj() == src.is_conj() and dst.is_neg() == src.is_neg())
    except Exception:  # noqa: BLE001
        return False

"""`WriteJudge`: one guard's verdict on one writing op, whichever engine saw it.

An engine (`choice`) finds the ops that write; the judge decides whether a write
touches the guard's `ProtectedSet`, turns it into `MutationEvent`s and hands them to the
guard's callback. With `block=True` the callback runs before the op, so raising there
leaves the data intact.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from kvguard._engine import collectives as _collectives
from kvguard._engine import diff as _diff
from kvguard._engine import hints as _hints
from kvguard._report.events import MutationError
from kvguard._protect import frames as _frames
from kvguard._protect import geometry as _geometry
from kvguard._protect.entries import Change, Entry
from kvguard._protect.contract import Protected
from kvguard._report.events import EventKind, MutationEvent
from kvguard._torch import autograd as _autograd
from kvguard._torch import ops as _ops
from kvguard._torch import patches as _patches
from kvguard._torch import tensors as _tensors

FREED_DIFF = "values not compared (the tensor was freed before they could be read)"
UNOBSERVED_DIFF = ("values changed with no dispatched write: a numpy view, a raw pointer, another thread or "
                   "a compiled kernel?")
LIGHT_DIFF = ("values changed during the guard (level='light' watches no op, so the writing line "
              "is not known: level='full' names it)")
MEMORY_DIFF = "identity or memory changed with no dispatched op (k.data = ..., or code the guard cannot see)"
DRIFT_DIFF = ("values changed before this line's write with no dispatched write: a numpy view, a raw pointer, "
              "another thread or a compiled kernel?")
META_VALUES = "(a meta tensor holds no data)"
ALIAS_DIFF = ("a write naming {named} element{s} changes {changed}: this tensor's elements share memory "
              "(a dimension of stride 0, from expand), so a write to one changes every element sharing it")
CAPTURE_VALUES = "(not read: a CUDA graph is being captured on this stream)"
CAPTURE_DIFF = ("values not compared: the write was recorded into a CUDA graph being captured, and runs when "
                "the graph replays (a replay's change is found at the next boundary check)")
META_DIFF = "values not compared: a meta tensor holds no data (the write covers some of its elements)"
# The event kinds of this module's own findings (the others are the op's: `_ops.OpFacts.kind`).
REDUCED_TWICE: EventKind = "reduced_twice"
SELF_OVERLAP: EventKind = "self_overlap"
TWICE_DIFF = ("{op} reached this memory a second time at this line in this guarded call, and it is held under "
              "{n} paths ({paths}): a loop over them applies the op to it twice (an all_reduce sums it twice)")
OVERLAP_DIFF = ("the op reads {read} while writing {written} in the same memory, shifted: it reads elements it "
                "also writes, so what it reads depends on the order its kernel writes in (read from a copy: "
                "src.clone())")
PENDING_AT = ("read {when}, with no wait() of the collective seen before: it may still have been pending then")
# In-place ops that combine a tensor's values with others' (a collective's reduction, an accumulation):
# applied twice to one memory, the result is wrong (summed twice), unlike an overwrite done twice.
_REDUCING = frozenset({"allreduce_", "allreduce_coalesced_", "reduce_", "add_", "sub_", "mul_", "div_",
                       "addcmul_", "addcdiv_", "_foreach_add_", "_foreach_sub_", "_foreach_mul_", "_foreach_div_"})
_COPY = torch.ops.aten.copy_.default
# What a write's report compares against: the values it could change, copied just before
# it (None when they could not be read), and which flat index ranges those are (None: all).
_Copy = tuple[Optional[torch.Tensor], Optional[list[tuple[int, int]]]]
_local = threading.local()  # .stopped: a guard stopped the op being dispatched on this thread


class PendingWrite:
    """What a judge does once the op it judged has run: report what landed.

    Called as `after()` once the write is done, `after(True)` when the op raised; when it
    raised because another guard stopped it (`judge_all`), every entry this judge found is
    reported as a blocked write: every guard whose memory a write touches records it.
    """

    __slots__ = ("_done", "_stopped")

    def __init__(self, done: Callable[[bool], None], stopped: Callable[[], None]) -> None:
        self._done, self._stopped = done, stopped

    def __call__(self, failed: bool = False) -> None:
        if failed and getattr(_local, "stopped", False):
            self._stopped()
        else:
            self._done(failed)

    def stopped(self) -> None:
        """Another guard raised before the write: record it as blocked (nothing landed)."""
        self._stopped()


After = Callable[..., None]  # after(failed=False): a PendingWrite, or several in a row


def judge_all(judges: Iterable[WriteJudge], func: Any, facts: _ops.OpFacts, written: Sequence[torch.Tensor],
              args: Sequence[Any] = (), more: Callable[[], Iterable[WriteJudge]] = tuple,
              read: Any = ()) -> list[PendingWrite]:
    """Every judge's verdict on one op, in the order the op reaches them (`more()`: those
    it would reach afterwards, asked only when one stops it). `read`: the tensors the op only
    reads that share a storage with what it writes, or a function returning them (asked on a hit).

    When a guard stops the write, the others still record it (as blocked), then its
    `MutationError` is raised: a write touching several guards' memory is in each report.
    """
    _local.stopped = False
    judged = getattr(_local, "graph_storages", None)
    if judged and all(_tensors.storage_address(t) in judged for t in written):
        return []  # a compiled graph's own write to an input it mutates: judged before the graph ran
    pending: list[PendingWrite] = []
    stop: Optional[MutationError] = None
    for judge in judges:
        try:
            found = judge.begin(func, facts, written, args, stop=stop is None, read=read)
        except MutationError as exc:
            stop = exc
            continue
        if found is not None:
            pending.append(found)
    if stop is None:
        return pending
    for judge in more():
        found = judge.begin(func, facts, written, args, stop=False, read=read)
        if found is not None:
            pending.append(found)
    for found in pending:
        found.stopped()
    _local.stopped = True  # the judges of engines that saw the op before these report it blocked too
    raise stop


def judged_as_graph_writes(tensors: Sequence[torch.Tensor]) -> Callable[[], None]:
    """While a compiled graph whose writes to `tensors` were judged runs on this thread, the ops
    it dispatches into their memory are not judged again (an inductor wrapper's `aten.copy_`).
    Returns the undo."""
    outer = getattr(_local, "graph_storages", None)
    _local.graph_storages = (outer or frozenset()) | {_tensors.storage_address(t) for t in tensors}

    def undo() -> None:
        _local.graph_storages = outer
    return undo


class WriteJudge:
    """Reports the writes of one guard's protected set; engines call `begin` per writing op."""

    def __init__(self, protected: Protected, on_event: Callable[..., None], block: bool) -> None:
        self.protected = protected
        self.on_event = on_event
        self.block = block
        self._values_only = protected.values_only  # autograd's: only the values backward reads matter
        self._reached: dict[tuple[str, int, str, int], int] = {}  # reducing op at a line on an entry: times

    def begin(self, func: Any, facts: _ops.OpFacts, written: Sequence[torch.Tensor],
              args: Sequence[Any] = (), stop: bool = True, read: Any = ()) -> Optional[PendingWrite]:
        """Judge an op about to write `written`; returns what to run once it has, if anything.

        Raises (through the guard's callback) to stop the write; with `stop` false, another
        guard stops it: a blocking guard records its blocked events and raises nothing.
        `args` are the op's positional arguments where the engine has them (a self-copy is
        no write). Engines call it through `judge_all`. `read`: the tensors it only reads that
        share a storage with what it writes (or a function returning them): one whose elements
        overlap the written ones elsewhere makes the write a `self_overlap`.
        """
        protected = self.protected
        if not protected.judges_uncounted:
            if facts.uncounted:
                return None
            if facts.unreturned and len(written) == len(facts.written):  # writes no version counter sees
                written = [t for i, t in enumerate(written) if i not in facts.unreturned]
        hit = protected.written_entries(written, facts.kind, facts.resizes)
        if not hit or (func is _COPY and is_self_copy(args)):
            return None
        protected.settle()  # the report names every path to the tensor, as of now
        site = _frames.user_site()
        capturing = _tensors.capturing()  # no copy, digest or value read: each would break the user's capture
        counter_only = protected.counter_only  # saved tensors whose version counter alone it bumps
        # Each written entry's tensor, read once before the op (a weak reference may die at any read).
        tensors = {id(e): protected.tensor_of(e) for e in hit} if facts.kind == "write" else {}
        aliased = _aliased(hit, tensors, written) if facts.kind == "write" else {}
        unversioned = _unversioned(hit, tensors, written, counter_only) if self._values_only and tensors else set()
        # Other paths to this memory: the entry's own (the same tensor), and the other entries this write
        # reaches in the same memory (not those it writes beside it: batch norm's mean and variance).
        shared = _sharing(hit, protected)
        notes: dict[int, tuple[EventKind, str]] = {}  # by entry: its kind, when the write's own, and why
        if facts.kind == "write":
            read = read() if callable(read) else read
            overlap = _geometry.partial_overlap(written, read) if read else None
            if overlap is not None:
                why = OVERLAP_DIFF.format(read=_placed(read[overlap[1]]), written=_placed(written[overlap[0]]))
                notes.update((id(e), (SELF_OVERLAP, why)) for e in hit)
            notes.update(self._reduced_twice(func, site, hit, shared))
        # The set's own findings on these entries (a weights set's written_twice), and their fixes.
        own_notes, fixes = protected.findings(hit)
        notes.update(own_notes)
        drifted = protected.drifted(hit) if not capturing else []
        for entry in drifted:  # changed since the last look, by nothing we saw:
            self.on_event(unobserved_event(entry, protected.tensor_of(entry), site, DRIFT_DIFF,
                                           before="(a digest)"), True)  # too late to stop: never raised
        if self.block:
            for entry in hit:
                self.on_event(self._event(func, _kind(facts, entry, counter_only, aliased, notes), entry, site,
                                          blocked=True, alias=aliased.get(id(entry)),
                                          unversioned=id(entry) in unversioned, shared=shared[id(entry)],
                                          note=notes.get(id(entry)), fix=fixes.get(id(entry), "")), not stop)
            if not stop:
                return None
            # The callback chose not to stop the write: fall through and report it.
        # A copy of what this write can change in each entry, taken just before it and
        # dropped once the event is built: memory in proportion to the write, held briefly.
        copies: dict[int, _Copy] = {}
        if facts.kind == "write" and not capturing:
            windows = _geometry.write_windows(written)
            for entry in (e for e in hit if id(e) not in counter_only):
                tensor = tensors[id(entry)]
                if tensor is not None:
                    ranges = _geometry.flat_ranges(tensor, windows)
                    copies[id(entry)] = (_diff.snapshot(tensor, ranges), ranges)
        before_meta = {} if facts.kind == "write" else {id(e): _describe(protected.tensor_of(e)) for e in hit}

        collective = getattr(func, "namespace", "") == "c10d"

        def after(failed: bool = False) -> None:
            """Report the write; `failed`: the op raised, so report only what it changed before raising."""
            landed = hit if not failed else protected.drifted(hit)
            # Reported here, not again by the next boundary check; c10d writes land at `wait()`. A write
            # recorded into a CUDA graph lands at each replay: the boundary check finds that, from the digest
            # taken before.
            if not capturing:
                protected.explain(landed, settled=not collective)
            if collective and not failed and not capturing and landed:
                # An asynchronous collective's values are read once it has completed: at its `wait()` (a
                # synchronous call waits before returning), else at the guard's next boundary.
                _collectives.defer(self, written, lambda when: report(landed, when))
                return
            report(landed)

        def report(landed: list[Entry], when: str = "") -> None:
            """The events of the entries written; `when`: where values were read without a wait() seen."""
            if collective and not when and not capturing:
                protected.explain(landed)  # completed: later changes are found from the values now
            for entry in landed:
                if facts.kind != "write":
                    protected.relayout(entry)
                self.on_event(self._event(func, _kind(facts, entry, counter_only, aliased, notes), entry, site,
                                          blocked=False, before_meta=before_meta.get(id(entry)),
                                          copy=copies.pop(id(entry), None), alias=aliased.get(id(entry)),
                                          unversioned=id(entry) in unversioned, shared=shared[id(entry)],
                                          note=notes.get(id(entry)), read_when=when))

        def stopped() -> None:
            copies.clear()  # nothing landed
            for entry in hit:
                self.on_event(self._event(func, _kind(facts, entry, counter_only, aliased, notes), entry, site,
                                          blocked=True, alias=aliased.get(id(entry)),
                                          unversioned=id(entry) in unversioned, shared=shared[id(entry)],
                                          note=notes.get(id(entry)), fix=fixes.get(id(entry), "")), True)
        return PendingWrite(after, stopped)

    def _reduced_twice(self, func: Any, site: _frames.Site, hit: list[Entry],
                       shared: dict[int, tuple[str, ...]]) -> dict[int, tuple[EventKind, str]]:
        """The entries whose tensor the container holds under several paths that this reducing op (an
        all_reduce, an `add_`) at this line reaches again in this guard, once per further path: a loop
        over the container's values meets that one tensor once per path holding it.

        Only the same tensor under several paths (`m['acc_copy'] = m['acc']`): a loop over values
        never reaches a view of another entry (`S` and its split) twice through one line, while a
        plain repeated update of it (`for _ in range(k): s.mul_(g)`) does, and is no such bug."""
        name = _ops.base_name(func)
        if name not in _REDUCING:
            return {}
        found = {}
        for entry in hit:
            if not entry.aliases:
                continue
            key = (site.filename, site.lineno, name, id(entry))
            reached = self._reached[key] = self._reached.get(key, 0) + 1
            paths = (entry.path,) + shared[id(entry)]
            if 2 <= reached <= 1 + len(entry.aliases):
                found[id(entry)] = (REDUCED_TWICE, TWICE_DIFF.format(op=_ops.short_op_name(func), n=len(paths),
                                                                     paths=", ".join(paths)))
        return found

    def settle_collectives(self, when: str) -> None:
        """Report the collectives this judge saw whose `wait()` has not been seen, reading their values
        now (`when`: "at the guard's exit", ...): the guard reaches a boundary."""
        for pending in _collectives.take(lambda p: p.judge is self):
            pending.report(when)

    def on_swap(self, t1: torch.Tensor, t2: torch.Tensor) -> Callable[[bool], None]:
        """`torch.utils.swap_tensors` on a protected tensor: report it like `set_` (if it swapped)."""
        protected = self.protected
        if protected.stored_since_look((t1, t2)):  # placed, heard, not looked at yet: protected already
            protected.look()
        own = [e for e in (protected.entry_of(t1), protected.entry_of(t2)) if e is not None]
        if not own:
            return _no_repoint
        # The set decides what is intended, as for `.data =`: a weights set's load_state_dict and
        # conversions swap (torch.__future__.set_swap_module_params_on_conversion(True), or a
        # wrapper subclass such as DTensor), as they re-point with `.data =` otherwise.
        judged = protected.written_entries((t1, t2), "repoint")
        hit = [e for e in own if any(j is e or j.ref() is e.ref() for j in judged)]
        if hit:
            return self._repoint(_patches.SWAP_OP, hit, lambda: protected.release((t1, t2)))
        restore = protected.release((t1, t2))  # swap_tensors refuses weak references

        def follow(done: bool) -> None:
            restore()
            if done:
                protected.explain(own)  # the entries follow their new memory and values
        return follow

    def on_data(self, tensor: torch.Tensor, value: Any = None) -> Callable[[bool], None]:
        """`tensor.data = value` on a protected tensor: report it at the assignment, like `set_`
        (the set decides what is intended, as for an op: a weights set's conversions are).

        For a saved set, `value` holding the tensor's very values in its shape and dtype (only
        the layout differs: `conv.to(memory_format=torch.channels_last)` after a forward) is no
        change: backward reads the same numbers (under the saved-tensor hooks, those the pack hook
        kept, in the old memory, which stays protected)."""
        protected = self.protected
        hit = protected.written_entries((tensor,), "repoint")
        if not hit:
            return _no_repoint
        if self._values_only and value is not None and _tensors.same_values(tensor, value):
            def follow(done: bool) -> None:
                if done:
                    protected.explain(hit)
            return follow
        return self._repoint(_patches.DATA_OP, hit, lambda: _nothing)

    def _repoint(self, op: str, hit: list[Entry], release: Callable[[], Callable[[], None]]) -> Callable[[bool], None]:
        """Report a re-pointing that no op dispatches: blocked before it, or reported once it is done.

        `release` steps the set's hold on the tensors aside for the re-pointing (swap_tensors
        refuses weak references) and returns the undo."""
        protected = self.protected
        protected.settle()
        site = _frames.user_site()
        for entry in protected.drifted(hit):  # a change no op saw, which the re-pointing would hide
            self.on_event(unobserved_event(entry, protected.tensor_of(entry), site, DRIFT_DIFF,
                                           before="(a digest)"), True)
        before = {id(e): _describe(protected.tensor_of(e)) for e in hit}
        if self.block:
            for entry in hit:
                self.on_event(self._event(op, "repoint", entry, site, blocked=True))
        restore = release()

        def after(done: bool) -> None:
            restore()
            if not done:  # torch refused, or a guard stopped it: nothing changed, nothing to report
                return
            protected.explain(hit)  # the entries follow their new memory and values
            for entry in hit:
                self.on_event(self._event(op, "repoint", entry, site, blocked=False,
                                          before_meta=before[id(entry)]))
        return after

    def _event(self, func: Any, kind: EventKind, entry: Entry, site: _frames.Site, blocked: bool,
               before_meta: Optional[str] = None, copy: Optional[_Copy] = None,
               alias: Optional[tuple[int, int]] = None, unversioned: bool = False,
               shared: tuple[str, ...] = (), note: Optional[tuple[str, str]] = None,
               read_when: str = "", fix: str = "") -> MutationEvent:
        """The event for one protected entry; its summaries never raise (see `diff`).

        `alias`: (elements changed, elements named) of a write into an entry whose elements
        share memory (kind "alias"). `shared`: the other paths to the memory written. `note`:
        (kind, why) of a finding of this module's own (`reduced_twice`, `self_overlap`).
        `read_when`: a collective's values read with no `wait()` seen (where). `fix`: the hint of a
        stopped write, where the set gave one of its own (`findings`)."""
        tensor = self.protected.tensor_of(entry)
        described = _describe(tensor)
        if _tensors.capturing():
            before, after = CAPTURE_VALUES, None if blocked else CAPTURE_VALUES
            diff = "not applied: raised before the write, the data is intact" if blocked else CAPTURE_DIFF
        elif blocked:
            before = META_VALUES if _is_meta(tensor) else _values(tensor)
            after = None
            diff = "not applied: raised before the write, the data is intact"
        elif kind == "version":
            before = after = _values(tensor)
            diff = "no saved element changed"
        elif kind in _VALUE_KINDS and _is_meta(tensor):
            before = after = META_VALUES
            diff = META_DIFF
        elif kind in _VALUE_KINDS:
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
        if alias is not None:
            changed, named = alias
            shared_text = ALIAS_DIFF.format(changed=changed, named=named, s="" if named == 1 else "s")
            diff = shared_text if blocked else f"{shared_text}; {diff}"
        if note is not None:
            diff = note[1] if blocked else f"{note[1]}; {diff}"
        if read_when and not blocked:
            diff = f"{diff}; {PENDING_AT.format(when=read_when)}"
        event = MutationEvent(
            path=entry.path, op=_ops.short_op_name(func), kind=kind, blocked=blocked,
            filename=site.filename, lineno=site.lineno, code=site.code, function=site.function,
            placed_at=entry.placed_at, tensor=described, before=before, after=after, diff=diff,
            aliases=shared or tuple(entry.aliases), detached=entry.detached,
            hint=(fix or _hints.hint(func, site.code, self.protected.holds_weights)) if blocked else "",
            unversioned=unversioned,
        )
        self.protected.note(entry, f"{event.op} at {event.site} ({event.code})"
                            + (", its version counter only" if kind == "version" else "")
                            + (", stopped before it ran" if blocked else ""))
        return event


def _sharing(hit: list[Entry], protected: Protected) -> dict[int, tuple[str, ...]]:
    """Entry -> the other paths to its memory: its own aliases (the same tensor under another path),
    then the other entries hit whose elements overlap its own."""
    if len(hit) < 2:
        return {id(e): tuple(e.aliases) for e in hit}
    tensors = {id(e): protected.tensor_of(e) for e in hit}
    shared: dict[int, tuple[str, ...]] = {}
    for entry in hit:
        mine = tensors[id(entry)]
        others = tuple(o.path for o in hit if o is not entry and o.path not in entry.aliases
                       and _overlapping(mine, tensors[id(o)]))
        shared[id(entry)] = tuple(entry.aliases) + others
    return shared


def _overlapping(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return False
    try:
        return a is b or _geometry.elements_overlap(a, b)
    except Exception:  # noqa: BLE001 - a layout it cannot read: not named as shared
        return False


def _no_repoint(done: bool) -> None:
    pass


def _nothing() -> None:
    pass


def _unversioned(hit: list[Entry], tensors: dict[int, Optional[torch.Tensor]], written: Sequence[torch.Tensor],
                 counter_only: frozenset[int]) -> set[int]:
    """The saved entries of `hit` that this write changes through tensors none of which shares their
    version counter (`w.data.fill_(1)`: `.data` has a counter of its own), so autograd's check at
    backward cannot see it. Asked of a saved set's hits only: a few per stopped write."""
    found: set[int] = set()
    for entry in hit:
        saved = tensors.get(id(entry))
        if id(entry) in counter_only or saved is None or saved.is_inference():
            continue
        if not any(not t.is_inference() and _autograd.shares_version_counter(t, saved) for t in written):
            found.add(id(entry))
    return found


def _kind(facts: _ops.OpFacts, entry: Entry, counter_only: frozenset[int],
          aliased: dict[int, tuple[int, int]], notes: Optional[dict[int, tuple[EventKind, str]]] = None) -> EventKind:
    if id(entry) in counter_only:
        return "version"
    note = (notes or {}).get(id(entry))
    if note is not None:
        return note[0]
    return "alias" if id(entry) in aliased else facts.kind


_VALUE_KINDS = ("write", "alias", REDUCED_TWICE, SELF_OVERLAP, "written_twice")  # kinds whose events compare values


def _placed(t: torch.Tensor) -> str:
    """`f32[4, 63] at element 1 of its storage`: where a tensor lies, for a self-overlap's report."""
    try:
        return f"{_diff.describe(t)} at element {t.storage_offset()} of its storage (strides {tuple(t.stride())})"
    except Exception:  # noqa: BLE001
        return "a tensor"


def _aliased(hit: list[Entry], tensors: dict[int, Optional[torch.Tensor]],
             written: Sequence[torch.Tensor]) -> dict[int, tuple[int, int]]:
    """The entries whose elements share memory (an `expand`ed tensor) that this write changes
    in more logical elements than it names: (changed, named) by entry id."""
    found: dict[int, tuple[int, int]] = {}
    if _tensors.capturing():  # counting reads values back: it would break the capture
        return found
    for entry in hit:
        tensor = tensors[id(entry)]
        if tensor is not None and _geometry.shares_elements(tensor):
            count = _geometry.aliased_count(tensor, written)
            if count is not None and count[0] > count[1]:
                found[id(entry)] = count
    return found


def unobserved_event(entry: Entry, tensor: Optional[torch.Tensor], site: _frames.Site, diff: str,
                     before: str, after: Optional[str] = None) -> MutationEvent:
    """A change no op reported: found at a boundary, or just before a reported write would hide it."""
    return MutationEvent(
        path=entry.path, op="(no dispatched op)", kind="unobserved", blocked=False,
        filename=site.filename, lineno=site.lineno, code=site.code, function=site.function,
        placed_at=entry.placed_at, tensor=_describe(tensor), before=before,
        after=after if after is not None else _values(tensor), diff=diff,
        aliases=tuple(entry.aliases), detached=entry.detached,
    )


def boundary_event(change: Change, site: _frames.Site, watched_ops: bool) -> MutationEvent:
    """What a boundary check found on one entry, as an event: its values or its memory changed
    with no op reporting it (`watched_ops`: whether the guard watched ops, level "full")."""
    if change.kind == "values":
        return unobserved_event(change.entry, change.tensor, site, UNOBSERVED_DIFF if watched_ops else LIGHT_DIFF,
                                f"digest {_digest_text(change.was)}",
                                f"{_values(change.tensor)} (digest {_digest_text(change.now)})")
    return unobserved_event(change.entry, change.tensor, site, MEMORY_DIFF, change.was, change.now)


def _digest_text(digest: Any) -> str:
    if isinstance(digest, tuple):
        return "/".join(map(_digest_text, digest))
    try:
        return f"{int(digest) & ((1 << 64) - 1):016x}"
    except Exception:  # noqa: BLE001
        return "unknown"


def _is_meta(tensor: Optional[torch.Tensor]) -> bool:
    try:
        return tensor is not None and bool(tensor.is_meta)
    except Exception:  # noqa: BLE001
        return False


def _describe(tensor: Optional[torch.Tensor]) -> str:
    return _diff.describe(tensor) if tensor is not None else "<freed>"


def _values(tensor: Optional[torch.Tensor], around: int = 0) -> str:
    return _diff.values(tensor, around) if tensor is not None else "<freed>"


def is_self_copy(args: Sequence[Any]) -> bool:
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

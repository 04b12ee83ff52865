"""What a rollout engine receives for its weights, protected from the moment it is received.

A layer of a model's weights set (`weights.ModuleSet`), below the writes a trainer means
(`weights_writers`). Three kinds of entries join the weights, none fingerprinted (their
writers are receives: only ops are judged) and none counted among the weights:

- **handed**: a tensor a load was handed: yielded by the weights iterator given to
  `load_weights` (activation wraps it), or in the list of pairs given. Any write to it is
  reported until the load has *consumed* it: the load's consumer asked its iterator for
  the next item (a `for` loop over it: the one before is done with), or the load ended. A
  consumer that keeps what it takes (`dict(weights)`, `list(weights)`, a comprehension)
  consumes nothing before the load ends.
- **buffer**: a receive buffer: the tensor a receive collective (`broadcast`, `recv`,
  `all_gather`, ...) filled, one rebuilt from a CUDA IPC handle, or the tensor the views
  handed to a load are views of. A write to it is a *refill*; it is never reported itself.
- **held**: a view of a receive buffer found *held* at a refill: handed and not yet
  consumed, or kept somewhere the running code may still read it: in a variable live at
  its frame's current instruction (`liveness`), or in a dict, list, tuple, set, or an
  object's attributes such a variable holds (a bounded walk), on the refilling thread's
  stack. A loop variable that a finished loop left bound is not a use. Each such view is
  reported at the refill (under `raise`, before it lands), named by where it is held
  (`pending['lora_A']`) and placed at the statement that put it there, with the receive.
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch

from kvguard._protect import frames as _frames
from kvguard._protect import geometry as _geometry
from kvguard._protect import liveness as _liveness
from kvguard._protect import placements as _placements
from kvguard._protect import records as _records
from kvguard._protect import tree as _tree
from kvguard._protect import weights_loads as _loads
from kvguard._protect.collector import collector_paused
from kvguard._protect.entries import Change, Entry
from kvguard._protect.weights_steps import SteppingSet
from kvguard._torch import autograd as _autograd
from kvguard._torch import tensors as _tensors

if TYPE_CHECKING:
    from kvguard._protect.frames import Site
    from kvguard._report.events import EventKind

BUFFER, HANDED, HELD = "buffer", "handed", "held"
RECEIVED_FIX = ("what a load is handed is the sender's until the load has consumed it: receive the next bucket into "
                "another buffer, or clone (.clone()) what you keep past the next receive")
HELD_FIX = ("a view of a receive buffer changes when the buffer is refilled: keep a copy (.clone()) of what you hold "
            "past the next receive, or receive into another buffer")
_FRAMES = 24  # the refilling thread's frames searched for held views
_DEPTH = 3  # containers below a variable searched
_BUDGET = 5_000  # objects looked at per search, at most
_ITEMS = 4_096  # items of one container looked at, at most
_PURGE = 64  # handed tensors freed before their entries leave the memory index (else at the load's end)


class _Received:
    """What one received entry is: its kind, the load it was handed to, and whether consumed."""

    __slots__ = ("kind", "load", "consumed", "how", "key")

    def __init__(self, kind: str, load: Optional[weakref.ref[_loads.Load]], how: str, key: int) -> None:
        self.kind = kind
        self.load = load
        self.consumed = False
        self.how = how  # a buffer's receive: `dist.broadcast at recv.py:20`
        self.key = key  # the entry's key in the set (its tensor's id), to drop it by once the tensor died


class ReceivedSet(SteppingSet):
    """A stepping set that also protects what loads are handed and the buffers they receive into."""

    def __init__(self, name: str, fingerprint: bool) -> None:
        self._received: dict[int, tuple[Entry, _Received]] = {}  # id(entry) -> (entry, what it is)
        self._loads: weakref.WeakSet[_loads.Load] = weakref.WeakSet()  # the loads handed something
        self.loads_seen = 0  # how many
        self.received_count = 0  # tensors protected as received (handed, or found held at a refill)
        self._storages: set[int] = set()  # the addresses of the receive buffers' memory, ever watched
        # Per load, the entries handed to it and not consumed yet, in order (`consumed` reads these,
        # not every received entry); an entry consumed or let go since is passed over there.
        self._waiting: weakref.WeakKeyDictionary[_loads.Load, list[tuple[Entry, _Received]]] = \
            weakref.WeakKeyDictionary()
        self._buffer_entries: list[Entry] = []  # the receive buffers' entries (`_inside_a_buffer`)
        self._handed_dead = 0  # handed tensors freed since their entries were last dropped (`_drop_handed`)
        super().__init__(name, fingerprint)
        self._unlisten = _loads.listen(self)

    # -- what activation tells (`weights_loads`) -------------------------------------------

    def received(self, tensors: Sequence[torch.Tensor], how: str, site: Site) -> None:
        """A receive filled `tensors` at `site`: the buffers they are are refilled from now on."""
        self._buffers([t for t in tensors if isinstance(t, torch.Tensor)], f"{how} at {site.short}")

    def hand_out(self, load: _loads.Load, items: Sequence[tuple[str, torch.Tensor]], where: str) -> None:
        """`items` are handed to `load` now: protected until it has consumed them."""
        new: list[tuple[str, torch.Tensor]] = []
        views: list[torch.Tensor] = []
        ref = weakref.ref(load)
        for name, tensor in items:
            known = self.entry_of(tensor)
            if known is not None:
                what = self._received.get(id(known))
                if what is not None and what[1].kind != BUFFER:  # handed again: to this load now
                    what[1].kind, what[1].load, what[1].consumed = HANDED, ref, False
                    self._waiting.setdefault(load, []).append((known, what[1]))
                continue  # a weight itself, or a buffer: judged as what it is
            new.append((f"{load.what}[{name!r}]", tensor))
            if _autograd.view_base(tensor) is not None:
                views.append(tensor)
        if views:  # first, so that a view's entry is known to lie in its buffer's memory (`_protect`)
            self._buffers(views, lambda: f"views of it handed to {load.said}")
        if new:
            if load not in self._loads:
                self._loads.add(load)
                self.loads_seen += 1
            placed = f"{where} (handed to {load.said})"
            self._protect([(path, tensor, placed) for path, tensor in new], HANDED, ref, "")

    def consumed(self, load: _loads.Load, consumer: Optional[types.FrameType]) -> None:
        """`load`'s consumer asks for the next item: what it was handed before is consumed, unless
        the consumer's frame keeps it (a variable it reads later, or a container one holds)."""
        pending = self._waiting.get(load)
        if not pending:
            return
        received = self._received
        waiting = [(entry, what) for entry, what in pending
                   if received.get(id(entry)) is not None and what.kind == HANDED and not what.consumed
                   and what.load is not None and what.load() is load]
        pending[:] = waiting
        if not waiting:
            return
        kept: set[int] = set()
        if consumer is not None:
            tensors = {id(t) for e, _ in waiting if (t := e.ref()) is not None}
            storages = {_tensors.storage_address(t) for e, _ in waiting if (t := e.ref()) is not None}
            kept = {id(t) for _, t, _, _ in _held_tensors([consumer], set(), storages) if id(t) in tensors}
        for entry, what in waiting:
            if id(entry.ref()) not in kept:
                what.consumed = True
        pending[:] = [(entry, what) for entry, what in waiting if not what.consumed]

    def load_ended(self, load: _loads.Load) -> None:
        """The load is over: what it was handed is let go (a view kept since is found at a refill)."""
        self._waiting.pop(load, None)
        done = [(entry, what) for entry, what in self._received.values()
                if what.kind == HANDED and what.load is not None and what.load() in (load, None)]
        entries = self._entries
        for entry, what in done:
            del self._received[id(entry)]
            if entries.get(what.key) is entry:  # freed ones too: their entries waited for this (`_on_handed_death`)
                del entries[what.key]
        if self._drop_handed() or done:  # (and those handed to other loads, freed since)
            with collector_paused():
                self._rebuild_index()

    def _on_handed_death(self, _: object) -> None:
        """A tensor handed to a load was freed (one a `for` loop consumed, as it moves on): its entry
        can never be hit again (`overlaps` needs its tensor), and its memory, where it viewed a
        receive buffer, is still the buffer's; so it waits for the load's end, or for `_PURGE`
        more, to leave the memory index in one rebuild, rather than one rebuild each (`_dirty`)."""
        self._handed_dead += 1

    def _drop_handed(self) -> bool:
        """Drop the entries of handed tensors freed since (`_on_handed_death`); whether there were any.
        The caller rebuilds the index."""
        if not self._handed_dead:
            return False
        self._handed_dead = 0
        entries, received = self._entries, self._received
        gone = [(key, entry, what) for key, (entry, what) in received.items() if entry.ref() is None]
        for key, entry, what in gone:
            del received[key]
            if entries.get(what.key) is entry:
                del entries[what.key]
        return bool(gone)

    # -- entries -------------------------------------------------------------------------

    def _buffers(self, tensors: Sequence[torch.Tensor], how: Union[str, Callable[[], str]]) -> None:
        """Protect the buffers `tensors` are (their view bases) as receive buffers, once each (`how`:
        the receive, or what says it, asked only for a buffer not protected yet)."""
        bases: list[torch.Tensor] = []
        seen: set[int] = set()
        for tensor in tensors:
            base = _root(tensor)
            if id(base) in seen or self.entry_of(base) is not None:
                continue
            seen.add(id(base))
            bases.append(base)
        if bases:
            said = how if isinstance(how, str) else how()
            self._buffer_entries = [e for e in self._buffer_entries if e.ref() is not None]
            self._buffer_entries += self._protect([(f"<receive buffer: {said}>", base, None) for base in bases],
                                                  BUFFER, None, said)

    def _inside_a_buffer(self, record: _records.Record) -> bool:
        """Whether a tensor's memory (its `record`) lies inside a live receive buffer's, one whose
        elements tile their span: then any tensor that shares memory with it shares the buffer's."""
        spans = _records.spans(record)
        if not spans:
            return False
        for span in spans:
            for buffer in self._buffer_entries:
                if buffer.ref() is not None and any(
                        b.dense and b.device == span.device and b.start <= span.start and span.stop <= b.stop
                        for b in _records.spans(buffer.record)):
                    break
            else:
                return False
        return True

    def _protect(self, items: Sequence[tuple[str, torch.Tensor, Optional[str]]], kind: str,
                 load: Optional[weakref.ref[_loads.Load]], how: str) -> list[Entry]:
        """Entries for `items` (path, tensor, placed at) of `kind`, with no digest, published to the
        write hook now."""
        handed = kind == HANDED
        with collector_paused():
            if handed and self._handed_dead >= _PURGE and self._drop_handed():
                self._rebuild_index()
            records = self._records_of([t for _, t, _ in items], digest=False)
            # A handed tensor's death is told to `_on_handed_death`, not `_on_death` (see there).
            on_death = self._on_handed_death if handed else self._on_death
            to = load() if handed and load is not None else None
            waiting = self._waiting.setdefault(to, []) if to is not None else None
            added = []
            for (path, tensor, placed), record in zip(items, records):
                entry = self._entries[id(tensor)] = Entry(path, record, weakref.ref(tensor, on_death), placed)
                what = _Received(kind, load, how, id(tensor))
                self._received[id(entry)] = (entry, what)
                added.append(entry)
                if waiting is not None:
                    waiting.append((entry, what))
            if kind != BUFFER:
                self.received_count += len(added)
            else:
                self._storages.update(_tensors.storage_address(t) for _, t, _ in items)
            if handed and all(self._inside_a_buffer(e.record) for e in added):
                # Memory a receive buffer's entry has already: the hook learns the tensors (by identity),
                # and no buffer of a module comes to share memory it did not share with that entry, so
                # the writers' layer above (which reads again which do, `IntendedWritesSet._rebuild_index`)
                # has nothing to read again: this layer's and the ones below only.
                super()._rebuild_index(added)
            else:
                self._rebuild_index(added)
        return added

    @property
    def buffer_count(self) -> int:
        """The receive buffers watched for refills so far (by their memory: a flat bucket's views are one)."""
        return len(self._storages)

    def _received_ids(self) -> set[int]:
        """ids of the tensors of received entries still alive (a rescan of the weights keeps them)."""
        live = {}
        for key, (entry, what) in list(self._received.items()):
            tensor = entry.ref()
            if tensor is None or self._entries.get(id(tensor)) is not entry:
                del self._received[key]  # freed, or let go
                continue
            live[id(tensor)] = what
        return set(live)

    def is_received(self, entry: Entry) -> bool:
        """Whether `entry` is a received tensor or a buffer, not a weight."""
        return id(entry) in self._received

    # -- the write path ----------------------------------------------------------------------

    def written_entries(self, written: Sequence[torch.Tensor], kind: str, resizes: bool = False) -> list[Entry]:
        hit = super().written_entries(written, kind, resizes)
        if not hit or not self._received:
            return hit
        received = self._received
        mine = [(e, received[id(e)][1]) for e in hit if id(e) in received]
        if not mine:
            return hit
        refilled = [e for e, what in mine if what.kind == BUFFER]
        found: list[Entry] = []
        if refilled and kind == "write":
            try:
                found = self._held_views(refilled, written, sys._getframe(1))
            except Exception:  # noqa: BLE001 - the search never fails the user's write
                found = []
        keep = {id(e) for e in found}
        for entry, what in mine:
            if what.kind == HANDED and not what.consumed:
                keep.add(id(entry))  # handed and not yet consumed: any write is reported
        rest = [e for e in hit if id(e) not in received or id(e) in keep]
        return rest + [e for e in found if e not in rest]

    def _held_views(self, buffers: list[Entry], written: Sequence[torch.Tensor],
                    frame: Optional[types.FrameType]) -> list[Entry]:
        """The views of the refilled `buffers` held at this refill (see the module docstring), each
        an entry (made now where it is none yet)."""
        owned = _loads.the_loads_own(frame) if frame is not None else (lambda f: False)
        # The load's own frames hold only what it was handed: judged as its consumer asks for more.
        frames = [f for _, f in zip(range(_FRAMES), (f for f in _frames.user_frames(frame) if not owned(f)))]
        skip = {id(t) for t in written}
        skip.update(id(t) for e in buffers if (t := e.ref()) is not None)
        how = "; ".join(dict.fromkeys(self._received[id(e)][1].how for e in buffers))
        found: list[Entry] = []
        new: list[tuple[str, torch.Tensor, _tree.Chain, int]] = []
        storages = {_tensors.storage_address(t) for t in written}
        for path, tensor, chain, depth in _held_tensors(frames, skip, storages):
            if not any(_overlap(tensor, w) for w in written):
                continue
            known = self.entry_of(tensor)
            if known is not None:
                what = self._received.get(id(known))
                if what is not None and what[1].kind in (HANDED, HELD) and known not in found:
                    found.append(known)  # handed (consumed, but kept), or held since an earlier refill
                continue  # a weight is judged as one
            if not any(t is tensor for _, t, _, _ in new):
                new.append((path, tensor, chain, depth))
        if new:
            placements = _placements.Placements(frames)
            made = []
            for path, tensor, chain, depth in new:
                at = placements.placed_at(chain, tensor) if chain else (
                    f"{_frames.site_of(frames[depth]).short}, held by {path}")
                made.append((path, tensor, f"{at} (a view of the receive buffer: {how})"))
            found += self._protect(made, HELD, None, how)
        return found

    def findings(self, hit: Sequence[Entry]) -> tuple[dict[int, tuple[EventKind, str]], dict[int, str]]:
        """The judge asks: this set's own findings on the entries a write hit (none at this layer) and
        the fix a stopped write's hint says (a received tensor's)."""
        received = self._received
        return {}, {id(e): RECEIVED_FIX if received[id(e)][1].kind == HANDED else HELD_FIX for e in hit
                    if id(e) in received and received[id(e)][1].kind != BUFFER}

    # -- no fingerprints: received tensors are judged by their ops only -------------------------

    def _compare(self, live: list[tuple[Entry, torch.Tensor]]) -> tuple[list[Change], bool]:
        received = self._received
        return super()._compare([(e, t) for e, t in live if id(e) not in received])

    def drifted(self, entries: list[Entry]) -> list[Entry]:
        received = self._received
        return super().drifted([e for e in entries if id(e) not in received])

    def close(self) -> None:
        self._unlisten()
        self._received.clear()
        super().close()


def _root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor `tensor` is a view of, through every level (itself if it is no view). A view to
    another dtype is no view to autograd: a flat bucket's `view(dtype)` slices are each their own
    root, together covering the bucket."""
    for _ in range(16):
        base = _autograd.view_base(tensor)
        if base is None:
            break
        tensor = base
    return tensor


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.device == b.device and _geometry.elements_overlap(a, b)
    except Exception:  # noqa: BLE001 - a layout it cannot read: not a view found
        return False


def _held_tensors(frames: list[types.FrameType], skip: set[int], storages: set[int]
                  ) -> list[tuple[str, torch.Tensor, _tree.Chain, int]]:
    """(path, tensor, chain from the variable's value down, index of the frame) of the tensors in
    memory of `storages` (their addresses) that the code on `frames` may still read: in live
    variables, and in the dicts, lists, tuples, sets and objects' attributes they hold, to
    `_DEPTH` levels and `_BUDGET` objects. Iterative, each object's path made only for what is
    found, what to do with a value decided once per type (`_kinds`): it runs at every refill."""
    found: list[tuple[int, torch.Tensor, int]] = []  # (node, tensor, frame index)
    # node -> (parent node, the container, the step from it, the variable's name at a root); -1: none.
    # The step to an object's attribute is its key in `__dict__` here, made an `Attr` only for what is found.
    nodes: list[tuple[int, object, object, str]] = []
    budget = _BUDGET
    seen: set[int] = set(skip)
    kinds = _kinds
    for depth, frame in enumerate(frames):
        live = _liveness.live_names(frame)
        if live is not None and not live:
            continue
        try:
            code = frame.f_code  # every variable where liveness is not known; read without pinning the locals
            names = _frames.frame_names(frame, live if live is not None else (
                *code.co_varnames, *code.co_cellvars, *code.co_freevars))
        except Exception:  # noqa: BLE001 - a frame that cannot be read holds nothing we name
            continue
        stack: list[tuple[Any, int, int]] = []  # (value, its node, its level)
        for name, value in names.items():
            nodes.append((-1, None, None, name))
            stack.append((value, len(nodes) - 1, 0))
        while stack:
            budget -= 1
            if budget < 0:
                return _named(found, nodes)
            value, node, level = stack.pop()
            key = id(value)
            if key in seen:
                continue
            kind = type(value)  # `type()`: an object may refuse attribute reads (`__class__`)
            what = kinds.get(kind)
            if what is None:
                what = kinds[kind] = _kind_of(kind)
            if what == _TENSOR:
                seen.add(key)
                if _tensors.storage_address(value) in storages:
                    found.append((node, value, depth))
                continue
            if what == _SKIP or level >= _DEPTH:
                continue  # a module's weights are judged as weights; a Parameter is a weight
            seen.add(key)
            try:
                if what == _MAPPING:
                    children: list[tuple[Any, Any]] = list(dict.items(value))
                elif what == _SEQUENCE:
                    members = value if kind is tuple else list(value)  # (a tuple is its own snapshot)
                    for child in members:  # most hold only what the walk passes over (a bucket's names, offsets)
                        if kinds.get(type(child)) != _SKIP:
                            break
                    else:
                        continue
                    children = list(enumerate(members))
                elif what == _SET:
                    children = [(_IN_SET, v) for v in value]
                else:
                    own = object.__getattribute__(value, "__dict__")  # an object's own attributes (a worker's self)
                    if not isinstance(own, dict):
                        continue
                    children = list(own.items())  # each step an attribute's name (see `_named`)
            except Exception:  # noqa: BLE001 - a container that refuses to be read holds nothing we name
                continue
            level += 1
            for step, child in children[:_ITEMS] if len(children) > _ITEMS else children:
                if kinds.get(type(child)) == _SKIP:
                    continue
                nodes.append((node, value, step, ""))
                stack.append((child, len(nodes) - 1, level))
    return _named(found, nodes)


_IN_SET = object()  # the step to a set's member: no key names it
_TENSOR, _SKIP, _MAPPING, _SEQUENCE, _SET, _OBJECT = range(6)
_kinds: dict[type, int] = {}  # what the walk does with a value of each type


def _kind_of(kind: type) -> int:
    if issubclass(kind, torch.nn.Parameter):
        return _SKIP  # a weight: judged as one (a view of a receive buffer loaded with assign=True is one too)
    if issubclass(kind, torch.Tensor):
        return _TENSOR
    if issubclass(kind, _OPAQUE) or kind is type(None):
        return _SKIP
    if issubclass(kind, dict):
        return _MAPPING
    if issubclass(kind, (list, tuple)):
        return _SEQUENCE
    return _SET if issubclass(kind, (set, frozenset)) else _OBJECT


def _named(found: list[tuple[int, torch.Tensor, int]], nodes: list[tuple[int, object, object, str]]
           ) -> list[tuple[str, torch.Tensor, _tree.Chain, int]]:
    """The path and chain of each tensor found, read up its nodes."""
    out = []
    for node, tensor, depth in found:
        steps: list[tuple[object, object]] = []
        name = ""
        while node >= 0:
            parent, container, step, name = nodes[node]
            if parent >= 0 or container is not None:
                if _kinds.get(type(container)) == _OBJECT:  # (`_held_tensors` keeps an attribute's name)
                    step = _tree.Attr(str(step))
                steps.append((container, step))
            node = parent
        steps.reverse()
        path = name + "".join("{…}" if step is _IN_SET else _tree.step_text(step) for _, step in steps)
        chain = tuple((c, step) for c, step in steps if step is not _IN_SET)
        out.append((path, tensor, chain, depth))
    return out


# What the walk does not look into: a module's weights are judged as weights; the rest holds no view.
_OPAQUE = (torch.nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
           str, bytes, int, float, complex, bool, torch.Size, torch.dtype, torch.device, range)


if TYPE_CHECKING:
    from kvguard._protect.contract import Protected

    _meets: type[Protected] = ReceivedSet  # mypy checks the set against the contract here

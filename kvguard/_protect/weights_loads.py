"""Loads of a model's weights: the one running on each thread, what it wrote, and who listens.

A *load* is the outermost weight-loading call on a thread: `Module.load_weights(weights)`
(vLLM's and sglang's models), a rollout engine's weight-update entry point
(`kvguard._activate.load_points`), or `Module.load_state_dict`. Activation (`kvguard._activate.weights_loads`)
enters and leaves the first two; a `load_state_dict` of a watched module is found on the
writing op's stack (`weights_writers`) and ends when its outermost call returns.

While a load runs, its writes to the weights of the modules it loads are its own (the
weights' sets let them through), and each write's memory is kept here: a later write of the
same load to an element it wrote already overwrites what it just loaded, and is reported
(`written_twice`). The sets that protect weights listen here (`listen`): activation tells
them what a load is handed and what a receive collective filled (`hand_out`, `received`),
and a load that ends lets what it was handed go.
"""

from __future__ import annotations

import threading
import types
import weakref
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Protocol, Sequence

import torch

from kvguard._protect import geometry as _geometry

if TYPE_CHECKING:
    from kvguard._protect.frames import Site


class Listener(Protocol):
    """What a set that protects weights hears of loads and receives (`weights_received.ReceivedSet`)."""

    def load_ended(self, load: Load) -> None: ...

    def hand_out(self, load: Load, items: Sequence[tuple[str, torch.Tensor]], where: str) -> None: ...

    def consumed(self, load: Load, consumer: Optional[types.FrameType]) -> None: ...

    def received(self, tensors: Sequence[torch.Tensor], how: str, site: Site) -> None: ...


class _Written(NamedTuple):
    """The memory one write of a load reached: enough to rebuild the written view, and where it was made."""

    element_size: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    where: str  # `reload.py:88 (aten.copy_.default)`: the statement, for the second write's report


class Load:
    """One load running on a thread: what it loads, where it was called, what it wrote."""

    __slots__ = ("what", "site", "key", "caller", "_modules", "_ids", "_writes", "handed", "_said", "__weakref__")

    def __init__(self, what: str, site: Site, modules: Optional[Sequence[torch.nn.Module]], key: int = 0) -> None:
        self.what = what  # `rollout_model.load_weights`, `finish_reload`, `model.load_state_dict`
        self.site = site  # the line that called it
        self.key = key  # a load_state_dict's: the id of its outermost frame, running while it does
        self.caller: Optional[types.FrameType] = None  # the frame that called it, while it runs (entered loads)
        # Weakly, the modules it loads; None: every watched module (an entry point naming none).
        self._modules: Optional[list[weakref.ref[torch.nn.Module]]] = (
            None if modules is None else [weakref.ref(m) for m in modules])
        self._ids: Optional[set[int]] = None  # ids of their parameters and buffers, read at the first ask
        # storage address -> the writes of this load into that storage
        self._writes: dict[int, list[_Written]] = {}
        self.handed = 0  # tensors handed to it (its weights iterator's, its list's)
        self._said: Optional[str] = None

    @property
    def said(self) -> str:
        """`rollout_model.load_weights at sync.py:40`: the load, in a report's words (made once: every
        tensor handed to it is placed with it)."""
        said = self._said
        if said is None:
            said = self._said = f"{self.what} at {self.site.short}"
        return said

    def add_module(self, module: torch.nn.Module) -> None:
        """A module loaded inside this load (a nested `load_weights`): its weights are the load's too."""
        if self._modules is None or any(ref() is module for ref in self._modules):
            return
        self._modules.append(weakref.ref(module))
        self._ids = None

    def covers(self, tensor: Optional[torch.Tensor]) -> bool:
        """Whether `tensor` is a weight of a module this load loads (of any, for a load naming none)."""
        if self._modules is None:
            return True
        if tensor is None:
            return False
        ids = self._ids
        if ids is None:
            ids = self._ids = set()
            for ref in self._modules:
                module = ref()
                if module is not None:
                    ids.update(id(t) for t in module.parameters())
                    ids.update(id(t) for t in module.buffers())
        return id(tensor) in ids

    def wrote(self, written: Sequence[torch.Tensor], where: str) -> Optional[str]:
        """Note that this load writes `written` now (`where`: the statement); returns where it wrote
        some of the same elements before, if it did (None: a first write)."""
        found: Optional[str] = None
        for tensor in written:
            try:
                key = _storage(tensor)
                mine = _Written(tensor.element_size(), tuple(tensor.shape), tuple(tensor.stride()),
                                int(tensor.storage_offset()), where)
            except Exception:  # noqa: BLE001 - a tensor without plain memory: not followed
                continue
            before = self._writes.setdefault(key, [])
            if found is None:
                found = next((w.where for w in before if _meets(w, tensor)), None)
            before.append(mine)
        return found


def _storage(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _meets(before: _Written, tensor: torch.Tensor) -> bool:
    """Whether the elements an earlier write reached (`before`) share a byte with `tensor`'s."""
    try:
        if before.element_size != tensor.element_size():
            lo = before.offset * before.element_size
            hi = lo + before.element_size * (1 + sum((n - 1) * s for n, s in zip(before.size, before.stride)))
            start = tensor.storage_offset() * tensor.element_size()
            stop = start + tensor.element_size() * (1 + sum((n - 1) * s for n, s in zip(tensor.shape,
                                                                                      tensor.stride())))
            return lo < stop and start < hi
        view = tensor.as_strided(before.size, before.stride, before.offset)
        return _geometry.elements_overlap(view, tensor)
    except Exception:  # noqa: BLE001 - not comparable: not called a second write
        return False


_local = threading.local()  # .stack: the loads entered on this thread; .state_dict: its load_state_dict's
_listeners: list[weakref.ref[Listener]] = []
_lock = threading.Lock()


def current() -> Optional[Load]:
    """The load entered on this thread (the outermost), if any (a `load_state_dict` is found on the
    writing op's stack instead: `state_dict_load`)."""
    stack: Optional[list[Load]] = getattr(_local, "stack", None)
    return stack[0] if stack else None


def enter(what: str, site: Site, module: Optional[torch.nn.Module],
          caller: Optional[types.FrameType] = None) -> tuple[Load, bool]:
    """A load starts on this thread (`module`: the one it loads, if it names one; `caller`: the frame
    calling it). Returns the load its writes belong to, and whether it is a new one (the outermost):
    only that one is left."""
    stack: Optional[list[Load]] = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    if stack:
        outer = stack[0]
        if module is not None:
            outer.add_module(module)
        return outer, False
    load = Load(what, site, None if module is None else [module])
    load.caller = caller
    stack.append(load)
    return load, True


def leave(load: Load) -> None:
    """The outermost load `load` returned (or raised): the listening sets let what it was handed go."""
    stack: Optional[list[Load]] = getattr(_local, "stack", None)
    if stack and stack[0] is load:
        stack.clear()
    load.caller = None  # no frame kept past the call
    _tell(lambda listener: listener.load_ended(load))


def state_dict_load(module: torch.nn.Module, site: Site, key: int) -> Load:
    """The `load_state_dict` of `module` running on this thread, found on a writing op's stack with
    its outermost frame (`key`: that frame's id): one load until that call returns
    (`state_dict_loaded`)."""
    load: Optional[Load] = getattr(_local, "state_dict", None)
    if load is None or load.key != key:
        load = _local.state_dict = Load(f"{type(module).__name__}.load_state_dict", site, [module], key)
    return load


def state_dict_loaded(module: torch.nn.Module) -> None:
    """An outermost `Module.load_state_dict` returned on this thread: its load is over."""
    load: Optional[Load] = getattr(_local, "state_dict", None)
    if load is not None:
        _local.state_dict = None
        _tell(lambda listener: listener.load_ended(load))


def hand_out(load: Load, items: Sequence[tuple[str, torch.Tensor]], where: str) -> None:
    """`items` (name, tensor) are handed to `load` now (`where`: the line that made or yielded them)."""
    load.handed += len(items)
    _tell(lambda listener: listener.hand_out(load, items, where))


def consumed(load: Load, consumer: Optional[types.FrameType]) -> None:
    """The consumer of `load`'s weights iterator (running in `consumer`) asked for the next item: what it
    was handed before is consumed, unless that frame keeps it (in a variable it reads later, or a
    container such a variable holds)."""
    _tell(lambda listener: listener.consumed(load, consumer))


def source_running(load: Load, consumer: types.FrameType) -> Callable[[], None]:
    """A load's weights iterator runs its source for the next item, asked from `consumer`: the frames
    between `consumer` and the load's caller are the load's own, which hold only what it was handed
    (judged item by item as it asks for the next). Returns the undo."""
    stack: Optional[list[tuple[Load, types.FrameType]]] = getattr(_local, "sources", None)
    if stack is None:
        stack = _local.sources = []
    stack.append((load, consumer))

    def undo() -> None:
        if stack and stack[-1][0] is load and stack[-1][1] is consumer:
            stack.pop()
    return undo


def the_loads_own(frame: types.FrameType) -> Callable[[types.FrameType], bool]:
    """For a search of the frames from `frame` outwards on this thread: whether a frame is one a
    running weights iterator's load owns (between its consumer and the load's caller; see
    `source_running`), to pass over."""
    stack: Optional[list[tuple[Load, types.FrameType]]] = getattr(_local, "sources", None)
    if not stack:
        return lambda f: False
    load, consumer = stack[-1]
    outer = load.caller
    inside = [False]

    def owned(f: types.FrameType) -> bool:
        if f is consumer:
            inside[0] = True
        if f is outer:
            inside[0] = False
        return inside[0]
    return owned


def received(tensors: Sequence[torch.Tensor], how: str, site: Site) -> None:
    """A receive (`how`: `dist.broadcast`, a CUDA IPC rebuild) filled `tensors` at `site`."""
    _tell(lambda listener: listener.received(tensors, how, site))


def listen(listener: Listener) -> Callable[[], None]:
    """Tell `listener` (held weakly) of loads and receives from now on; returns the undo."""
    ref: weakref.ref[Listener] = weakref.ref(listener)
    with _lock:
        _listeners.append(ref)

    def undo() -> None:
        with _lock:
            if ref in _listeners:
                _listeners.remove(ref)
    return undo


def listening() -> bool:
    """Whether any set listens (activation hands nothing out when none does)."""
    return any(ref() is not None for ref in list(_listeners))


def _tell(call: Callable[[Listener], None]) -> None:
    for ref in list(_listeners):
        listener = ref()
        if listener is not None:
            try:
                call(listener)
            except Exception:  # noqa: BLE001 - kvguard's bookkeeping never fails the user's load
                pass

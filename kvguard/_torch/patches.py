"""Every monkeypatch kvguard puts on torch, each one a `Patch`: installed with its first
listener, taken off with the last one's undo.

Some writes dispatch no op, so no engine sees them: `torch.utils.swap_tensors`, `t.data = x`,
`Module._apply` (which re-points parameters with `.data =`), `Module.load_state_dict` (its
writes are meant), a c10d `Work.wait()` (its collective wrote outside any op), a call of an
inductor-compiled graph (its kernels write inputs). While a guard listens, each is wrapped so
the guard hears of it first. Two more stay for the process once a `guard_autograd` has been
entered: saved-tensor hooks composed with other hooks, and set aside for `torch.func`. And a
method wrapped on every subclass of a torch class (a dataset's `__getitem__`, a model's
`load_weights`) reaches the classes defined later through the base's `__init_subclass__`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Any, Callable, Generic, Iterator, Optional, Sequence, TypeVar

import torch

from kvguard._torch.autograd import PackHook
from kvguard._torch.compiled import CompiledGraph, outside_dynamo
from kvguard._torch.tensors import same_elements

L = TypeVar("L")  # what one patch's listeners are
_INHERITED = object()  # the attribute was a base class's (`Tensor.data`): taken off by deleting ours


class Patch(Generic[L]):
    """One attribute of torch replaced by kvguard's wrapper while anyone listens.

    The first `listen` installs the wrapper `wrap(original, listeners)` makes; the undo of the
    last puts back what was there (deletes ours where the attribute was inherited). Written
    once for every patch, as `torch/_library` writes its `RegistrationHandle`. A wrapper that
    someone wrapped in turn stays under theirs, passing straight through while no one listens,
    and hears the next listeners: never two of ours in one chain. A `lasting` patch stays on
    for the process once installed (callers may hold the wrapped attribute); its listeners
    still come and go. An owner that is not there (yet) leaves the patch off: `install` again.
    """

    def __init__(self, owner: Callable[[], object], name: str, wrap: Callable[[Any, list[L]], object],
                 lasting: bool = False) -> None:
        self._owner = owner
        self.name = name
        self._wrap = wrap
        self.lasting = lasting
        self.listeners: list[L] = []  # the wrapper's own list: mutated, never rebound
        self._saved: object = _INHERITED  # what ours replaced, as the owner held it
        self._ours: object = None  # our wrapper, while it is in the owner's chain
        self._lock = threading.RLock()  # guards enter and exit on any thread

    def install(self) -> None:
        """Put ours on, unless it is on already (or the owner is not there)."""
        with self._lock:
            owner = self._owner() if self._ours is None else None
            if owner is None:
                return
            saved = vars(owner).get(self.name, _INHERITED)
            original = getattr(owner, self.name) if saved is _INHERITED else saved
            self._saved, self._ours = saved, self._wrap(original, self.listeners)
            setattr(owner, self.name, self._ours)

    def listen(self, listener: L) -> Callable[[], None]:
        """Add `listener`, installing the patch with the first one; returns its undo."""
        with self._lock:
            self.install()
            self.listeners.append(listener)

        def undo() -> None:
            with self._lock:
                if listener in self.listeners:
                    self.listeners.remove(listener)
                if not self.listeners and not self.lasting:
                    self._take_off()
        return undo

    def _take_off(self) -> None:
        owner = self._owner() if self._ours is not None else None
        if owner is None or vars(owner).get(self.name) is not self._ours:
            return  # off already, or under someone's wrapper: it stays and passes through
        if self._saved is _INHERITED:
            delattr(owner, self.name)
        else:
            setattr(owner, self.name, self._saved)
        self._ours = None

    def on(self) -> bool:
        """Whether ours is the owner's attribute now."""
        owner = self._owner() if self._ours is not None else None
        return owner is not None and vars(owner).get(self.name) is self._ours


# -- torch.utils.swap_tensors ---------------------------------------------------------------
# It dispatches nothing, and refuses tensors with weak references (which the protected set
# holds): the guard reports the swap and steps its weak references aside first.

SwapListener = Callable[[torch.Tensor, torch.Tensor], Callable[[bool], None]]  # (t1, t2) -> after(swapped)
SWAP_OP = "torch.utils.swap_tensors"


def _wrap_swap(original: Callable[[torch.Tensor, torch.Tensor], None],
               listeners: list[SwapListener]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        afters: list[Callable[[bool], None]] = []
        swapped = False
        try:
            for listener in list(listeners):
                afters.append(listener(t1, t2))
            original(t1, t2)
            swapped = True
        finally:
            for after in reversed(afters):
                after(swapped)
    return swap_tensors


_SWAP: Patch[SwapListener] = Patch(lambda: torch.utils, "swap_tensors", _wrap_swap)


def on_swap_tensors(listener: SwapListener) -> Callable[[], None]:
    """Call `listener(t1, t2)` before every swap; it returns what to run after. Returns the undo."""
    return _SWAP.listen(listener)


# -- Tensor.data assignment -----------------------------------------------------------------
# `t.data = other` dispatches nothing either (it swaps the TensorImpl's storage and metadata
# in C). While a guard listens, `torch.Tensor.data` is a property whose setter tells the
# listeners first; its getter is torch's own.

DataListener = Callable[[torch.Tensor, torch.Tensor], Callable[[bool], None]]  # (tensor, value) -> after(assigned)
_DATA_DESCRIPTOR = torch._C.TensorBase.__dict__["data"]  # the C getset descriptor every tensor class inherits
DATA_OP = "Tensor.data assignment"


def _wrap_data(original: object, listeners: list[DataListener]) -> property:
    def set_data(self: torch.Tensor, value: torch.Tensor) -> None:
        if same_elements(self, value):
            _DATA_DESCRIPTOR.__set__(self, value)
            return
        afters: list[Callable[[bool], None]] = []
        assigned = False
        try:
            for listener in list(listeners):
                afters.append(listener(self, value))
            _DATA_DESCRIPTOR.__set__(self, value)
            assigned = True
        finally:
            for after in reversed(afters):
                after(assigned)
    return property(_DATA_DESCRIPTOR.__get__, set_data, _delete_data, doc=_DATA_DESCRIPTOR.__doc__)


def _delete_data(self: torch.Tensor) -> None:
    _DATA_DESCRIPTOR.__delete__(self)  # torch refuses: RuntimeError("Deleting tensor data is not allowed...")


_DATA: Patch[DataListener] = Patch(lambda: torch.Tensor, "data", _wrap_data)


def on_data_assignment(listener: DataListener) -> Callable[[], None]:
    """Call `listener(t, value)` before every `t.data = value`; it returns what to run after. Returns the undo."""
    return _DATA.listen(listener)


def data_is_watched() -> bool:
    """Whether `t.data = ...` is seen now (a guard at level "full" is active)."""
    return _DATA.on()


# -- Module._apply --------------------------------------------------------------------------
# `to`, `half`, `cpu`, `to_empty`... re-point parameters with `p.data = ...`, which no
# dispatched op shows: the listeners hear of the outermost call, before and after.

ConversionListener = Callable[[torch.nn.Module, object], Callable[[], None]]  # (module, fn) -> after
_converting = threading.local()


def _wrap_apply(original: Callable[..., torch.nn.Module],
                listeners: list[ConversionListener]) -> Callable[..., torch.nn.Module]:
    def _apply(self: torch.nn.Module, *args: object, **kwargs: object) -> torch.nn.Module:
        depth = getattr(_converting, "depth", 0)
        afters: list[Callable[[], None]] = []
        if depth == 0:
            fn = args[0] if args else kwargs.get("fn")
            afters = [listener(self, fn) for listener in list(listeners)]
        _converting.depth = depth + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _converting.depth = depth
            for after in reversed(afters):
                after()
    return _apply


_APPLY: Patch[ConversionListener] = Patch(lambda: torch.nn.Module, "_apply", _wrap_apply)


def on_module_conversion(listener: ConversionListener) -> Callable[[], None]:
    """Call `listener(module, fn)` before each outermost `Module._apply(fn)` (`to`, `half`, `cpu`,
    `to_empty`...), and what it returns after: it re-points parameters with `p.data = ...`,
    which no dispatched op shows. Returns the undo."""
    return _APPLY.listen(listener)


# -- Module.load_state_dict -----------------------------------------------------------------
# Its writes are meant: the listeners hear of each outermost call once it is over (also when
# it raised), so a guard can take the loaded module's values as its new reference.

LoadListener = Callable[[torch.nn.Module], None]
_loading = threading.local()


def _wrap_load(original: Callable[..., object], listeners: list[LoadListener]) -> Callable[..., object]:
    def load_state_dict(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
        depth = getattr(_loading, "depth", 0)
        _loading.depth = depth + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _loading.depth = depth
            if depth == 0:
                for listener in list(listeners):
                    listener(self)
    return load_state_dict


_LOAD: Patch[LoadListener] = Patch(lambda: torch.nn.Module, "load_state_dict", _wrap_load)


def on_load_state_dict(listener: LoadListener) -> Callable[[], None]:
    """Call `listener(module)` after each outermost `Module.load_state_dict`; returns the undo."""
    return _LOAD.listen(listener)


# -- c10d Work.wait -------------------------------------------------------------------------
# Every `torch.distributed` collective waits through it (a synchronous call waits before
# returning); its outputs were written by the backend, outside any dispatched op.

WaitListener = Callable[[Optional[list[torch.Tensor]]], None]


def _work_class() -> Optional[type]:
    try:
        import torch.distributed as dist
        return dist.Work if dist.is_available() else None
    except Exception:  # noqa: BLE001 - a torch built without distributed
        return None


def _wrap_wait(original: Callable[..., object], listeners: list[WaitListener]) -> Callable[..., object]:
    def wait(self: torch.distributed.Work, *args: object, **kwargs: object) -> object:
        done = original(self, *args, **kwargs)
        try:
            outputs: Optional[list[torch.Tensor]] = [t for t in self.get_future().value()
                                                     if isinstance(t, torch.Tensor)]
        except Exception:  # noqa: BLE001 - a backend with no future: it says nothing of its outputs
            outputs = None
        for heard in list(listeners):
            heard(outputs)
        return done
    return wait


_WAIT: Patch[WaitListener] = Patch(_work_class, "wait", _wrap_wait)


def on_work_wait(listener: WaitListener) -> Callable[[], None]:
    """Call `listener(outputs)` each time a c10d `Work.wait()` returns, on the waiting thread, with the
    tensors the collective wrote (its future's value) or None where the backend does not say. Every
    `torch.distributed` collective waits through it (a synchronous call waits before returning).
    Returns the undo; nothing is patched while no listener is left (or where torch has no c10d)."""
    return _WAIT.listen(listener)


# -- inductor-compiled graphs ---------------------------------------------------------------
# A graph writes the inputs it mutates inside its own kernels, where no op is dispatched. Its
# artifact knows which inputs those are before it runs (`compiled.mutated_inputs`): while a
# guard listens, each call of a graph that mutates an input asks the listeners first. Patched
# on the class when inductor is imported (never imported here), for the process: compiled
# code may hold the method.

GraphListener = Callable[[CompiledGraph, Sequence[object]], Optional[Callable[[bool], None]]]  # -> after(failed)
_GRAPH_MODULES = ("torch._inductor.output_code", "torch._inductor.codecache")  # where CompiledFxGraph lives, newest first
_graph_import_hooks: list[str] = []  # the modules whose import installs the patch, once registered


def _graph_class() -> Optional[type]:
    """`CompiledFxGraph`, once inductor is imported (None before)."""
    for name in _GRAPH_MODULES:
        cls = getattr(sys.modules.get(name), "CompiledFxGraph", None)
        if isinstance(cls, type) and getattr(cls, "__call__", None) is not None:
            return cls
    return None


def _wrap_graph_call(original: Callable[[CompiledGraph, Sequence[object]], object],
                     listeners: list[GraphListener]) -> Callable[[CompiledGraph, Sequence[object]], object]:
    """A graph that mutates no input, or any graph while no guard listens, costs one attribute
    read and one list test."""
    def __call__(self: CompiledGraph, inputs: Sequence[object]) -> object:
        if not listeners or not getattr(self, "mutated_input_idxs", None):
            return original(self, inputs)
        afters = [a for a in (listener(self, inputs) for listener in list(listeners)) if a is not None]
        if not afters:
            return original(self, inputs)
        try:
            out = original(self, inputs)
        except BaseException:
            for after in afters:
                after(True)
            raise
        for after in afters:
            after(False)
        return out

    functools.update_wrapper(__call__, original)
    return outside_dynamo(__call__)


_GRAPH: Patch[GraphListener] = Patch(_graph_class, "__call__", _wrap_graph_call, lasting=True)


def on_compiled_graph_call(listener: GraphListener) -> Callable[[], None]:
    """Call `listener(graph, inputs)` before every call of an inductor-compiled graph that mutates
    one of its inputs; it returns what to run after (or None). Returns the undo."""
    if not _graph_import_hooks:
        import wrapt

        for name in _GRAPH_MODULES:
            wrapt.register_post_import_hook(lambda module: _GRAPH.install(), name)
            _graph_import_hooks.append(name)
    return _GRAPH.listen(listener)


# -- autograd's saved-tensor hooks ----------------------------------------------------------
# Both stay for the process once a guard_autograd installs them; the first caller's
# functions are the ones they call.

UnpackHook = Callable[[Any], torch.Tensor]  # takes what the pack hook returned
SetAside = tuple[Callable[[PackHook], bool], Callable[[PackHook], None]]  # (is_ours, set_aside)
Compose = Callable[[PackHook, UnpackHook], Optional[tuple[PackHook, UnpackHook]]]


def _wrap_disable(original: Callable[[str], contextlib.AbstractContextManager[None]],
                  listeners: list[SetAside]) -> Callable[[str], contextlib.AbstractContextManager[None]]:
    autograd = torch._C._autograd

    @contextlib.contextmanager
    def disable_saved_tensors_hooks(error_message: str) -> Iterator[None]:
        top = autograd._top_saved_tensors_default_hooks(False)
        if top is None or not listeners or not listeners[0][0](top[0]):
            with original(error_message):
                yield
            return
        autograd._pop_saved_tensors_default_hooks()
        listeners[0][1](top[0])
        try:
            with original(error_message):
                yield
        finally:
            autograd._push_saved_tensors_default_hooks(*top)  # through `_wrap_push`: ours are left as they are

    disable_saved_tensors_hooks.__doc__ = original.__doc__
    return disable_saved_tensors_hooks


_ASIDE: Patch[SetAside] = Patch(lambda: torch.autograd.graph, "disable_saved_tensors_hooks", _wrap_disable,
                                lasting=True)


def let_func_transforms_run(is_ours: Callable[[PackHook], bool], set_aside: Callable[[PackHook], None]) -> None:
    """`torch.func.grad`, `vjp`, `jacrev` and `hessian` refuse to run under saved-tensor hooks
    (`torch.autograd.graph.disable_saved_tensors_hooks` raises): make that context set ours
    aside for its stretch when ours are the innermost, as if no hooks were installed, and tell
    `set_aside(pack)`, so the stretch is counted as not looked at.

    Patched once for the process; with anyone else's hooks innermost it behaves as torch's.
    """
    if not _ASIDE.listeners:
        _ASIDE.listen((is_ours, set_aside))


def _wrap_push(original: Callable[[PackHook, UnpackHook], None],
               listeners: list[Compose]) -> Callable[[PackHook, UnpackHook], None]:
    def push(pack: PackHook, unpack: UnpackHook) -> None:
        pair = listeners[0](pack, unpack) if listeners else None
        original(*(pair if pair is not None else (pack, unpack)))

    push.__doc__ = original.__doc__
    return push


_COMPOSE: Patch[Compose] = Patch(lambda: torch._C._autograd, "_push_saved_tensors_default_hooks", _wrap_push,
                                 lasting=True)


def compose_saved_tensors_hooks(compose: Compose) -> None:
    """Saved-tensor hooks do not nest (only the innermost pair runs): let `compose(pack, unpack)`
    replace each pair pushed from now on (`saved_tensors_hooks.__enter__`, so checkpointing,
    `save_on_cpu`, offloading), or return None to leave it as it is.

    Patched once for the process, on the one function every Python context pushes through.
    """
    if not _COMPOSE.listeners:
        _COMPOSE.listen(compose)


# -- __init_subclass__ of a torch class -----------------------------------------------------
# Wrapping a method on every subclass of a torch class (`Dataset.__getitem__`, a model's
# `load_weights`) reaches the classes defined so far by walking `__subclasses__()`, and those
# defined later through the base's `__init_subclass__`: while anyone listens, it is kvguard's,
# which runs the base's own (or the inherited one) and then tells the listeners of the class.

SubclassListener = Callable[[type], None]
_SUBCLASSES: dict[type, Patch[SubclassListener]] = {}  # base -> its patch, made on first use
_SUBCLASSES_LOCK = threading.Lock()


def _wrap_init_subclass(base: Any) -> Callable[[Any, list[SubclassListener]], object]:
    def wrap(original: object, listeners: list[SubclassListener]) -> object:
        own = vars(base).get("__init_subclass__")  # the base's own (a classmethod), None where inherited

        def __init_subclass__(cls: Any, /, **kwargs: Any) -> None:
            if isinstance(own, classmethod):
                own.__func__(cls, **kwargs)
            else:
                super(base, cls).__init_subclass__(**kwargs)
            for listener in list(listeners):
                listener(cls)
        return classmethod(__init_subclass__)
    return wrap


def on_every_subclass(base: type, wrap: SubclassListener,
                      later: Optional[SubclassListener] = None) -> Callable[[], None]:
    """Call `wrap(cls)` once for every subclass of `base` defined so far (the whole tree under
    it), then `later(cls)` (default: `wrap`) for each subclass defined from now on, as it is
    defined, until the undo this returns. An error raised by `wrap` or `later` propagates: a
    caller that must not fail a class definition swallows it in `later`.

    `base.__init_subclass__` is kvguard's while anyone listens on `base` (one patch per base,
    installed with the first listener, put back as it was with the last one's undo)."""
    seen: set[type] = set()
    todo: list[type] = list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            wrap(cls)
            todo += cls.__subclasses__()
    with _SUBCLASSES_LOCK:
        patch = _SUBCLASSES.get(base)
        if patch is None:
            patch = _SUBCLASSES[base] = Patch(lambda: base, "__init_subclass__", _wrap_init_subclass(base))
    return patch.listen(later if later is not None else wrap)

"""`KVGUARD_TARGETS=weights` on the rollout engine's side: every load of a model's weights.

A *load* (`kvguard._protect.weights_loads`) is entered here, once torch is imported:

- `load_weights(self, weights)` of every `torch.nn.Module` subclass that defines one (vLLM's
  and sglang's models; classes defined later too, through `Module.__init_subclass__`): the
  module is watched from the start of its first load, named as the caller names it;
- each function of `kvguard._activate.load_points` (the load points of vLLM, sglang, verl and OpenRLHF),
  once its module is imported.

The outermost one on a thread is the load; its writes to what it loads are its own. What
it is handed is protected until it has consumed it: a weights iterator is wrapped (each
item it yields is handed out as it is yielded, and consumed when the consumer asks for the
next one with a `for` loop, or when the load ends for a consumer that keeps them all:
`dict(weights)`), and the tensors of a list, tuple or dict given are handed out at once.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import types
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from kvguard._activate.weights_guard import counts
from kvguard._activate.load_points import LoadPoint, by_module
from kvguard._state import STATE

if TYPE_CHECKING:
    import torch

    from kvguard._config import Settings
    from kvguard._protect.weights_loads import Load

_MARK = "__kvguard_load__"
_local = threading.local()  # .depth: `load_weights` calls running on this thread
_names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # module -> how its loads name it
_settings: list[Settings] = []  # the settings activation started with (one process, one list)


def install(settings: Settings, torch: Any) -> None:
    """Wrap `load_weights` of every Module subclass (and of those defined later), and the load points
    of the frameworks as they are imported."""
    import wrapt

    from kvguard._torch.patches import on_every_subclass

    _settings[:] = [settings]
    STATE.undo.append(on_every_subclass(torch.nn.Module, _wrap_class, later=_wrap_later_class))
    for name, points in by_module().items():
        wrapt.register_post_import_hook(functools.partial(_wrap_points, points), name)


def _wrap_later_class(cls: type) -> None:
    """`_wrap_class` for a class being defined now: a debug switch never fails a class definition."""
    try:
        _wrap_class(cls)
    except Exception:  # noqa: BLE001 - a debug switch never fails a class definition
        pass


def _wrap_class(cls: type) -> None:
    method = cls.__dict__.get("load_weights")
    if not isinstance(method, types.FunctionType) or getattr(method, _MARK, False):
        return
    try:
        parameters = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return
    if len(parameters) < 2 or parameters[1].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                         inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return  # not `load_weights(self, weights, ...)`: a loader's, not a model's
    wrapper = _load_weights_wrapper(method, parameters[1].name)
    setattr(cls, "load_weights", wrapper)

    def restore() -> None:
        if cls.__dict__.get("load_weights") is wrapper:
            setattr(cls, "load_weights", method)
    STATE.undo.append(restore)


def _load_weights_wrapper(method: Callable[..., Any], argument: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def load_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_local, "depth", 0)
        try:
            load, outer = _begin(self, "load_weights", depth == 0, sys._getframe(1))
        except Exception:  # noqa: BLE001 - a debug switch never fails the user's load
            return method(self, *args, **kwargs)
        _local.depth = depth + 1
        try:
            if load is not None and depth == 0:  # the outermost load_weights: its weights are handed out
                try:
                    args, kwargs = _hand_weights(load, args, kwargs, argument, sys._getframe(1))
                except Exception:  # noqa: BLE001 - a debug switch never fails the user's load
                    pass
            return method(self, *args, **kwargs)
        finally:
            _local.depth = depth
            if load is not None and outer:
                _end(load)
    setattr(load_weights, _MARK, True)
    return load_weights


def _begin(module: Any, verb: str, watch: bool, frame: Optional[types.FrameType]) -> tuple[Optional[Load], bool]:
    """A load of `module` (None: of every watched module) starts: watched from now on (`watch`: the
    outermost `load_weights` on the thread adds its module), entered as a load. Returns the load
    and whether it is the outermost (the one to end)."""
    from kvguard._activate.weights_guard import _guard, _name_of
    from kvguard._protect import weights_loads as _loads
    from kvguard._protect.frames import site_of, user_frames

    if not _settings:
        return None, False
    guard = _guard(_settings[0])
    name = None
    if module is not None:
        name = _names.get(module)
        if name is None and watch:
            name = _names[module] = _name_of(module, frame)
            guard.add_modules([(name, module)])
    site = site_of(next(user_frames(frame), None))
    what = f"{name or type(module).__name__}.{verb}" if module is not None else verb
    load, outer = _loads.enter(what, site, module, next(user_frames(frame), None))
    if outer:
        counts[verb] = counts.get(verb, 0) + 1
    return load, outer


def _end(load: Load) -> None:
    from kvguard._activate.weights_guard import buffers_now
    from kvguard._protect import weights_loads as _loads

    _loads.leave(load)
    counts["buffers"] = max(counts.get("buffers", 0), buffers_now())


def _hand_weights(load: Load, args: tuple[Any, ...], kwargs: dict[str, Any], argument: str,
                  frame: Optional[types.FrameType]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The load's weights, as the method will get them: an iterator wrapped (its items handed out as
    they are yielded), the tensors of a list, tuple or dict handed out now."""
    if args:
        value = args[0]
    elif argument in kwargs:
        value = kwargs[argument]
    else:
        return args, kwargs
    if _is_iterator(value):
        handing = _Handing(value, load)
        return ((handing, *args[1:]), kwargs) if args else (args, {**kwargs, argument: handing})
    pairs = _pairs(value)
    if pairs:
        from kvguard._protect import weights_loads as _loads
        from kvguard._protect.frames import site_of, user_frames

        _loads.hand_out(load, pairs, site_of(next(user_frames(frame), None)).short)
        counts["handed"] = counts.get("handed", 0) + len(pairs)
    return args, kwargs


def _is_iterator(value: object) -> bool:
    try:
        return iter(value) is value  # type: ignore[call-overload]  # whatever the caller passed
    except TypeError:
        return False


def _pairs(value: object) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of a list or tuple of pairs, or of a dict (or its items view): read without
    consuming anything (only containers that iterate again)."""
    import torch

    items: list[object]
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple, type({}.items()))):
        items = list(value)
    else:
        return []
    return [(str(item[0]), item[1]) for item in items
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)]


class _Handing:
    """A load's weights iterator: each item handed out as it is yielded (see the module docstring)."""

    __slots__ = ("_source", "_load", "__weakref__")

    def __init__(self, source: Iterator[Any], load: Load) -> None:
        self._source = source
        self._load = load

    def __iter__(self) -> _Handing:
        return self

    def __next__(self) -> Any:
        from kvguard._protect import weights_loads as _loads
        from kvguard._protect.liveness import COLLECTORS, callee, collects

        load = self._load
        caller = sys._getframe(1)
        try:
            if not collects(caller, lambda: callee(caller) in COLLECTORS):
                _loads.consumed(load, caller)  # a loop asks for the next: the item before is done with
        except Exception:  # noqa: BLE001 - kvguard's bookkeeping never fails the user's load
            pass
        undo = _loads.source_running(load, caller)
        try:
            item = next(self._source)
        finally:
            undo()
        try:
            if isinstance(item, tuple) and len(item) == 2 and _is_tensor(item[1]):
                _loads.hand_out(load, [(str(item[0]), item[1])], _yielded_at(self._source))
                counts["handed"] = counts.get("handed", 0) + 1
        except Exception:  # noqa: BLE001
            pass
        return item


def _is_tensor(value: object) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _yielded_at(source: object) -> str:
    """`gen.py:12`: where a generator yielded its last item (the line that made or passed it on)."""
    frame = getattr(source, "gi_frame", None)
    if frame is None:
        return "?"
    inner = frame
    for _ in range(8):  # a generator delegating with `yield from`: the innermost yields
        below = getattr(getattr(inner, "f_generator", None), "gi_yieldfrom", None)
        if below is None or getattr(below, "gi_frame", None) is None:
            break
        inner = below.gi_frame
    # A suspended generator's frame has no caller: the answer is its file's and line's, read once per
    # yield statement (not per item: a load's generator yields every weight from the same line).
    key = (inner.f_code.co_filename, inner.f_lineno)
    short = _yield_sites.get(key)
    if short is None:
        from kvguard._protect.frames import site_of, user_frames

        short = site_of(next(user_frames(inner), inner)).short
        if key[0].startswith("<eval_with_key>"):
            return short  # an FX graph's line is its node's, read from the graph each time (`site_of`)
        if len(_yield_sites) >= 1024:
            _yield_sites.clear()
        _yield_sites[key] = short
    return short


_yield_sites: dict[tuple[str, int], str] = {}  # (file, line) of a yield -> `gen.py:12` (no code object kept)


def _wrap_points(points: list[LoadPoint], module: types.ModuleType) -> None:
    """Wrap the load points `module` defines (imported just now)."""
    for point in points:
        try:
            _wrap_point(point, module)
        except Exception:  # noqa: BLE001 - a function missing from this version: passed over
            continue


def _wrap_point(point: LoadPoint, module: types.ModuleType) -> None:
    *outer, name = point.qualname.split(".")
    owner: Any = module
    for part in outer:
        owner = getattr(owner, part)
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    if not isinstance(original, types.FunctionType) or getattr(original, _MARK, False):
        return
    signature = inspect.signature(original)
    short = point.qualname.rpartition(".")[2] if outer else point.qualname

    @functools.wraps(original)
    def load_point(*args: Any, **kwargs: Any) -> Any:
        loaded: Any = None
        if point.argument is not None:
            try:
                loaded = signature.bind_partial(*args, **kwargs).arguments.get(point.argument)
            except TypeError:
                loaded = None
            loaded = loaded if _is_module(loaded) else None
        try:
            load, outer_load = _begin(loaded, short, True, sys._getframe(1))
        except Exception:  # noqa: BLE001 - a debug switch never fails the user's load
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            if load is not None and outer_load:
                _end(load)
    setattr(load_point, _MARK, True)
    setattr(owner, name, load_point)

    def restore() -> None:
        if getattr(owner, "__dict__", {}).get(name) is load_point or getattr(owner, name, None) is load_point:
            setattr(owner, name, original)
    STATE.undo.append(restore)


def _is_module(value: object) -> bool:
    import torch

    return isinstance(value, torch.nn.Module)


def exit_lines(tag: str) -> list[str]:
    """What the loads were: `kvguard: weights: 20 loads watched (load_weights), 160 tensors handed to them …`."""
    from kvguard._text import plural

    loads = {verb: n for verb, n in counts.items() if verb not in ("handed", "buffers")}
    parts = []
    if loads:
        by = ", ".join(f"{n} by {verb}" for verb, n in sorted(loads.items())) if len(loads) > 1 else \
            ", ".join(loads)
        parts.append(f"{plural(sum(loads.values()), 'load')} watched ({by})")
    handed = counts.get("handed", 0)
    if handed:
        parts.append(f"{plural(handed, 'tensor')} handed to them protected until consumed")
    buffers = counts.get("buffers", 0)
    if buffers:
        parts.append(f"{plural(buffers, 'receive buffer')} watched for refills")
    return [f"{tag}: weights: {', '.join(parts)}"] if parts else []

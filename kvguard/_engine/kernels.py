"""The `kernels` backend: the write hook as Python kernels on ADInplaceOrView.

The Python twin of the compiled `kvguard._native.write_hook` (same functions, same behaviour), for
when no compiler is at hand: every writing op becomes a Python call (about 1.4x on a
per-token GAE, 2x with 20 % in-place ops), reads stay free. Installing it takes a few
hundred milliseconds; it is installed once per process and then switched on and off.
"""

from __future__ import annotations

import bisect
import threading
import warnings
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch

from kvguard._engine.backend import Callback
from kvguard._engine.hooks import overload_of
from kvguard._engine.judge import is_self_copy
from kvguard._protect import geometry as _geometry
from kvguard._torch import dispatch as _dispatch
from kvguard._torch import ops as _ops
from kvguard._torch import tensors as _tensors
from kvguard._torch.compiled import outside_dynamo
from kvguard._torch.dispatch import BELOW_HOOK, BELOW_INFERENCE, HOOK_KEY, INFERENCE_KEY, INFERENCE_KEY_NAME


class _State:
    enabled = False
    send_all = False
    intervals: tuple[list[int], list[int]] = ([], [])  # starts, stops: replaced whole, never changed
    identities: frozenset[int] = frozenset()  # TensorImpl addresses of protected tensors
    callback: Optional[Callback] = None
    watch: Optional[Callable[[], None]] = None
    writes = 0


_state = _State()
_local = threading.local()
_library: Optional[dict[str, torch.library.Library]] = None  # namespace -> its library
_hooked: list[str] = []
# The inference-mode kernels, registered at the first guard of an inference tensor:
# None (not yet), False (the key is someone else's), or the libraries holding them.
_inference: Union[None, Literal[False], dict[str, torch.library.Library]] = None


def install() -> int:
    """Register a kernel for every op overload that writes an argument; returns how many."""
    global _library
    if _library is not None:
        return len(_hooked)
    libraries: dict[str, torch.library.Library] = {}  # one per namespace: each registers only its own ops
    names = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel", once per op
        for name in _dispatch.all_op_names():
            func = _overload(name)
            if func is None or not _ops.op_facts(func).written or _python_original(name):
                continue
            namespace = name.partition("::")[0]
            try:
                if namespace not in libraries:
                    libraries[namespace] = torch.library.Library(namespace, "IMPL")  # type: ignore[no-untyped-call]
                _register(libraries[namespace], name, func)
            except Exception:  # noqa: BLE001 - an op torch.library refuses: left to the exit check
                continue
            names.append(name)
    _library = libraries
    _hooked[:] = names
    return len(names)


def uninstall() -> None:
    """Remove every kernel: the originals are back."""
    global _library, _inference
    if _library is not None:
        for library in _library.values():
            _dispatch.destroy_library(library)
        _library = None
        _hooked.clear()
    if _inference:
        for library in _inference.values():
            _dispatch.destroy_library(library)
    _inference = None


def hook_new() -> int:
    """Ops defined after install are not hooked here (enumerating them costs milliseconds
    per guard); the compiled hook hooks them. Their inner aten ops are seen."""
    return 0


def watch_inference(on: bool) -> bool:
    """As `write_hook.watch_inference`: this thread's writes inside inference mode are
    judged while one of its guards protects an inference tensor. Whether that can be done."""
    if not _install_inference():
        return False
    count = getattr(_local, "inference_watchers", 0)
    if on:
        if count == 0 and not _dispatch.thread_includes(INFERENCE_KEY):
            _dispatch.set_thread_includes(INFERENCE_KEY, True)
            _local.inference_included = True
        _local.inference_watchers = count + 1
    elif count > 0:
        _local.inference_watchers = count - 1
        if count == 1 and getattr(_local, "inference_included", False):
            _dispatch.set_thread_includes(INFERENCE_KEY, False)
            _local.inference_included = False
    return True


def _install_inference() -> bool:
    """Register the inference-mode kernels once (a fallthrough for every other op)."""
    global _inference
    if _inference is None:
        if _library is None or _dispatch.has_fallback(INFERENCE_KEY):
            _inference = False
            return False
        libraries: dict[str, torch.library.Library] = {
            "_": torch.library.Library("_", "IMPL")}  # type: ignore[no-untyped-call]
        libraries["_"].fallback(  # type: ignore[no-untyped-call]
            torch.library.fallthrough_kernel, dispatch_key=INFERENCE_KEY_NAME)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in _hooked:
                namespace = name.partition("::")[0]
                try:
                    if namespace not in libraries:
                        libraries[namespace] = torch.library.Library(namespace, "IMPL")  # type: ignore[no-untyped-call]
                    _register_inference(libraries[namespace], name, overload_of(name))
                except Exception:  # noqa: BLE001 - left to the boundary check inside inference mode
                    continue
        _inference = libraries
    return bool(_inference)


def installed() -> bool:
    return _library is not None


def hooked_ops() -> list[str]:
    return list(_hooked)


def set_enabled(on: bool) -> None:
    _state.enabled = bool(on)


def enabled() -> bool:
    return _state.enabled


def set_send_all(on: bool) -> None:
    _state.send_all = bool(on)


def set_intervals(intervals: Sequence[tuple[int, int]]) -> None:
    _state.intervals = ([int(a) for a, _ in intervals], [int(b) for _, b in intervals])


def add_protected(intervals: Sequence[tuple[int, int]], identities: Sequence[int], replace: bool = False) -> None:
    """Protect more (any order, any overlap): merged into the intervals and identities, or
    instead of them (`replace`). Published as new objects: readers keep the old ones."""
    if replace:
        merged = _geometry.merge_intervals((int(a), int(b)) for a, b in intervals if a < b)
        _state.intervals = ([a for a, _ in merged], [b for _, b in merged])
        _state.identities = frozenset(int(i) for i in identities)
        return
    if intervals:
        starts, stops = (list(side) for side in _state.intervals)  # copies: readers keep the old pair
        for start, stop in sorted((int(a), int(b)) for a, b in intervals if a < b):
            i = bisect.bisect_left(stops, start)  # the first interval that reaches `start`
            j = bisect.bisect_right(starts, stop)  # past the last one that starts by `stop`
            if i < j:  # it meets intervals i..j-1 (or touches them): one interval now
                start, stop = min(start, starts[i]), max(stop, stops[j - 1])
            starts[i:j], stops[i:j] = [start], [stop]
        _state.intervals = (starts, stops)
    if identities:
        _state.identities = _state.identities | frozenset(int(i) for i in identities)


def set_identities(identities: Sequence[int]) -> None:
    """Protected tensors by identity: a write to one is a candidate wherever its memory is."""
    _state.identities = frozenset(int(i) for i in identities)


def set_callback(callback: Optional[Callback]) -> None:
    _state.callback = callback


def set_watch(watch: Optional[Callable[[], None]], snapshots: object = None) -> None:
    """`watch` runs before every judged write (here `snapshots`, which lets the compiled hook
    skip it while nothing changed, is not compared: the watch compares them itself)."""
    _state.watch = watch


def writes() -> int:
    return _state.writes


def candidates(tensors: Sequence[object]) -> list[int]:
    """The positions of the tensors a write into which would reach the callback now."""
    if not _state.enabled or _state.callback is None:
        return []
    return [i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and _candidate(t)]


def _overload(name: str) -> Any:
    try:
        return overload_of(name)
    except Exception:  # noqa: BLE001 - an op without a Python binding
        return None


def _python_original(name: str) -> bool:
    """Whether the op's own ADInplaceOrView kernel is Python (a `torch.library.custom_op`).

    Calling such a kernel back from a Python kernel re-enters ours; its inner aten ops
    reach the hook anyway.
    """
    return _dispatch.python_hook_kernel(name)


# An op overload (`torch._ops.OpOverload`) and the dispatcher's key set a kernel is called with
# (`torch._C.DispatchKeySet`) are typed Any: their classes are private, named only in the fence.
def _register(library: torch.library.Library, name: str, func: Any) -> None:
    facts = _ops.op_facts(func)
    # Python kernels get wrapped numbers (`x.add_(2)`) as Python scalars, which the
    # original kernel's boxed call refuses for a Tensor parameter: pass them as 0-d
    # tensors of the dtype the op computes in.
    tensor_params = _ops.tensor_params(func)
    original = _dispatch.hook_kernel(func, name)
    is_copy = name == "aten::copy_"

    def call_original(keyset: Any, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        if original is None:
            return func.redispatch(keyset & BELOW_HOOK, *args, **kwargs)
        return original.call_boxed(keyset, *_as_tensors(args, kwargs, tensor_params), **kwargs)

    def kernel(keyset: Any, *args: object, **kwargs: object) -> object:
        if not _state.enabled or getattr(_local, "depth", False):
            return call_original(keyset, args, kwargs)
        return _judged(name, facts, is_copy, keyset, args, kwargs, call_original)

    # Runs inside ops, also while Dynamo traces a compiled function: never traced itself.
    library.impl(name.partition("::")[2], outside_dynamo(kernel), HOOK_KEY,  # type: ignore[no-untyped-call]
                 with_keyset=True)


def _register_inference(library: torch.library.Library, name: str, func: Any) -> None:
    """The kernel on the inference key: judges inference-mode writes to inference tensors
    (every other write reaches ADInplaceOrView), then runs what is below the key."""
    facts = _ops.op_facts(func)
    is_copy = name == "aten::copy_"
    tensor_params = _ops.tensor_params(func)

    def call_below(keyset: Any, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        return func.redispatch(keyset & BELOW_INFERENCE, *_as_tensors(args, kwargs, tensor_params), **kwargs)

    def kernel(keyset: Any, *args: object, **kwargs: object) -> object:
        if (not _state.enabled or getattr(_local, "depth", False) or not torch.is_inference_mode_enabled()
                or not any(t.is_inference() for t in _ops.written_tensors(facts, args, kwargs))):
            return call_below(keyset, args, kwargs)
        return _judged(name, facts, is_copy, keyset, args, kwargs, call_below)

    library.impl(name.partition("::")[2], outside_dynamo(kernel), INFERENCE_KEY_NAME,  # type: ignore[no-untyped-call]
                 with_keyset=True)


def _judged(name: str, facts: _ops.OpFacts, is_copy: bool, keyset: Any, args: tuple[object, ...],
            kwargs: dict[str, object], call: Callable[[Any, tuple[object, ...], dict[str, object]], object]) -> object:
    """Run an outermost writing op, judged: the callback on a possible hit, before and after `call`."""
    state = _state
    _local.depth = True
    try:
        state.writes += 1
        watch = state.watch
        if watch is not None:
            watch()
        after = None
        callback = state.callback
        if callback is not None:
            written = _ops.written_tensors(facts, args, kwargs)
            if any(map(_candidate, written)) and not (is_copy and is_self_copy(args)):
                read = _ops.shared_reads(facts, args, kwargs, written)  # as the compiled hook passes them
                after = callback(name, tuple(written), read) if read else callback(name, tuple(written))
        if after is None:
            return call(keyset, args, kwargs)
        try:
            out = call(keyset, args, kwargs)
        except BaseException:
            after(True)  # torch refused the write, maybe after it landed: report what changed
            raise
        after()
        return out
    finally:
        _local.depth = False


_judged = outside_dynamo(_judged)


def _as_tensors(args: tuple[object, ...], kwargs: dict[str, Any],
                params: list[tuple[int, str, bool]]) -> tuple[object, ...]:
    """`args` with Python numbers in Tensor parameters turned into 0-d tensors (kwargs changed in place)."""
    converted = None
    for position, name, kwarg_only in params:
        if not kwarg_only and position < len(args):
            value = args[position]
            if isinstance(value, (bool, int, float, complex)):
                converted = converted or list(args)
                converted[position] = _number_tensor(value, args)
        elif isinstance(kwargs.get(name), (bool, int, float, complex)):
            kwargs[name] = _number_tensor(kwargs[name], args)
    return tuple(converted) if converted is not None else args


def _number_tensor(value: complex, args: tuple[object, ...]) -> torch.Tensor:  # complex: or bool, int, float
    """`value` as a 0-d tensor of the dtype `torch.result_type(first tensor, value)` gives.

    Read from the dtype alone: no op may run on the user's tensor here (a subclass may refuse it).
    """
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None:
        return torch.scalar_tensor(value)
    dtype = first.dtype
    if isinstance(value, bool):
        kind = 0
    elif isinstance(value, int):
        kind = 1
    elif isinstance(value, float):
        kind = 2
    else:
        kind = 3
    have = 3 if dtype.is_complex else 2 if dtype.is_floating_point else 0 if dtype == torch.bool else 1
    if kind <= have:
        return torch.scalar_tensor(value, dtype=dtype)
    if kind == 1:
        return torch.scalar_tensor(value, dtype=torch.int64)
    default = torch.get_default_dtype()
    if kind == 2:
        return torch.scalar_tensor(value, dtype=default)
    complex_of = {torch.float64: torch.complex128, torch.float16: torch.complex32}
    return torch.scalar_tensor(value, dtype=complex_of.get(dtype, complex_of.get(default, torch.complex64)))


def _candidate(tensor: torch.Tensor) -> bool:
    """Whether a write to `tensor` may touch protected memory (Python then decides exactly)."""
    state = _state
    if state.send_all:
        return True
    try:
        if _tensors.identity(tensor) in state.identities:
            return True
        storage = tensor.untyped_storage()
        lo = storage.data_ptr()
        hi = lo + storage.nbytes()
    except Exception:  # noqa: BLE001 - no readable storage (sparse, wrapper subclasses): by identity
        return True
    if lo == 0:
        return True
    starts, stops = state.intervals  # sorted and disjoint: only the last one starting below `hi` can meet it
    i = bisect.bisect_right(starts, hi - 1) - 1
    return i >= 0 and stops[i] > lo

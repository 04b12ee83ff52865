"""What an op writes, and which memory a tensor covers.

The only module that touches private or version-sensitive torch APIs. Everything here is
pure: it reads schemas and tensor metadata, never tensor values.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

# c10d's in-place collectives mark no argument as written (their schemas carry no alias
# annotation), so a schema-only filter drops them. These are the parameters they write.
_C10D_WRITTEN_NAMES = frozenset(
    {"tensors", "output_tensor", "output_tensors", "outputs", "output", "output_lists"}
)
# inplace_view ops that make a tensor refer to other memory, rather than only changing
# its shape or strides.
_REPOINTING_OPS = frozenset({"set_", "resize_", "resize_as_", "resize_as_sparse_"})


class WrittenArg(NamedTuple):
    """A parameter an op writes: its position, its name, and whether it is keyword-only."""

    position: int
    name: str
    kwarg_only: bool


class OpFacts(NamedTuple):
    """What the guard needs to know about one op overload, computed once per overload."""

    written: tuple[WrittenArg, ...]
    kind: str  # "write", "metadata" (inplace_view) or "repoint" (set_, resize_)
    self_only: bool = False  # writes exactly its first positional `Tensor` argument


NO_WRITES = OpFacts((), "write")
# Keyed by id(): OpOverload hashes in Python, and this lookup runs for every op. The
# overload is kept in the value, so an id can never be reused while it is cached.
_facts_cache: dict[int, tuple[Any, OpFacts]] = {}


def op_facts(func: Any) -> OpFacts:
    """Which arguments `func` writes, from its schema (cached per overload)."""
    cached = _facts_cache.get(id(func))
    if cached is None:
        cached = _facts_cache[id(func)] = (func, _learn(func))
    return cached[1]


def _learn(func: Any) -> OpFacts:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return NO_WRITES
    written = tuple(
        WrittenArg(i, a.name, a.kwarg_only)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )
    if not written and getattr(func, "namespace", "") == "c10d":
        if schema.name.endswith("_"):
            written = tuple(
                WrittenArg(i, a.name, a.kwarg_only)
                for i, a in enumerate(schema.arguments)
                if a.name in _C10D_WRITTEN_NAMES
            )
    if not written:
        return NO_WRITES
    base_name = schema.name.split("::")[-1]
    if base_name in _REPOINTING_OPS:
        kind = "repoint"
    elif torch.Tag.inplace_view in getattr(func, "tags", ()):
        kind = "metadata"
    else:
        kind = "write"
    self_only = (len(written) == 1 and written[0].position == 0 and not written[0].kwarg_only
                 and str(schema.arguments[0].type) == "Tensor")
    return OpFacts(written, kind, self_only)


def written_tensors(facts: OpFacts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op call writes, with `Tensor[]` and `Tensor[][]` lists flattened."""
    if facts.self_only:  # `mul_`, `copy_`, `index_put_`...: the common case, kept cheap
        first = args[0] if args else kwargs.get("self")
        return [first] if isinstance(first, torch.Tensor) else []
    found: list[torch.Tensor] = []
    for arg in facts.written:
        if not arg.kwarg_only and arg.position < len(args):
            _collect(args[arg.position], found)
        else:
            _collect(kwargs.get(arg.name), found)
    return found


def _collect(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, found)


def short_op_name(func: Any) -> str:
    """`aten.mul_.Tensor`, the name users see in reports."""
    return str(func)


# ---------------------------------------------------------------------------------------
# Memory


class Span(NamedTuple):
    """The bytes a strided tensor can touch: `[start, stop)` on one device."""

    device: Any  # torch.device
    start: int
    stop: int
    dense: Optional[bool]  # elements tile the span exactly; None: not known yet (see `dense`)


_STRIDED = torch.strided


def spans(t: torch.Tensor) -> list[Span]:
    """Byte spans of a tensor's elements; several for sparse tensors, none without memory.

    On the hot path (every write op), so it reads as little metadata as it can.
    Raises nothing: a tensor whose memory cannot be read (meta, functional wrappers,
    unusual subclasses) has no spans and is matched by identity instead.
    """
    try:
        if t.layout != _STRIDED:
            return [s for part in _sparse_parts(t) for s in spans(part)]
        start = t.data_ptr()
        if start == 0:  # meta tensors, and some empty ones
            return []
        if t.is_contiguous():
            nbytes = t.nbytes
            return [Span(t.device, start, start + nbytes, True)] if nbytes else []
        if t.numel() == 0:
            return []
        # PyTorch strides are never negative, so the first element is at data_ptr.
        reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return [Span(t.device, start, start + (reach + 1) * t.element_size(), None)]
    except Exception:  # noqa: BLE001 - a guard must never crash on an unusual tensor
        return []


def dense(span: Span, t: torch.Tensor) -> bool:
    """Whether `t`'s elements tile `span` exactly (computed only on a span overlap)."""
    return span.dense if span.dense is not None else is_dense(t.shape, t.stride())


def is_dense(shape: Any, stride: Any) -> bool:
    """True when the elements tile their span with no gaps and no overlap."""
    expected = 1
    for n, s in sorted(((n, s) for n, s in zip(shape, stride) if n != 1), key=lambda p: p[1]):
        if s != expected:
            return False
        expected *= n
    return True


def _sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    layout = t.layout
    if layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []


def element_starts(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Sorted absolute byte addresses of `t`'s elements that start in `[lo, hi)`.

    O(numel) in int64 arithmetic on the CPU, built dimension by dimension so that the
    intermediate never exceeds the result; used only when two spans overlap and one of
    them is not dense.
    """
    size = t.element_size()
    offsets = torch.tensor([t.data_ptr()], dtype=torch.int64)
    # Fold in the dimensions with the largest strides first, dropping addresses that
    # cannot reach the window, so the work stays proportional to the overlap.
    dims = sorted(zip(t.shape, t.stride()), key=lambda p: -p[1])
    reach_after = [0] * (len(dims) + 1)
    for i in range(len(dims) - 1, -1, -1):
        n, s = dims[i]
        reach_after[i] = reach_after[i + 1] + (n - 1) * s * size
    for i, (n, s) in enumerate(dims):
        step = torch.arange(n, dtype=torch.int64) * (s * size)
        offsets = (offsets[:, None] + step[None, :]).reshape(-1)
        offsets = offsets[(offsets + reach_after[i + 1] + size > lo) & (offsets < hi)]
    result: torch.Tensor = torch.unique(offsets[(offsets + size > lo) & (offsets < hi)])
    return result


def elements_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether any byte of an element of `a` is also a byte of an element of `b`."""
    (sa,), (sb,) = spans(a) or (None,), spans(b) or (None,)
    if sa is None or sb is None:
        return False
    lo, hi = max(sa.start, sb.start), min(sa.stop, sb.stop)
    if sa.device != sb.device or lo >= hi:
        return False
    if dense(sa, a) and dense(sb, b):
        return True
    size_a, size_b = a.element_size(), b.element_size()
    starts_a = element_starts(a, lo - size_a + 1, hi)
    starts_b = element_starts(b, lo - size_b + 1, hi)
    if starts_a.numel() == 0 or starts_b.numel() == 0:
        return False
    # For each element of b, the last element of a starting before b's element ends.
    idx = torch.searchsorted(starts_a, starts_b + size_b) - 1
    valid = idx >= 0
    return bool(((starts_a[idx.clamp(min=0)] + size_a > starts_b) & valid).any())


def storage_fingerprint(t: torch.Tensor) -> tuple[Any, ...]:
    """Identity and layout facts that change when a tensor is re-pointed or swapped."""
    try:
        if t.layout != torch.strided:
            return (t._cdata, t.layout, tuple(t.shape))
        ptr = t.data_ptr() if t.device.type != "meta" else 0
        return (t._cdata, ptr, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)
    except Exception:  # noqa: BLE001
        return (id(t),)


def innermost_dispatch_mode() -> Any:
    """The dispatch mode that ops on this thread reach first, or None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


# What `TorchDispatchMode.__enter__` saves and `__exit__` restores, one entry per entry.
_SAVED_MODE_FLAGS = ("old_dispatch_mode_flags", "old_non_infra_dispatch_mode_flags",
                     "old_without_ignore_compile_internals_dispatch_mode_flags")


def exit_dispatch_mode(mode: Any, exc_info: tuple[Any, Any, Any]) -> bool:
    """Leave `mode`, even when modes entered after it are still active; False if it is not here.

    A guard held by a generator that is dropped while another guard is active exits
    while it is not innermost. Popping would remove someone else's mode, so the modes
    above it are lifted off, `mode` is removed, and they are put back; the flags `mode`
    saved on entry pass to the mode entered right after it, which now restores them.
    A mode on another thread's stack cannot be reached: the caller makes it inert.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if innermost_dispatch_mode() is mode:
        mode.__exit__(*exc_info)
        return True
    if not any(m is mode for m in _get_current_dispatch_mode_stack()):
        return False
    above = []
    while (top := torch._C._pop_torch_dispatch_stack(None)) is not mode:
        above.append(top)
    successor = above[-1] if above else None
    for name in _SAVED_MODE_FLAGS:
        ours, theirs = getattr(mode, name, None), getattr(successor, name, None)
        if ours:
            saved = ours.pop()
            if theirs:
                theirs[-1] = saved
    for top in reversed(above):
        torch._C._push_on_torch_dispatch_stack(top)
    return True


# ---------------------------------------------------------------------------------------
# torch.utils.swap_tensors dispatches nothing, and refuses tensors with weak references
# (which the protected set holds). While a guard is active the function is wrapped so
# the guard can report the swap and step its weak references aside.

SwapListener = Callable[[torch.Tensor, torch.Tensor], Callable[[], None]]
_swap_listeners: list[SwapListener] = []
_swap_original: Optional[Callable[..., Any]] = None
SWAP_OP = "torch.utils.swap_tensors"


def on_swap_tensors(listener: SwapListener) -> Callable[[], None]:
    """Call `listener(t1, t2)` before every swap; it returns what to run after. Returns the undo."""
    global _swap_original
    if not _swap_listeners:
        _swap_original = torch.utils.swap_tensors
        torch.utils.swap_tensors = _swap_tensors
    _swap_listeners.append(listener)

    def remove() -> None:
        global _swap_original
        if listener in _swap_listeners:
            _swap_listeners.remove(listener)
        if not _swap_listeners and _swap_original is not None:
            torch.utils.swap_tensors = _swap_original
            _swap_original = None
    return remove


def _swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
    afters: list[Callable[[], None]] = []
    try:
        for listener in list(_swap_listeners):
            afters.append(listener(t1, t2))
        assert _swap_original is not None
        _swap_original(t1, t2)
    finally:
        for after in reversed(afters):
            after()

"""What an op writes, and which memory a tensor covers.

The only module that touches private or version-sensitive torch APIs. Everything here is
pure: it reads schemas and tensor metadata, never tensor values.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple

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

    index: int
    name: str
    kwarg_only: bool


class OpFacts(NamedTuple):
    """What the guard needs to know about one op overload, computed once per overload."""

    written: tuple[WrittenArg, ...]
    kind: str  # "write", "metadata" (inplace_view) or "repoint" (set_, resize_)


NO_WRITES = OpFacts((), "write")
_facts_cache: dict[Any, OpFacts] = {}


def op_facts(func: Any) -> OpFacts:
    """Which arguments `func` writes, from its schema (cached per overload)."""
    facts = _facts_cache.get(func)
    if facts is None:
        facts = _facts_cache[func] = _learn(func)
    return facts


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
    return OpFacts(written, kind)


def written_tensors(facts: OpFacts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors an op call writes, with `Tensor[]` and `Tensor[][]` lists flattened."""
    for arg in facts.written:
        if not arg.kwarg_only and arg.index < len(args):
            value = args[arg.index]
        else:
            value = kwargs.get(arg.name)
        yield from _tensors_in(value)


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def short_op_name(func: Any) -> str:
    """`aten.mul_.Tensor`, the name users see in reports."""
    return str(func)


# ---------------------------------------------------------------------------------------
# Memory


class Span(NamedTuple):
    """The bytes a strided tensor can touch: `[start, stop)` on one device."""

    device: tuple[str, int]
    start: int
    stop: int
    dense: bool  # its elements cover every byte of the span exactly once


def spans(t: torch.Tensor) -> list[Span]:
    """Byte spans of a tensor's elements; several for sparse tensors, none without memory.

    Raises nothing: a tensor whose memory cannot be read (meta, functional wrappers,
    unusual subclasses) has no spans and is matched by identity instead.
    """
    try:
        layout = t.layout
        if layout == torch.strided:
            return [_strided_span(t)] if _has_memory(t) else []
        return [s for part in _sparse_parts(t) for s in spans(part)]
    except Exception:  # noqa: BLE001 - a guard must never crash on an unusual tensor
        return []


def _has_memory(t: torch.Tensor) -> bool:
    return t.device.type != "meta" and t.numel() > 0 and t.data_ptr() != 0


def _strided_span(t: torch.Tensor) -> Span:
    # PyTorch strides are never negative, so the first element is at data_ptr.
    size = t.element_size()
    start = t.data_ptr()
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    device = (t.device.type, t.device.index if t.device.index is not None else -1)
    return Span(device, start, start + (reach + 1) * size, is_dense(t.shape, t.stride()))


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
    return torch.unique(offsets[(offsets + size > lo) & (offsets < hi)])


def elements_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether any byte of an element of `a` is also a byte of an element of `b`."""
    sa, sb = _strided_span(a), _strided_span(b)
    lo, hi = max(sa.start, sb.start), min(sa.stop, sb.stop)
    if sa.device != sb.device or lo >= hi:
        return False
    if sa.dense and sb.dense:
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


def dispatch_stack_depth() -> int:
    """How many dispatch modes are active on this thread."""
    return int(torch._C._len_torch_dispatch_stack())

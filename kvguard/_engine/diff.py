"""Text summaries of a tensor's values, and the diff between two versions of it.

Called only on a protected write, never on the hot path. Everything returned is a
string. A write is compared over the elements it can change (flat index ranges from
`_geometry.flat_ranges`): the copy taken before it holds only those, and every pass over
the values goes CHUNK elements at a time, so the extra memory is that copy plus a few MB.
"""

from __future__ import annotations

import functools
import math
import struct
import sys
from typing import (Any, Callable, Concatenate, Iterator, NamedTuple, Optional, ParamSpec, Sequence,
                    TypeVar)

import torch

from kvguard._protect import geometry as _geometry
from kvguard._text import plural
from kvguard._torch import tensors as _tensors

SHOW_VALUES = 4  # sample values shown in a summary or a diff
CHUNK = 1 << 18  # elements per step of a pass over the values: temporaries stay a few MB
MAX_SNAPSHOT_BYTES = 1 << 30  # a bigger write is compared over its first 1 GiB, and says so
MAX_WHY_CHARS = 160  # of an exception's first line, in a "values not summarised" text

NO_COPY = "no copy of the values from before the write"

P = ParamSpec("P")
R = TypeVar("R")
Summary = Callable[Concatenate[torch.Tensor, P], R]
Ranges = Sequence[tuple[int, int]]  # flat index ranges [i, j) of a tensor, sorted, disjoint

_DTYPE_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
    torch.uint16: "u16", torch.uint32: "u32", torch.uint64: "u64",
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _name):  # float8 as DebugMode writes it (f8e4m3fn); not every build has all
        _DTYPE_SHORT[getattr(torch, _name)] = "f8" + _name[len("float8_"):]


def _never_raises(fallback: Callable[[str], R]) -> Callable[[Summary[P, R]], Summary[P, R]]:
    """The one rule: summarising a write never raises into the user's op.

    Every public summary goes through here. Odd tensors (float8, DTensor, nested, tensor
    subclasses whose ops fail) get `fallback(why)` instead of an exception; the write
    itself is still reported, and under raise the only exception is `MutationError`.
    """
    def wrap(fn: Summary[P, R]) -> Summary[P, R]:
        @functools.wraps(fn)
        def safe(t: torch.Tensor, /, *args: P.args, **kwargs: P.kwargs) -> R:
            try:
                with torch.no_grad():
                    return fn(t, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the rule: nothing escapes a summary
                return fallback(_why(t, exc))
        return safe
    return wrap


def _why(t: torch.Tensor, exc: Exception) -> str:
    """`float8_e4m3fn: NotImplementedError: "gt_cpu" not implemented ...`, never raising."""
    try:
        detail = (str(exc).strip().splitlines() or [""])[0][:MAX_WHY_CHARS]
        return f"{_kind(t)}: {type(exc).__name__}{': ' if detail else ''}{detail}"
    except Exception:  # noqa: BLE001 - an exception whose text cannot be read
        return type(exc).__name__


def _kind(t: torch.Tensor) -> str:
    """dtype, then layout and class where they are not the plain ones."""
    parts = [str(t.dtype).replace("torch.", "")]
    if t.layout != torch.strided:
        parts.append(str(t.layout).replace("torch.", ""))
    elif t.is_nested:
        parts.append("nested")
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        parts.append(type(t).__name__)
    return " ".join(parts)


def _not_summarised(why: str) -> str:
    return f"values not summarised ({why})"


@_never_raises(lambda why: f"tensor not described ({why})")
def describe(t: torch.Tensor) -> str:
    """`f32[4, 1024] cpu`: dtype, shape and device, DebugMode-style."""
    dtype = _DTYPE_SHORT.get(t.dtype, str(t.dtype).replace("torch.", ""))
    layout = "" if t.layout == torch.strided else f" {str(t.layout).replace('torch.', '')}"
    if t.is_nested and t.layout == torch.strided:  # has no `shape`
        return f"{dtype}[{_nested_shape(t)}] {t.device} nested"
    return f"{dtype}[{', '.join(map(str, t.shape))}] {t.device}{layout}{_placements(t)}"


def _nested_shape(t: torch.Tensor) -> str:
    """`2, *, 4`: the batch size, then each dimension's size, `*` where components differ."""
    sizes = t._nested_tensor_size()  # one row of sizes per component
    dims = [str(int(col[0])) if col.numel() and bool((col == col[0]).all()) else "*"
            for col in sizes.unbind(1)] if sizes.dim() == 2 else []
    return ", ".join([str(t.size(0))] + dims)


def _placements(t: torch.Tensor) -> str:
    """` DTensor(S(0))`: how a DTensor is laid out over its mesh (values shown are local)."""
    dtensor = _as_dtensor(t)
    return "" if dtensor is None else f" DTensor({', '.join(map(str, dtensor.placements))})"


def _as_dtensor(t: torch.Tensor) -> Any:
    """`t` if it is a DTensor, else None. Its module is read only if loaded (if not, no
    tensor can be one); typed loosely, as torch.distributed may not be built."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return t if dtensor is not None and isinstance(t, dtensor) else None


class _Data(NamedTuple):
    """A tensor's values as plain strided tensors, and how to name them."""

    tensor: torch.Tensor  # the values in the tensor's own row-major order (what `values` shows)
    view: torch.Tensor  # the same, dims permuted into memory order: what passes and copies read
    order: Optional[tuple[int, ...]]  # view = tensor.permute(order); None: the same order
    labelled: bool  # indices print as `[i, j]`; else as `#i`, flat into the stored values
    noun: str  # what they are: "elements", or "stored values" of a sparse tensor
    indexed: bool  # the index ranges of `_geometry.flat_ranges` (in memory order) apply
    dequantize: bool  # stored quantized: each piece is dequantized as it is read


def _data(t: torch.Tensor) -> _Data:
    """The values that can be read cheaply: a DTensor's local shard, a nested or sparse
    tensor's stored values, a quantized tensor's values; no copy, no communication, ever."""
    dtensor = _as_dtensor(t)
    if dtensor is not None:
        local = dtensor.to_local().detach()  # never full_tensor(): a collective, other ranks may not join
        return _Data(local, local, None, True, "elements", False, False)
    t = t.detach()
    if t.is_nested:
        return _Data(t.values(), t.values(), None, False, "elements", False, False)
    if t.layout == torch.sparse_coo:
        return _Data(_tensors.stored_values(t), _tensors.stored_values(t), None, False, "stored values", False, False)
    if t.layout != torch.strided:  # compressed sparse layouts
        return _Data(t.values(), t.values(), None, False, "stored values", False, False)
    if t.device.type == "meta":
        raise ValueError("a meta tensor holds no data")
    order = None if t.is_quantized else _geometry.memory_order(t)
    if order == tuple(range(t.dim())):
        order = None
    view = t if order is None else t.permute(order)
    return _Data(t, view, order, True, "elements", True, t.is_quantized)


def _value_dtype(data: _Data) -> torch.dtype:
    return torch.float32 if data.dequantize else data.view.dtype


def _to_flat(i: int, data: _Data) -> int:
    """An index into `data.view`'s row-major order, as an index into the tensor's own."""
    if data.order is None:
        return i
    coords = [0] * len(data.order)
    for d, c in zip(data.order, _unravel(i, data.view.shape)):
        coords[d] = c
    return _ravel(coords, data.tensor.shape)


def _to_view(i: int, data: _Data) -> int:
    """An index into the tensor's own row-major order, as one into `data.view`'s."""
    if data.order is None:
        return i
    coords = _unravel(i, data.tensor.shape)
    return _ravel([coords[d] for d in data.order], data.view.shape)


def _unravel(i: int, shape: Sequence[int]) -> list[int]:
    coords = []
    for n in reversed(shape):
        coords.append(i % n if n else 0)
        i //= n if n else 1
    return coords[::-1]


def _ravel(coords: Sequence[int], shape: Sequence[int]) -> int:
    i = 0
    for c, n in zip(coords, shape):
        i = i * n + c
    return i


def _pieces(t: torch.Tensor, start: int, stop: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Views of `t` that cover its row-major elements `[start, stop)` in order, each at most
    CHUNK elements, as (flat index of the first, view): one pass in bounded temporaries."""
    if t.dim() == 0:
        if start < stop:
            yield 0, t.reshape(1)
        return
    yield from _walk(t, 0, start, stop)


def _walk(t: torch.Tensor, base: int, start: int, stop: int) -> Iterator[tuple[int, torch.Tensor]]:
    if start >= stop:
        return
    inner = math.prod(t.shape[1:])  # elements per index of the first dim
    row = start // inner
    if start % inner:  # a partial first row
        end = min(stop, (row + 1) * inner)
        yield from _walk(t[row], base + row * inner, start - row * inner, end - row * inner)
        start, row = end, row + 1
        if start >= stop:
            return
    full_end = stop // inner
    if inner > CHUNK:
        for r in range(row, full_end):
            yield from _walk(t[r], base + r * inner, 0, inner)
    else:
        step = CHUNK // inner
        for r in range(row, full_end, step):
            yield base + r * inner, t[r:min(r + step, full_end)]
    if stop % inner:  # a partial last row
        yield from _walk(t[full_end], base + full_end * inner, 0, stop - full_end * inner)


def _read(data: _Data, piece: torch.Tensor) -> torch.Tensor:
    """A piece's values as plain numbers: lazy conjugate and negative views resolved."""
    return piece.dequantize() if data.dequantize else piece.resolve_conj().resolve_neg()


def _ranges(data: _Data, ranges: Optional[Ranges]) -> list[tuple[int, int]]:
    """The written index ranges, or all the values when they do not apply to `data`."""
    if ranges is None or not data.indexed:
        return [(0, data.view.numel())]
    return [(int(i), int(j)) for i, j in ranges]


def _segments(data: _Data, spans: list[tuple[int, int]], limit: int
              ) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(position in a copy of the spans, index into `data.view`, piece) over the first `limit`."""
    pos = 0
    for i, j in spans:
        take = min(j - i, limit - pos)
        if take <= 0:
            return
        for index, piece in _pieces(data.view, i, i + take):
            yield pos + index - i, index, piece
        pos += take


def _position(i: int, spans: list[tuple[int, int]]) -> Optional[int]:
    """Where the value at view index `i` sits in a copy of `spans`, if it is in one."""
    pos = 0
    for lo, hi in spans:
        if lo <= i < hi:
            return pos + i - lo
        pos += hi - lo
    return None


def _no_copy(why: str) -> Optional[torch.Tensor]:
    return None


@_never_raises(_no_copy)
def snapshot(t: torch.Tensor, ranges: Optional[Ranges] = None) -> Optional[torch.Tensor]:
    """A detached copy of `t`'s values in the index `ranges` (default: all), one after
    the other, read a chunk at a time; at most MAX_SNAPSHOT_BYTES of them.

    `ranges` index `t`'s values in memory order (`_geometry.memory_order`, `_geometry.flat_ranges`).
    """
    data = _data(t)
    spans = _ranges(data, ranges)
    limit = max(1, MAX_SNAPSHOT_BYTES // _value_dtype(data).itemsize)
    copy = torch.empty(min(sum(j - i for i, j in spans), limit), dtype=_value_dtype(data),
                       device=data.view.device)
    for pos, _, piece in _segments(data, spans, copy.numel()):
        copy[pos:pos + piece.numel()].view(piece.shape).copy_(_read(data, piece))
    return copy


@_never_raises(_no_copy)
def advance(t: torch.Tensor, before: torch.Tensor, ranges: Optional[Ranges] = None) -> Optional[torch.Tensor]:
    """Move a snapshot to `t`'s current values, in place when the layout allows."""
    data = _data(t)
    spans = _ranges(data, ranges)
    if _layout_changed(data, before, spans):
        return snapshot(t, ranges)
    for pos, _, piece in _segments(data, spans, before.numel()):
        before[pos:pos + piece.numel()].view(piece.shape).copy_(_read(data, piece))
    return before


@_never_raises(_not_summarised)
def values(t: torch.Tensor, around: int = 0, *, before: Optional[torch.Tensor] = None,
           ranges: Optional[Ranges] = None) -> str:
    """A few values from flat index `around` on: `[0.125, -0.5, 0.3, 1 … (+1020)]`.

    With `before` (a `snapshot` of the index `ranges`), the values it holds stand in for
    `t`'s own: the values as they were before a write that changed only those ranges.
    """
    data = _data(t)
    numel = data.tensor.numel()
    start = max(0, min(around, numel - SHOW_VALUES))
    stop = min(numel, start + SHOW_VALUES)
    parts = [_read(data, piece).reshape(-1) for _, piece in _pieces(data.tensor, start, stop)]
    shown = torch.cat(parts) if parts else torch.empty(0, dtype=_value_dtype(data))
    if before is not None:
        shown, spans = shown.clone(), _ranges(data, ranges)
        for i in range(start, stop):
            pos = _position(_to_view(i, data), spans)
            if pos is not None and pos < before.numel():
                shown[i - start] = before[pos]
    text = ", ".join(_fmt(v) for v in shown.tolist())
    head = f"(+{start}) … " if start else ""
    rest = numel - start - SHOW_VALUES
    return f"[{head}{text}{f' … (+{rest})' if rest > 0 else ''}]"


class _Changes:
    """What one pass over the written values found (see `_compare`)."""

    def __init__(self) -> None:
        self.count = 0  # values whose bits changed
        self.samples: list[tuple[int, object, object]] = []  # (view index, before, after), the first few
        self.max_delta: Optional[float] = None  # from chunks compared in float64
        self.screened: Optional[float] = None  # largest exact |Δ| among the screened maxima
        self.flips = 0
        self.zero_signs = 0  # 0.0 ↔ -0.0: equal as numbers, not as bits
        self.nan_bits = 0  # NaN staying NaN with other bits (payload or sign)


# Dtypes whose `-` and `abs` run natively and round monotonically: |Δ| is screened in
# them, and only the elements that reach a chunk's maximum are redone in float64.
_SCREEN = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
# Signed dtypes with native comparisons, and the integer dtype that shows their sign bit.
_SIGN_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
              torch.float64: torch.int64, torch.int8: torch.int8, torch.int16: torch.int16,
              torch.int32: torch.int32, torch.int64: torch.int64}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_differ(was: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Where the two hold different bits: the fingerprints' rule (`kvguard._protect.digest` reads raw bits),
    so `0.0 → -0.0` is a change and a NaN that keeps its bits is not."""
    if was.dtype.is_complex:
        was, after = torch.view_as_real(was), torch.view_as_real(after)
        ints = _INT_OF_SIZE[was.element_size()]
        return (was.view(ints) != after.view(ints)).any(-1)
    if was.dtype.is_floating_point:
        ints = _INT_OF_SIZE[was.element_size()]
        return was.view(ints) != after.view(ints)
    return was != after  # integers and bool: equal values are equal bits


def _compare(data: _Data, before: torch.Tensor, spans: list[tuple[int, int]], first_only: bool) -> _Changes:
    """Count and describe the changes from `before`, CHUNK values at a time (one pass).

    A value changed when its bits did, the rule the fingerprints use: `0.0 → -0.0`
    counts (as a sign of zero), a NaN keeping its bits does not, one whose payload or
    sign changed counts (as NaN bits); neither has a magnitude. Float chunks take |Δ| by
    the fast route: `|after - before|` in the stored dtype, whose maximum is not NaN
    exactly when no NaN (or inf staying inf) is in the chunk. Other chunks and dtypes use
    only `!=`, `==`, `isnan`, `nonzero`, bit views and conversions, which every dtype has
    (float8 and uint16-64 lack `<` and `-`), and take magnitudes in float64 (complex128).
    """
    found = _Changes()
    dtype = before.dtype
    floating = dtype.is_floating_point or dtype.is_complex
    signed = dtype.is_signed and not dtype.is_complex
    screen_top = -1.0  # the largest screened |Δ| so far
    alike = False  # whether every value one step either side of screen_top prints the same
    # Temporaries reused from chunk to chunk: allocating them afresh costs as much as the math.
    scratch = torch.empty(min(CHUNK, before.numel()), dtype=dtype, device=before.device) if (
        dtype in _SCREEN) else None
    for pos, index, piece in _segments(data, spans, before.numel()):
        after = _read(data, piece).reshape(-1)  # a copy only for pieces that are not dense
        was = before[pos:pos + after.numel()]
        differ = _bits_differ(was, after)
        count = int(differ.count_nonzero())
        if not count:
            continue
        found.count += count
        _sample(found, differ, was, after, index)
        if first_only:
            return found
        if scratch is not None:
            delta = torch.sub(after, was, out=scratch[:after.numel()]).abs_()
            top = float(delta.max())
            if not math.isnan(top):  # no NaN here: a change with |Δ| 0 is a sign of zero
                found.zero_signs += count - int(delta.count_nonzero())
                if top > screen_top and top > 0 or top == screen_top and top > 0 and not alike:
                    # Rounding is monotone: the exact max is among the values at `top`, all
                    # within one step of it. Where both neighbours print alike, so does it.
                    alike = dtype == torch.float64 or _prints_alike(top, dtype)
                    exact = top if alike else _exact_max(was, after, delta == top)
                    found.screened = exact if top > screen_top or found.screened is None else max(
                        found.screened, exact)
                    screen_top = top
                if signed:
                    found.flips += _flips(was, after, no_nan=True, scratch=delta)
                continue
        numeric = differ
        if floating:
            zeros = differ & (was == 0) & (after == 0)
            nans = differ & was.isnan() & after.isnan()
            found.zero_signs += int(zeros.count_nonzero())
            found.nan_bits += int(nans.count_nonzero())
            numeric = differ & ~(zeros | nans)
        if dtype == torch.bool or not bool(numeric.any()):
            continue
        found.max_delta = _max_of(found.max_delta, _exact_max(was, after, numeric))
        if signed:
            found.flips += _flips(was, after, no_nan=not floating)
    if found.screened is not None:
        found.max_delta = _max_of(found.max_delta, found.screened)
    return found


def _sample(found: _Changes, nonzero: torch.Tensor, was: torch.Tensor, after: torch.Tensor, index: int) -> None:
    """Add the first changed values of a chunk (`nonzero` where changed) until SHOW_VALUES."""
    need = SHOW_VALUES - len(found.samples)
    if need <= 0:
        return
    size = 64  # look at a short prefix first: `nonzero` over a whole chunk is slow
    while True:
        idx = nonzero[:size].nonzero().reshape(-1)
        if idx.numel() >= need or size >= nonzero.numel():
            break
        size *= 16
    for i in idx[:need].tolist():
        found.samples.append((index + i, was[i].item(), after[i].item()))


# How to read a value's bits in Python: (struct format, bits dropped from a float32's).
_BITS = {torch.float32: ("<f", "<I", 0), torch.float16: ("<e", "<H", 0), torch.bfloat16: ("<f", "<I", 16)}


def _prints_alike(top: float, dtype: torch.dtype) -> bool:
    """Whether the values one step below and above `top` (> 0, a value of `dtype`) print the same."""
    fmt, ints, drop = _BITS[dtype]
    bits = struct.unpack(ints, struct.pack(fmt, top))[0] >> drop
    lo, hi = (struct.unpack(fmt, struct.pack(ints, b << drop))[0] for b in (bits - 1, bits + 1))
    return math.isfinite(lo) and math.isfinite(hi) and _fmt(lo) == _fmt(hi)


_GATHER = 1 << 15  # changed values taken to float64 at a time


def _exact_max(was: torch.Tensor, after: torch.Tensor, where: torch.Tensor) -> float:
    """max |after - before| over `where`, in float64 (complex128)."""
    wide = torch.complex128 if was.dtype.is_complex else torch.float64
    best: Optional[float] = None
    found = where.nonzero().reshape(-1)
    for start in range(0, found.numel(), _GATHER):
        idx = found[start:start + _GATHER]
        best = _max_of(best, float((after[idx].to(wide) - was[idx].to(wide)).abs().max().item()))
    assert best is not None, "called with no value to compare"
    return best


def _flips(was: torch.Tensor, after: torch.Tensor, no_nan: bool, scratch: Optional[torch.Tensor] = None) -> int:
    """How many values went from > 0 to < 0 or back (signed dtypes); `scratch`: a free
    tensor of `was`'s size and dtype, overwritten."""
    bits = _SIGN_BITS.get(was.dtype)
    if bits is not None and no_nan:  # screen: sign bits that differ (cheap, usually none)
        xor = torch.bitwise_xor(was.view(bits), after.view(bits),
                                out=None if scratch is None else scratch.view(bits))
        differ = int(xor.lt_(0).count_nonzero())
        if not differ:
            return 0
        if not int((was == 0).count_nonzero()) and not int((after == 0).count_nonzero()):
            return differ
    b, a = (was, after) if bits is not None else (was.double(), after.double())
    return int(((b > 0) & (a < 0)).count_nonzero() + ((b < 0) & (a > 0)).count_nonzero())


def _max_of(a: Optional[float], b: float) -> float:
    if a is None:
        return b
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _layout_changed(data: _Data, before: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    return (before.dtype != _value_dtype(data) or before.numel() > sum(j - i for i, j in spans)
            or bool(spans) and spans[-1][1] > data.view.numel())


def _start(data: _Data, spans: list[tuple[int, int]]) -> int:
    """Where a write with no change starts: the first written value, as a flat index."""
    return _to_flat(spans[0][0], data) if spans and spans[0][0] < spans[0][1] else 0


@_never_raises(lambda why: 0)
def first_change(t: torch.Tensor, before: Optional[torch.Tensor], ranges: Optional[Ranges] = None) -> int:
    """The flat index of the first value (in memory order) that differs from `before`
    (a `snapshot` of the index `ranges`); if none does, of the first written one."""
    data = _data(t)
    spans = _ranges(data, ranges)
    if before is None or _layout_changed(data, before, spans):
        return _start(data, spans)
    found = _compare(data, before, spans, first_only=True)
    return _to_flat(found.samples[0][0], data) if found.samples else _start(data, spans)


@_never_raises(_not_summarised)
def diff(t: torch.Tensor, before: Optional[torch.Tensor], ranges: Optional[Ranges] = None) -> str:
    """`3/6 elements changed, max |Δ| 0.95, 2 sign flips; [0] 0.1 → 0.005 …`.

    `before` is a `snapshot` of the index `ranges` a write could change (default: all);
    the values outside them are taken as unchanged.
    """
    return _diff_text(t, before, ranges)[1]


@_never_raises(lambda why: (0, _not_summarised(why)))
def compare(t: torch.Tensor, before: Optional[torch.Tensor], ranges: Optional[Ranges] = None) -> tuple[int, str]:
    """`first_change` and `diff` in one pass: (first changed flat index, diff text)."""
    return _diff_text(t, before, ranges)


def _diff_text(t: torch.Tensor, before: Optional[torch.Tensor], ranges: Optional[Ranges]) -> tuple[int, str]:
    data = _data(t)  # first: if `t` cannot be read, the text says why
    spans = _ranges(data, ranges)
    total = data.view.numel()
    if before is None:
        return _start(data, spans), f"values not compared ({NO_COPY})"
    if _layout_changed(data, before, spans):
        return _start(data, spans), f"layout changed: {before.numel()} copied before the write, {total} {data.noun} now"
    found = _compare(data, before, spans, first_only=False)
    written = sum(j - i for i, j in spans)
    scope = "" if before.numel() == written else (
        f" in the first {before.numel()} of the {written} written (the other"
        f" {written - before.numel()} were not compared: copying them would take over {_bytes(MAX_SNAPSHOT_BYTES)})")
    if found.count == 0:
        tail = "" if scope else ": the write stored identical values"
        return _start(data, spans), f"0/{total} {data.noun} changed{scope}{tail}"
    parts = [f"{found.count}/{total} {data.noun} changed{scope}"]
    if found.zero_signs:  # changes no |Δ| shows, said so that "changed" never reads as a mistake
        parts.append("sign of zero changed (0 ↔ -0)" if found.zero_signs == found.count else
                     f"{found.zero_signs} only in the sign of zero (0 ↔ -0)")
    if found.nan_bits:
        parts.append("NaN bits changed (payload or sign)" if found.nan_bits == found.count else
                     f"{found.nan_bits} NaN to NaN with other bits")
    if found.max_delta is not None:
        parts.append(f"max |Δ| {_fmt(found.max_delta)}")
    if before.dtype.is_signed and not before.dtype.is_complex:
        parts.append(plural(found.flips, 'sign flip'))
    samples = "   ".join(f"[{_label(i, data)}] {_fmt(b)} → {_fmt(a)}" for i, b, a in found.samples)
    more = f"   … (+{found.count - SHOW_VALUES})" if found.count > SHOW_VALUES else ""
    return _to_flat(found.samples[0][0], data), ", ".join(parts) + "; " + samples + more


def _bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} bytes"


def _label(i: int, data: _Data) -> str:
    """`0, 5, 2` for view index `i` of a tensor with a shape; `#i` into stored values."""
    flat = _to_flat(i, data)
    return ", ".join(map(str, _unravel(flat, data.tensor.shape))) if data.labelled else f"#{flat}"


def _fmt(v: object) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, complex):
        return f"{v.real:.4g}{v.imag:+.4g}j"
    return str(v)

"""Memory geometry: which bytes a tensor's elements cover, and whether two tensors' elements overlap.

Stride arithmetic on tensor metadata, exact and raising nothing: byte spans (`spans`), the runs
a strided layout makes (`runs`), exact element overlap (`elements_overlap`), the windows a write
can change and the elements of a protected tensor inside them (`write_windows`, `flat_ranges`),
elements sharing memory (`aliased_count`). Uses no private torch API itself: what it needs of
a tensor's internals (a subclass's parts, a meta tensor's storage) comes from the fence
(`kvguard._torch.tensors`). Imports torch: loaded with the protected set, when a guard is entered.
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Callable, Iterable, NamedTuple, Optional, Sequence, Union

import torch

from kvguard._torch.tensors import PLAIN, STRIDED, plain_parts, same_geometry, sparse_parts, storage_identity


class MetaStorage(NamedTuple):
    """The "device" of a meta tensor's span: its storage, where offsets stand for addresses."""

    storage: int  # the StorageImpl's address: views of one meta tensor share it


Where = Union[torch.device, MetaStorage]  # what a span's addresses are addresses in


class Span(NamedTuple):
    """The bytes a strided tensor can touch: `[start, stop)` on one device."""

    device: Where
    start: int
    stop: int
    dense: Optional[bool]  # elements tile the span exactly; None: not known yet (see `dense`)


def spans(t: torch.Tensor) -> list[Span]:
    """Byte spans of a tensor's elements; several for sparse tensors and wrapper subclasses.

    On the hot path (every write op), so it reads as little metadata as it can.
    Raises nothing: a tensor whose memory cannot be read (functional wrappers, unusual
    subclasses) has no spans and is matched by identity instead. A meta tensor has no
    memory, but its views lay out the same elements of one storage: its span is the bytes
    they would take in that storage (`meta_span`), so `m[0].add_(1)` writes `m`.
    """
    try:
        if type(t) not in PLAIN:
            parts = plain_parts(t)
            if len(parts) != 1 or parts[0] is not t:  # (`!=` on lists would compare tensors)
                return [s for part in parts for s in spans(part)]
        if t.layout != STRIDED:
            return [s for part in sparse_parts(t) for s in spans(part)]
        if t.is_meta:
            return meta_span(t)
        start = t.data_ptr()
        if start == 0:  # some empty tensors
            return []
        if type(t) not in PLAIN and start == t.storage_offset() * t.element_size():
            # A wrapper subclass (`_make_wrapper_subclass`: LoggingTensor, FakeTensor-like) has a
            # storage with no memory, and `data_ptr()` is its offset alone: not an address.
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


def meta_span(t: torch.Tensor) -> list[Span]:
    """A meta tensor's elements as a span of byte offsets into its storage ([] for none).

    (A meta tensor's `data_ptr()` is that offset too, which `runs` relies on.)
    """
    try:
        if t.numel() == 0:
            return []
        size = t.element_size()
        start = int(t.storage_offset()) * size
        reach = int(sum((n - 1) * s for n, s in zip(t.shape, t.stride())))
        contiguous = t.is_contiguous()
        return [Span(MetaStorage(storage_identity(t)), start, start + (reach + 1) * size,
                     True if contiguous else None)]
    except Exception:  # noqa: BLE001 - matched by identity instead
        return []


def dense(span: Span, t: torch.Tensor) -> bool:
    """Whether `t`'s elements tile `span` exactly (computed only on a span overlap)."""
    return span.dense if span.dense is not None else is_dense(t.shape, t.stride())


def is_dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """True when the elements tile their span with no gaps and no overlap."""
    expected = 1
    for n, s in sorted(((n, s) for n, s in zip(shape, stride) if n != 1), key=lambda p: p[1]):
        if s != expected:
            return False
        expected *= n
    return True


class Runs(NamedTuple):
    """A strided tensor's element bytes as equal runs: `start + Σ i_k·stride_k + [0, length)`.

    Dims of size 1 or stride 0 add no byte and are dropped; dims whose steps touch or
    overlap the run below them are folded into it. A dense tensor is one run,
    `logits[:, :-1, :]` two, `x[:, ::2]` one per element.
    """

    start: int  # absolute address of the first run
    length: int  # bytes per run
    dims: tuple[tuple[int, int], ...]  # (count, byte stride) of the other dims, strides ascending


def runs(t: torch.Tensor) -> Runs:
    """`t`'s bytes as runs (O(rank); `t` strided, with memory)."""
    size = t.element_size()
    dims = sorted((s * size, n) for n, s in zip(t.shape, t.stride()) if n > 1 and s != 0)
    length, i = size, 0
    while i < len(dims) and dims[i][0] <= length:  # the next copy starts inside or right after
        length += (dims[i][1] - 1) * dims[i][0]
        i += 1
    return Runs(t.data_ptr(), length, tuple((n, s) for s, n in dims[i:]))  # a meta tensor's: its offset


# Nodes the exact overlap search may visit before counting runs out window by window. Views
# made by slicing, select, transpose, split, unfold or dtype views need a handful; only
# as_strided layouts whose strides interleave with no common step can need more.
SEARCH_BUDGET = 20_000
_WINDOW = 1 << 20  # bytes per window of the enumeration fallback


def elements_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether any byte of an element of `a` is also a byte of an element of `b`.

    Exact, in O(rank) for the layouts views make: the question is whether some run of `a`
    meets some run of `b`, i.e. whether a sum of the two tensors' strides times bounded
    indices lands in one open interval (`_sum_hits`). Never enumerates elements, except
    in windows of bounded size for the rare as_strided layout the search gives up on.
    """
    (sa,), (sb,) = spans(a) or (None,), spans(b) or (None,)
    if sa is None or sb is None:
        return False
    lo, hi = max(sa.start, sb.start), min(sa.stop, sb.stop)
    if sa.device != sb.device or lo >= hi:
        return False
    if dense(sa, a) and dense(sb, b):
        return True
    ra, rb = runs(a), runs(b)
    found = runs_meet(ra, rb)
    return _runs_meet_in_windows(ra, rb, lo, hi) if found is None else found


def runs_meet(a: Runs, b: Runs, budget: int = SEARCH_BUDGET) -> Optional[bool]:
    """Whether a run of `a` shares a byte with a run of `b`; None if the search ran out of budget.

    The run of `a` at `a.start + Σ c·s` and the run of `b` at `b.start + Σ d·t` meet iff
    `V = Σ d·t - Σ c·s` lies strictly between `Δ - b.length` and `Δ + a.length`, with
    `Δ = a.start - b.start`. Dims of either tensor with the same stride become one term
    (`d - c` covers a range of integers), and a term whose stride is a multiple of a smaller
    one that steps through it is folded into that one, so common layouts become one or two terms.
    """
    ranges: dict[int, list[int]] = {}
    for n, s in a.dims:
        ranges.setdefault(s, [0, 0])[0] -= n - 1
    for n, s in b.dims:
        ranges.setdefault(s, [0, 0])[1] += n - 1
    terms: list[list[int]] = []
    for w, (low, high) in sorted(ranges.items()):
        for term in reversed(terms):
            j = w // term[0]
            if j * term[0] == w and j <= term[2] - term[1] + 1:  # w steps within term's reach
                term[1] += j * low
                term[2] += j * high
                break
        else:
            terms.append([w, low, high])
    delta = a.start - b.start
    return _sum_hits(terms, delta - b.length, delta + a.length, budget)


def _sum_hits(terms: list[list[int]], lo: int, hi: int, budget: int) -> Optional[bool]:
    """Whether some `Σ v·w` over `terms` ([w, low, high], w ascending, `v` an integer in
    [low, high]) lies strictly between `lo` and `hi`; None once `budget` nodes are spent.

    Depth-first over the largest weights. For the first k terms the sums lie in
    [rmin, rmax] with no two consecutive ones more than `gap` apart, so an interval holding
    `gap` consecutive integers of that range holds a sum; otherwise only the values of the
    k-th term that can still reach the interval are tried (one or two for nested strides).
    """
    if not terms:
        return lo < 0 < hi
    rmin: list[int] = []
    rmax: list[int] = []
    gaps: list[int] = []
    low_sum = high_sum = gap = 0
    for w, low, high in terms:
        spread = high_sum - low_sum
        gap = w if not gaps else (gap if w <= spread + gap else w - spread)
        low_sum += low * w
        high_sum += high * w
        rmin.append(low_sum)
        rmax.append(high_sum)
        gaps.append(gap)
    stack = [(len(terms) - 1, lo, hi)]
    while stack:
        k, a, b = stack.pop()
        x, y = max(a + 1, rmin[k]), min(b - 1, rmax[k])  # the integers of (a, b) in reach
        if x > y:
            continue
        if x == rmin[k] or y == rmax[k] or y - x + 1 >= gaps[k]:
            return True
        w, low, high = terms[k]
        below_min, below_max = (rmin[k - 1], rmax[k - 1]) if k else (0, 0)
        v_lo = max(low, -((below_max - x) // w))  # ceil((x - below_max) / w)
        v_hi = min(high, (y - below_min) // w)
        if k == 0:
            if v_lo <= v_hi:
                return True
            continue
        budget -= max(0, v_hi - v_lo + 1)
        if budget < 0:
            return None
        stack.extend((k - 1, a - v * w, b - v * w) for v in range(v_lo, v_hi + 1))
    return False


def _runs_meet_in_windows(a: Runs, b: Runs, lo: int, hi: int) -> bool:
    """`runs_meet` by enumeration, one `_WINDOW` of `[lo, hi)` at a time (bounded memory)."""
    for start in range(lo, hi, _WINDOW):
        stop = min(start + _WINDOW, hi)
        starts_a, starts_b = run_starts(a, start, stop), run_starts(b, start, stop)
        if starts_a.numel() == 0 or starts_b.numel() == 0:
            continue
        # For each run of b, the last run of a starting before it ends (runs of a are equal,
        # so that one reaches furthest).
        idx = torch.searchsorted(starts_a, starts_b + b.length) - 1
        if bool(((starts_a[idx.clamp(min=0)] + a.length > starts_b) & (idx >= 0)).any()):
            return True
    return False


def run_starts(r: Runs, lo: int, hi: int) -> torch.Tensor:
    """Sorted distinct starts of the runs of `r` that have a byte in `[lo, hi)`.

    Folds in the dims with the largest strides first, keeping only the index values that
    can still reach the window, so no intermediate holds runs outside it.
    """
    dims = sorted(r.dims, key=lambda d: -d[1])
    reach_after = [0] * (len(dims) + 1)
    for i in range(len(dims) - 1, -1, -1):
        n, s = dims[i]
        reach_after[i] = reach_after[i + 1] + (n - 1) * s
    offsets = torch.tensor([r.start], dtype=torch.int64)
    for i, (n, s) in enumerate(dims):
        # index j survives iff off + j*s + reach_after + length > lo and off + j*s < hi
        first = torch.div(lo - reach_after[i + 1] - r.length - offsets, s, rounding_mode="floor") + 1
        last = torch.div(hi - 1 - offsets, s, rounding_mode="floor")
        first, last = first.clamp(min=0), last.clamp(max=n - 1)
        counts = (last - first + 1).clamp(min=0)
        total = int(counts.sum())
        if total == 0:
            return offsets[:0]
        ends = counts.cumsum(0)
        step = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(ends - counts, counts)
        offsets = torch.repeat_interleave(offsets, counts) + (torch.repeat_interleave(first, counts) + step) * s
    offsets = offsets[(offsets + r.length > lo) & (offsets < hi)]
    result: torch.Tensor = torch.unique(offsets)
    return result


# A write's own runs, up to this many, each give a range of the entry's elements to copy


# before the write; a write with more runs is taken as its whole span.
MAX_WRITTEN_RUNS = 64


class WriteWindows(NamedTuple):
    """The byte windows an op's write can change, sorted, for lookups per protected tensor."""

    starts: list[int]  # window starts, ascending
    windows: list[tuple[int, int, Where]]  # (start, stop, device)
    reach: list[int]  # reach[k]: the largest stop among windows[:k + 1]


def write_windows(written: Sequence[torch.Tensor]) -> WriteWindows:
    """Byte windows covering what writing `written` can change: each written tensor's own
    runs when it has at most MAX_WRITTEN_RUNS of them, else its span. Raises nothing."""
    found: list[tuple[int, int, Where]] = []
    for w in written:
        try:
            found += _windows_of(w)
        except Exception:  # noqa: BLE001 - a guard must never crash on an unusual tensor
            continue
    found.sort(key=lambda window: window[0])
    reach, furthest = [], 0
    for _, stop, _ in found:
        furthest = max(furthest, stop)
        reach.append(furthest)
    return WriteWindows([window[0] for window in found], found, reach)


def _windows_of(w: torch.Tensor) -> list[tuple[int, int, Where]]:
    found = spans(w)
    if len(found) != 1 or w.layout != STRIDED or w.is_nested:
        return [(s.start, s.stop, s.device) for s in found]
    r = runs(w)
    if math.prod(n for n, _ in r.dims) > MAX_WRITTEN_RUNS:
        return [(found[0].start, found[0].stop, found[0].device)]
    starts = [r.start + sum(i * s for i, (_, s) in zip(idx, r.dims))
              for idx in itertools.product(*(range(n) for n, _ in r.dims))]
    return [(s, s + r.length, found[0].device) for s in starts]


def flat_ranges(t: torch.Tensor, windows: WriteWindows) -> Optional[list[tuple[int, int]]]:
    """The elements of `t` a write can change, as sorted index ranges `[i, j)`.

    Indices count `t`'s elements in memory order: row-major over `t.permute(memory_order(t))`,
    which is `t` itself unless it is transposed or permuted. None means "every element":
    `t` has no readable memory, is not a plain strided tensor, no order of its dims follows
    memory, or no window of the write meets it. O(rank · log numel) per window that meets
    `t`. Raises nothing.
    """
    try:
        if t.layout != STRIDED or t.is_nested or t.is_quantized:
            return None
        found_spans, order = spans(t), memory_order(t)
        if len(found_spans) != 1 or order is None:
            return None
        span = found_spans[0]
        size = t.element_size()
        shape = [t.shape[d] for d in order]
        strides = [t.stride(d) * size for d in order]
        found: list[tuple[int, int]] = []
        k = bisect.bisect_left(windows.starts, span.stop) - 1  # windows starting before t ends
        while k >= 0 and windows.reach[k] > span.start:
            lo, hi, device = windows.windows[k]
            if hi > span.start and device == span.device:
                i, j = _index_range(span.start, size, shape, strides, lo, hi)
                if i < j:
                    found.append((i, j))
            k -= 1
        return merge_intervals(found) or None
    except Exception:  # noqa: BLE001 - a guard must never crash on an unusual tensor
        return None


def merge_intervals(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """`[start, stop)` ranges as sorted, disjoint ones covering the same indices or bytes."""
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


MAX_ALIAS_ELEMENTS = 1 << 24  # logical elements an alias count reads at most


def shares_elements(t: torch.Tensor) -> bool:
    """Whether some of `t`'s logical elements share memory: a dim of stride 0 and size > 1
    (`expand`, `broadcast_to`). A write to one of them changes all that share it."""
    try:
        return t.layout == STRIDED and not t.is_nested and any(
            s == 0 and n > 1 for n, s in zip(t.shape, t.stride()))
    except Exception:  # noqa: BLE001 - an unusual tensor has no such dims
        return False


def aliased_count(t: torch.Tensor, written: Sequence[torch.Tensor]) -> Optional[tuple[int, int]]:
    """(logical elements of `t` a write to `written` changes, elements the write names), for a
    `t` whose elements share memory; None where it cannot be told (not one storage, too large).

    Counted exactly, on `t`'s device: an element of `t` changes when any byte of it is a byte
    of a written element. Runs only when a write hits such a tensor; it synchronises there.
    """
    try:
        if t.numel() > MAX_ALIAS_ELEMENTS or not shares_elements(t):
            return None
        base = t.untyped_storage().data_ptr()
        starts = _byte_starts(t)
        changed = torch.zeros(starts.shape, dtype=torch.bool, device=starts.device)
        named = 0
        for w in written:
            if (w.layout != STRIDED or w.is_nested or w.device != t.device
                    or w.untyped_storage().data_ptr() != base or w.numel() > MAX_ALIAS_ELEMENTS):
                continue
            size = w.element_size()
            named += w.numel()
            written_bytes = (_byte_starts(w).unsqueeze(-1) + torch.arange(size, device=t.device)).reshape(-1)
            for k in range(t.element_size()):
                changed |= torch.isin(starts + k, written_bytes)
        return (int(changed.sum()), named) if named else None
    except Exception:  # noqa: BLE001 - no count: the write is reported as a plain write
        return None


def _byte_starts(t: torch.Tensor) -> torch.Tensor:
    """Each logical element's first byte, from the start of its storage (int64, `t`'s device)."""
    size = t.element_size()
    out = torch.tensor(t.storage_offset() * size, dtype=torch.int64, device=t.device)
    for n, s in zip(t.shape, t.stride()):
        out = out.unsqueeze(-1) + torch.arange(n, dtype=torch.int64, device=t.device) * (s * size)
    return out.reshape(-1)


def memory_order(t: torch.Tensor) -> Optional[tuple[int, ...]]:
    """A permutation of `t`'s dims whose row-major order never steps back in memory.

    The identity when it already does (contiguous tensors and their slices), else the dims
    by decreasing stride (transposed, permuted, expanded); None if even that steps back,
    which only as_strided layouts with interleaved strides do.
    """
    shape, stride = t.shape, t.stride()
    identity = tuple(range(t.dim()))
    if _ascending(shape, stride, identity):
        return identity
    order = tuple(sorted(identity, key=lambda d: -stride[d]))
    return order if _ascending(shape, stride, order) else None


def _ascending(shape: Sequence[int], stride: Sequence[int], order: Sequence[int]) -> bool:
    reach = 0  # how far the dims inside the current one reach
    for d in reversed(order):
        if shape[d] > 1:
            if stride[d] < reach:
                return False
            reach += (shape[d] - 1) * stride[d]
    return True


def _index_range(ptr: int, size: int, shape: Sequence[int], strides: Sequence[int],
                 lo: int, hi: int) -> tuple[int, int]:
    """`[i, j)`: the row-major indices of the layout whose element has a byte in `[lo, hi)`.

    Addresses never decrease along the order, so both ends are found by binary search.
    """
    inner_first = list(zip(reversed(shape), reversed(strides)))

    def address(i: int) -> int:
        at = ptr
        for n, s in inner_first:
            i, c = divmod(i, n)
            at += c * s
        return at

    def first(pred: Callable[[int], bool]) -> int:
        a, b = 0, math.prod(shape)
        while a < b:
            mid = (a + b) // 2
            if pred(mid):
                b = mid
            else:
                a = mid + 1
        return a
    i = first(lambda k: address(k) + size > lo)
    j = first(lambda k: address(k) >= hi)
    return i, max(i, j)


def partial_overlap(written: Sequence[torch.Tensor], read: Sequence[torch.Tensor]) -> Optional[tuple[int, int]]:
    """(index into `written`, index into `read`) of the first pair whose elements overlap without being the
    same elements in the same order (`x.add_(x)` reads each element where it writes it: no overlap
    hazard; `x[1:].copy_(x[:-1])`, `x.index_copy_(0, i, x[::2])` read elements the op also writes
    elsewhere); None when there is none. Exact, by stride arithmetic (`elements_overlap`)."""
    for i, w in enumerate(written):
        for j, r in enumerate(read):
            try:
                if not same_geometry(w, r) and elements_overlap(w, r):
                    return i, j
            except Exception:  # noqa: BLE001 - an unusual tensor: judged as no overlap
                continue
    return None

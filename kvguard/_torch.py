"""What an op writes, and which memory a tensor covers.

The only module that touches private or version-sensitive torch APIs. Everything here is
pure: it reads schemas and tensor metadata, never tensor values.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import threading
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode  # the mode engine's base

# c10d's in-place collectives mark no argument as written (their schemas carry no alias
# annotation), so a schema-only filter drops them. These are the parameters they write.
_C10D_WRITTEN_NAMES = frozenset(
    {"tensors", "output_tensor", "output_tensors", "outputs", "output", "output_lists"}
)
# Ops that write arguments their schema does not mark as written (no `!` annotation), keyed
# by the schema's full name with its overload: which parameters they write, and the bool
# parameter that must be true for the write to happen (None: every call writes). The CPU
# rows are what `tools/sweep_undeclared_writes.py` finds over torch's OpInfo and ModuleInfo
# samples (tests/test_undeclared_writes.py pins it); the others are CUDA/ROCm/MPS kernels
# that the sweep cannot run on CPU, taken from their source.
_RUNNING_STATS = ("running_mean", "running_var")
_UNDECLARED_WRITES: dict[str, tuple[tuple[str, ...], Optional[str]]] = {
    # Found by the sweep on CPU.
    "aten::native_batch_norm": (_RUNNING_STATS, "training"),
    "aten::native_batch_norm.out": (_RUNNING_STATS, "training"),
    "aten::batch_norm_update_stats": (_RUNNING_STATS, None),
    "aten::batch_norm_update_stats.out": (_RUNNING_STATS, None),
    # LSTM/GRU backward on CPU (oneDNN) scribbles over the forward's workspace.
    "aten::mkldnn_rnn_layer_backward": (("workspace",), None),
    "aten::mkldnn_rnn_layer_backward.out": (("workspace",), None),
    # cuDNN and MIOpen batch norm (training updates the running statistics in place).
    "aten::cudnn_batch_norm": (_RUNNING_STATS, "training"),
    "aten::cudnn_batch_norm.out": (_RUNNING_STATS, "training"),
    "aten::miopen_batch_norm": (_RUNNING_STATS, "training"),
    "aten::miopen_batch_norm.out": (_RUNNING_STATS, "training"),
    # SyncBatchNorm's CUDA reduction across ranks updates them whenever they are given.
    "aten::batch_norm_gather_stats": (_RUNNING_STATS, None),
    "aten::batch_norm_gather_stats.out": (_RUNNING_STATS, None),
    "aten::batch_norm_gather_stats_with_counts": (_RUNNING_STATS, None),
    "aten::batch_norm_gather_stats_with_counts.out": (_RUNNING_STATS, None),
    # Backend copies (MPS, lazy, XLA) into `dst`; `copy_` reaches them below the mode,
    # so they are seen only when called directly.
    "aten::_copy_from": (("dst",), None),
    "aten::_copy_from.out": (("dst",), None),
    "aten::_copy_from_and_resize": (("dst",), None),
    "aten::_copy_from_and_resize.out": (("dst",), None),
}
# inplace_view ops that make a tensor refer to other memory, rather than only changing
# its shape or strides.
_REPOINTING_OPS = frozenset({"set_", "resize_", "resize_as_", "resize_as_sparse_"})


class WriteCondition(NamedTuple):
    """A bool parameter that must be true for an undeclared write to happen (`training`)."""

    position: int
    name: str
    kwarg_only: bool
    default: bool  # when the call leaves it out


class WrittenArg(NamedTuple):
    """A parameter an op writes: its position, its name, and whether it is keyword-only."""

    position: int
    name: str
    kwarg_only: bool
    when: Optional[WriteCondition] = None  # written only on calls where this is true


class OpFacts(NamedTuple):
    """What the guard needs to know about one op overload, computed once per overload."""

    written: tuple[WrittenArg, ...]
    kind: str  # "write", "metadata" (inplace_view) or "repoint" (set_, resize_)
    self_only: bool = False  # writes exactly its first positional `Tensor` argument
    resizes: bool = False  # an `out=` op: it may resize (and so write) an empty argument
    uncounted: bool = False  # writes arguments its schema does not mark: no version counter sees those
    # Indexes into `written` of the arguments it writes but returns no alias of (`rrelu_with_noise_`'s
    # noise, `_amp_update_scale_`'s growth tracker): autograd bumps the version of what an op returns
    # only, so no version counter sees these writes either. Only where every written argument is
    # one plain `Tensor`, so the indexes are those of `written_tensors`.
    unreturned: tuple[int, ...] = ()


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
    undeclared = _UNDECLARED_WRITES.get(
        f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name)
    if undeclared is not None:
        written = _add_undeclared(schema, written, *undeclared)
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
    # An aten functional op that writes an argument (`rrelu_with_noise`'s noise, batch norm's
    # running statistics) bumps no version counter: autograd's check never sees that write either.
    resizes = any(a.kwarg_only for a in written)  # `out=` arguments are keyword-only
    functional = (getattr(func, "namespace", "") == "aten" and not base_name.endswith("_") and not resizes
                  and not _INPLACE_OR_OUT_TAGS & set(getattr(func, "tags", ())))
    return OpFacts(written, kind, self_only, resizes, undeclared is not None or (functional and kind == "write"),
                   _unreturned(schema, written) if undeclared is None and kind == "write" else ())


def _unreturned(schema: Any, written: tuple[WrittenArg, ...]) -> tuple[int, ...]:
    """The indexes into `written` of the arguments no return aliases, in an op that returns some of
    the others (a mix: `rrelu_with_noise_`); () otherwise."""
    returned: set[str] = set()
    for ret in schema.returns:
        if ret.alias_info is not None:
            returned.update(ret.alias_info.before_set)
    infos = [schema.arguments[arg.position] for arg in written]
    if any(arg.when is not None for arg in written) or any(str(a.type) != "Tensor" or a.alias_info is None
                                                           for a in infos):
        return ()
    unreturned = tuple(i for i, a in enumerate(infos) if not returned & set(a.alias_info.before_set))
    return unreturned if len(unreturned) < len(written) else ()


# `Tag.inplace` is newer than torch 2.11; the name and keyword-only `out=` tell the rest.
_INPLACE_OR_OUT_TAGS = frozenset(t for t in (getattr(torch.Tag, "inplace", None), getattr(torch.Tag, "out", None))
                                 if t is not None)


def written_tensors(facts: OpFacts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op call writes, with `Tensor[]` and `Tensor[][]` lists flattened."""
    if facts.self_only:  # `mul_`, `copy_`, `index_put_`...: the common case, kept cheap
        first = args[0] if args else kwargs.get("self")
        return [first] if isinstance(first, torch.Tensor) else []
    found: list[torch.Tensor] = []
    for arg in facts.written:
        if arg.when is not None and not _holds(arg.when, args, kwargs):
            continue
        if not arg.kwarg_only and arg.position < len(args):
            _collect(args[arg.position], found)
        else:
            _collect(kwargs.get(arg.name), found)
    return found


def shared_reads(facts: OpFacts, args: Sequence[Any], kwargs: dict[str, Any],
                 written: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The tensors an op call only reads (no argument it writes) that share a storage with a tensor it
    writes: what a self-overlapping write (`data[:, 1:].copy_(data[:, :-1])`) reads. Asked on a hit only."""
    storages = {_storage_key(w) for w in written} - {None}
    if not storages:
        return ()
    positions = {a.position for a in facts.written if not a.kwarg_only}
    names = {a.name for a in facts.written}
    found: list[torch.Tensor] = []
    for i, arg in enumerate(args):
        if i not in positions:
            _collect(arg, found)
    for name, arg in kwargs.items():
        if name not in names:
            _collect(arg, found)
    return tuple(t for t in found if _storage_key(t) in storages
                 and not any(t is w or _same_geometry(t, w) for w in written))  # `add(x, 1, out=x)`: none


def _same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.stride() == b.stride()
                and a.shape == b.shape)  # a conj or neg view reads each element where it is written
    except Exception:  # noqa: BLE001
        return False


def _storage_key(t: torch.Tensor) -> Optional[tuple[Any, int]]:
    try:
        if type(t) not in PLAIN or t.layout != _STRIDED or t.is_meta:
            return None
        address = int(t.untyped_storage().data_ptr())
        return (t.device, address) if address else None
    except Exception:  # noqa: BLE001 - a tensor with no storage reads nothing it writes
        return None


def partial_overlap(written: Sequence[torch.Tensor], read: Sequence[torch.Tensor]) -> Optional[tuple[int, int]]:
    """(index into `written`, index into `read`) of the first pair whose elements overlap without being the
    same elements in the same order (`x.add_(x)` reads each element where it writes it: no overlap
    hazard; `x[1:].copy_(x[:-1])`, `x.index_copy_(0, i, x[::2])` read elements the op also writes
    elsewhere); None when there is none. Exact, by stride arithmetic (`elements_overlap`)."""
    for i, w in enumerate(written):
        for j, r in enumerate(read):
            try:
                if not _same_geometry(w, r) and elements_overlap(w, r):
                    return i, j
            except Exception:  # noqa: BLE001 - an unusual tensor: judged as no overlap
                continue
    return None


def _add_undeclared(schema: Any, written: tuple[WrittenArg, ...], names: tuple[str, ...],
                    when: Optional[str]) -> tuple[WrittenArg, ...]:
    """`written` plus the parameters `names` (see `_UNDECLARED_WRITES`), in schema order."""
    condition = None
    for i, a in enumerate(schema.arguments):
        if a.name == when:
            default = a.default_value
            condition = WriteCondition(i, a.name, a.kwarg_only, True if default is None else bool(default))
    # A torch that renamed the condition leaves `condition` None: every call counts as writing.
    known = {w.name for w in written}
    extra = tuple(WrittenArg(i, a.name, a.kwarg_only, condition)
                  for i, a in enumerate(schema.arguments) if a.name in names and a.name not in known)
    return tuple(sorted(written + extra, key=lambda w: w.position))


def _holds(condition: WriteCondition, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if not condition.kwarg_only and condition.position < len(args):
        return bool(args[condition.position])
    return bool(kwargs.get(condition.name, condition.default))


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


# Plain tensors: no subclass hooks, so their metadata and memory can be read directly.
PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold a wrapper subclass's data, or `[t]`.

    A DTensor's local shard, a jagged nested tensor's values and offsets: the memory a
    write through `w.to_local()` or `njt.values()` really touches.
    """
    if type(t) in PLAIN or not hasattr(type(t), "__tensor_flatten__"):
        return [t]
    try:
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = [getattr(t, name) for name in names]  # tensors, and for DTensor its mesh too
        return [p for x in inner if isinstance(x, torch.Tensor) for p in plain_parts(x)] or [t]
    except Exception:  # noqa: BLE001 - an odd subclass: matched by identity
        return [t]


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
        if t.layout != _STRIDED:
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


class MetaStorage(NamedTuple):
    """The "device" of a meta tensor's span: its storage, where offsets stand for addresses."""

    storage: int  # the StorageImpl's address: views of one meta tensor share it


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
        return [Span(MetaStorage(t.untyped_storage()._cdata), start, start + (reach + 1) * size,
                     True if contiguous else None)]
    except Exception:  # noqa: BLE001 - matched by identity instead
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


def sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors a sparse tensor keeps (indices and values); [] for other layouts."""
    layout = t.layout
    if layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []


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
    windows: list[tuple[int, int, Any]]  # (start, stop, device)
    reach: list[int]  # reach[k]: the largest stop among windows[:k + 1]


def write_windows(written: Sequence[torch.Tensor]) -> WriteWindows:
    """Byte windows covering what writing `written` can change: each written tensor's own
    runs when it has at most MAX_WRITTEN_RUNS of them, else its span. Raises nothing."""
    found: list[tuple[int, int, Any]] = []
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


def _windows_of(w: torch.Tensor) -> list[tuple[int, int, Any]]:
    found = spans(w)
    if len(found) != 1 or w.layout != _STRIDED or w.is_nested:
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
        if t.layout != _STRIDED or t.is_nested or t.is_quantized:
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


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph: reading a value now (a
    copy to the host, `.item()`) would break the user's capture, so a report reads none."""
    try:
        return bool(torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
                    and torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - a build without CUDA: never capturing
        return False


MAX_ALIAS_ELEMENTS = 1 << 24  # logical elements an alias count reads at most


def shares_elements(t: torch.Tensor) -> bool:
    """Whether some of `t`'s logical elements share memory: a dim of stride 0 and size > 1
    (`expand`, `broadcast_to`). A write to one of them changes all that share it."""
    try:
        return t.layout == _STRIDED and not t.is_nested and any(
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
            if (w.layout != _STRIDED or w.is_nested or w.device != t.device
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


def storage_fingerprint(t: torch.Tensor) -> tuple[Any, ...]:
    """Identity and layout facts that change when a tensor is re-pointed or swapped."""
    try:
        if t.layout != torch.strided:  # a sparse `add_` may reallocate its parts
            return (t._cdata, t.layout, tuple(t.shape), tuple(p.data_ptr() for p in sparse_parts(t)))
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


def exit_dispatch_mode(mode: Any, exc_info: tuple[Any, Any, Any]) -> None:
    """Leave `mode`, even when modes entered after it are still active.

    A guard held by a generator that is dropped while another guard is active exits
    while it is not innermost. Popping would remove someone else's mode, so the modes
    above it are lifted off, `mode` is removed, and they are put back; the flags `mode`
    saved on entry pass to the mode entered right after it, which now restores them.
    A mode on another thread's stack cannot be reached: the caller makes it inert.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if innermost_dispatch_mode() is mode:
        mode.__exit__(*exc_info)
        return
    if not any(m is mode for m in _get_current_dispatch_mode_stack()):
        return
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


# ---------------------------------------------------------------------------------------
# An inductor-compiled graph writes the inputs it mutates inside its own kernels, where no
# op is dispatched. Its artifact knows which inputs those are before it runs
# (`CompiledFxGraph.mutated_input_idxs`), and its post-grad graph says at which source
# line: while a guard is active, each call of a graph that mutates an input asks the
# listeners first. Patched on the class when inductor is imported (never imported here).

GraphListener = Callable[[Any, Sequence[Any]], Optional[Callable[[bool], None]]]  # (graph, inputs) -> after(failed)
_graph_listeners: list[GraphListener] = []
_GRAPH_MODULES = ("torch._inductor.output_code", "torch._inductor.codecache")  # where CompiledFxGraph lives, newest first


def on_compiled_graph_call(listener: GraphListener) -> Callable[[], None]:
    """Call `listener(graph, inputs)` before every call of an inductor-compiled graph that mutates
    one of its inputs; it returns what to run after (or None). Returns the undo."""
    if not _graph_listeners:
        import wrapt

        for name in _GRAPH_MODULES:
            wrapt.register_post_import_hook(_patch_compiled_graph, name)
    _graph_listeners.append(listener)

    def remove() -> None:
        if listener in _graph_listeners:
            _graph_listeners.remove(listener)
    return remove


def _patch_compiled_graph(module: Any) -> None:
    """Wrap `CompiledFxGraph.__call__` once: a graph that mutates no input, or any graph while
    no guard listens, costs one attribute read and one list test."""
    cls = getattr(module, "CompiledFxGraph", None)
    call = getattr(cls, "__call__", None)
    if cls is None or call is None or getattr(call, "_kvguard_graph", False):
        return

    def __call__(self: Any, inputs: Sequence[Any]) -> Any:
        if not _graph_listeners or not getattr(self, "mutated_input_idxs", None):
            return call(self, inputs)
        afters = [a for a in (listener(self, inputs) for listener in list(_graph_listeners)) if a is not None]
        if not afters:
            return call(self, inputs)
        try:
            out = call(self, inputs)
        except BaseException:
            for after in afters:
                after(True)
            raise
        for after in afters:
            after(False)
        return out

    __call__._kvguard_graph = True  # type: ignore[attr-defined]
    functools.update_wrapper(__call__, call)
    cls.__call__ = outside_dynamo(__call__)


WaitListener = Callable[[Optional[list[torch.Tensor]]], None]
_wait_listeners: list[WaitListener] = []


def on_work_wait(listener: WaitListener) -> Callable[[], None]:
    """Call `listener(outputs)` each time a c10d `Work.wait()` returns, on the waiting thread, with the
    tensors the collective wrote (its future's value) or None where the backend does not say. Every
    `torch.distributed` collective waits through it (a synchronous call waits before returning).
    Returns the undo; nothing is patched while no listener is left (or where torch has no c10d)."""
    work = _work_class()
    if work is None:
        return _no_undo
    if not _wait_listeners:
        original = work.__dict__["wait"]

        def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
            done = original(self, *args, **kwargs)
            try:
                outputs: Optional[list[torch.Tensor]] = [t for t in self.get_future().value()
                                                         if isinstance(t, torch.Tensor)]
            except Exception:  # noqa: BLE001 - a backend with no future: it says nothing of its outputs
                outputs = None
            for heard in list(_wait_listeners):
                heard(outputs)
            return done
        wait._kvguard_original = original  # type: ignore[attr-defined]
        work.wait = wait
    _wait_listeners.append(listener)

    def undo() -> None:
        if listener in _wait_listeners:
            _wait_listeners.remove(listener)
        if not _wait_listeners:
            ours = work.__dict__.get("wait")
            original = getattr(ours, "_kvguard_original", None)
            if original is not None:
                work.wait = original
    return undo


def _work_class() -> Any:
    try:
        import torch.distributed as dist
        return dist.Work if dist.is_available() else None
    except Exception:  # noqa: BLE001 - a torch built without distributed
        return None


def _no_undo() -> None:
    pass


def mutated_inputs(graph: Any, inputs: Sequence[Any]) -> tuple[list[int], list[Any]]:
    """The positions of the inputs the compiled graph writes, and those inputs (tensors, as
    inductor's artifact lists only tensors as mutated)."""
    positions = [i for i in graph.mutated_input_idxs if i < len(inputs)]
    return positions, [inputs[i] for i in positions]


def dynamo_generated(code: Any) -> bool:
    """Whether `code` is bytecode Dynamo wrote (a compiled function's frame, a resume function):
    its line numbers say little of where the user's code is."""
    try:
        from torch._dynamo import convert_frame
    except Exception:  # noqa: BLE001 - a torch without Dynamo
        return False
    return code in convert_frame.output_codes


def compiled_graph_text(graph: Any) -> str:
    """The post-grad FX graph the artifact was generated from, as Python source with each
    node's `# File: ..., code: ...` comment ("" where this torch keeps none). On an FX graph
    cache hit it is the text of the first compile of an equal graph: check its lines."""
    return str(getattr(graph, "inductor_post_grad_graph_str", "") or "")


# ---------------------------------------------------------------------------------------
# torch.utils.swap_tensors dispatches nothing, and refuses tensors with weak references
# (which the protected set holds). While a guard is active the function is wrapped so
# the guard can report the swap and step its weak references aside.

SwapListener = Callable[[torch.Tensor, torch.Tensor], Callable[[bool], None]]  # after(swapped)
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


# `t.data = other` dispatches nothing either (it swaps the TensorImpl's storage and
# metadata in C). While a guard is active, `torch.Tensor.data` is a property whose setter
# tells the listeners first; its getter is torch's own. Removed with the last listener.

DataListener = Callable[[torch.Tensor, torch.Tensor], Callable[[bool], None]]  # (tensor, value) -> after(assigned)
_data_listeners: list[DataListener] = []
_data_lock = threading.Lock()
_DATA = torch._C.TensorBase.__dict__["data"]  # the C getset descriptor every tensor class inherits
DATA_OP = "Tensor.data assignment"


def on_data_assignment(listener: DataListener) -> Callable[[], None]:
    """Call `listener(t, value)` before every `t.data = value`; it returns what to run after. Returns the undo."""
    with _data_lock:  # guards enter and exit on any thread: the property goes with the last listener
        if not _data_listeners:
            torch.Tensor.data = _DATA_PROPERTY  # type: ignore[assignment]
        _data_listeners.append(listener)

    def remove() -> None:
        with _data_lock:
            if listener in _data_listeners:
                _data_listeners.remove(listener)
            if not _data_listeners and torch.Tensor.__dict__.get("data") is _DATA_PROPERTY:
                del torch.Tensor.data
    return remove


def same_elements(a: torch.Tensor, b: Any) -> bool:
    """Whether `b` lays out exactly `a`'s elements (`m.to(its own device)` in `Module._apply` does
    `p.data = p`): re-pointing `a` to them changes nothing anyone reads. The same bytes in the same
    layout are the same elements, whichever storage object holds them (a numpy view of them too)."""
    try:
        return (type(b) in PLAIN and type(a) in PLAIN and a.layout == _STRIDED and b.layout == _STRIDED
                and a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr() != 0
                and a.shape == b.shape and a.stride() == b.stride())
    except Exception:  # noqa: BLE001 - judged as a re-point
        return False


def same_values(a: torch.Tensor, b: Any) -> bool:
    """Whether `b` holds `a`'s values, in `a`'s shape, dtype and device, wherever they lie
    (`m.to(memory_format=...)` in `Module._apply` does `p.data = p.contiguous(memory_format)`).
    Reads both tensors once: for the rare re-pointing of a tensor autograd saved. NaN never
    equals NaN here, so such a tensor is judged changed."""
    try:
        return (type(b) in PLAIN and type(a) in PLAIN and a.layout == _STRIDED and b.layout == _STRIDED
                and a.device == b.device and a.device.type != "meta" and a.dtype == b.dtype
                and a.shape == b.shape and not a.is_quantized and bool(torch.equal(a, b)))
    except Exception:  # noqa: BLE001 - judged as changed
        return False


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    if same_elements(self, value):
        _DATA.__set__(self, value)
        return
    afters: list[Callable[[bool], None]] = []
    assigned = False
    try:
        for listener in list(_data_listeners):
            afters.append(listener(self, value))
        _DATA.__set__(self, value)
        assigned = True
    finally:
        for after in reversed(afters):
            after(assigned)


def _delete_data(self: torch.Tensor) -> None:
    _DATA.__delete__(self)  # torch refuses: RuntimeError("Deleting tensor data is not allowed...")


_DATA_PROPERTY = property(_DATA.__get__, _set_data, _delete_data, doc=_DATA.__doc__)


def data_is_watched() -> bool:
    """Whether `t.data = ...` is seen now (a guard at level "full" is active)."""
    return torch.Tensor.__dict__.get("data") is _DATA_PROPERTY


ConversionListener = Callable[[Any, Any], Callable[[], None]]  # (module, fn) -> after
_conversion_listeners: list[ConversionListener] = []
_apply_original: Any = None
_MODULE_FILE = torch.nn.modules.module.__file__
# Module's methods whose `_apply` changes dtype or device (or shares memory), never values.
_CONVERSIONS = frozenset({"to", "cuda", "cpu", "xpu", "ipu", "mtia", "type", "float", "double", "half",
                          "bfloat16", "share_memory"})


def on_module_conversion(listener: ConversionListener) -> Callable[[], None]:
    """Call `listener(module, fn)` before each outermost `Module._apply(fn)` (`to`, `half`, `cpu`,
    `to_empty`...), and what it returns after: it re-points parameters with `p.data = ...`,
    which no dispatched op shows. Returns the undo."""
    global _apply_original
    if not _conversion_listeners:
        _apply_original = torch.nn.Module._apply
        torch.nn.Module._apply = _apply  # type: ignore[method-assign]
    _conversion_listeners.append(listener)

    def remove() -> None:
        global _apply_original
        if listener in _conversion_listeners:
            _conversion_listeners.remove(listener)
        if not _conversion_listeners and _apply_original is not None:
            torch.nn.Module._apply = _apply_original  # type: ignore[method-assign]
            _apply_original = None
    return remove


_converting = threading.local()


def updates_own_buffers(module: Any) -> bool:
    """Whether `module`'s forward (or a forward hook of torch's on it) updates its own buffers in
    training: batch norm and instance norm with running statistics, the classic spectral norm's
    `weight_u`/`weight_v`, the parametrized spectral norm's `_u`/`_v`, quantization observers."""
    classes, hook_class = _self_updating()
    if isinstance(module, classes):
        return True
    hooks = getattr(module, "_forward_pre_hooks", None) or {}
    return any(isinstance(hook, hook_class) for hook in hooks.values())


@functools.lru_cache(maxsize=None)
def _self_updating() -> tuple[tuple[type, ...], type]:
    from torch.ao.quantization import FakeQuantizeBase, ObserverBase
    from torch.nn.modules.batchnorm import _NormBase
    from torch.nn.utils.parametrizations import _SpectralNorm
    from torch.nn.utils.spectral_norm import SpectralNorm

    return (_NormBase, _SpectralNorm, ObserverBase, FakeQuantizeBase), SpectralNorm


def module_apply_kind(fn: Any) -> str:
    """What `Module._apply(fn)` does to values: "conversion" (one of Module's own dtype or device
    conversions: `to`, `half`, `cpu`...), "empty" (`to_empty`: uninitialised memory), or
    "other" (anything else: a caller's own function, whose values must be compared)."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_filename != _MODULE_FILE:
        return "other"
    parts = getattr(fn, "__qualname__", "").split(".")
    if len(parts) < 3 or parts[0] != "Module" or parts[2] != "<locals>":
        return "other"
    return "conversion" if parts[1] in _CONVERSIONS else "empty" if parts[1] == "to_empty" else "other"


def _apply(self: Any, *args: Any, **kwargs: Any) -> Any:
    original = _apply_original if _apply_original is not None else type(self)._apply
    depth = getattr(_converting, "depth", 0)
    afters: list[Callable[[], None]] = []
    if depth == 0:
        fn = args[0] if args else kwargs.get("fn")
        afters = [listener(self, fn) for listener in list(_conversion_listeners)]
    _converting.depth = depth + 1
    try:
        return original(self, *args, **kwargs)
    finally:
        _converting.depth = depth
        for after in reversed(afters):
            after()


def _swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
    afters: list[Callable[[bool], None]] = []
    swapped = False
    try:
        for listener in list(_swap_listeners):
            afters.append(listener(t1, t2))
        assert _swap_original is not None
        _swap_original(t1, t2)
        swapped = True
    finally:
        for after in reversed(afters):
            after(swapped)


# ---------------------------------------------------------------------------------------
# The dispatcher: the key the write hooks sit on, the key of their inference-mode kernels,
# and what the Python kernels ask of it. The compiled hook asks the same in C++.

HOOK_KEY = "ADInplaceOrView"
BELOW_HOOK = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.ADInplaceOrView)
# The key of the inference-mode kernels (`csrc/write_hook.cpp`, kInferenceKey): torch's
# Python enum does not name it; it sits just above FuncTorchGradWrapper.
INFERENCE_KEY_NAME = "DeferredInit"
INFERENCE_KEY = torch._C.DispatchKey(torch._C.DispatchKey.FuncTorchGradWrapper.value + 1)
BELOW_INFERENCE = torch._C._dispatch_keyset_full_after(INFERENCE_KEY)


def all_op_names() -> list[str]:
    """Every op registered with the dispatcher now, `ns::name.overload`."""
    return list(torch._C._dispatch_get_all_op_names())


def thread_includes(key: Any) -> bool:
    """Whether this thread's dispatch key set has `key` switched on."""
    return bool(torch._C._dispatch_tls_is_dispatch_key_included(key))


def set_thread_includes(key: Any, on: bool) -> None:
    torch._C._dispatch_tls_set_dispatch_key_included(key, on)


def has_fallback(key: Any) -> bool:
    """Whether someone registered a fallback kernel for every op on `key`."""
    return bool(torch._C._dispatch_has_backend_fallback(key))


def hook_kernel(func: Any, name: str) -> Any:
    """The op's own kernel on the hook key (to call it back), or None when it has none."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key(name, HOOK_KEY):
        return None
    return torch.library.get_kernel(func, HOOK_KEY)


def python_hook_kernel(name: str) -> bool:
    """Whether the op's own kernel on the hook key is Python (a `torch.library.custom_op`)."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key(name, HOOK_KEY):
        return False
    return ".py:" in str(torch._C._dispatch_get_computed_kernel_for_dispatch_key(name, HOOK_KEY))


def tensor_params(func: Any) -> list[tuple[int, str, bool]]:
    """(position, name, keyword-only) of each `Tensor` parameter of the op's schema."""
    return [(i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments) if str(a.type) == "Tensor"]


def destroy_library(library: Any) -> None:
    """Remove every kernel a `torch.library.Library` registered."""
    library._destroy()


def identity(tensor: torch.Tensor) -> int:
    """The address of the tensor's TensorImpl: the same for every Python object of one tensor."""
    return int(tensor._cdata)


def current_dispatch_modes() -> list[Any]:
    """This thread's dispatch modes, outermost first."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())


def outside_dynamo(fn: Any, callees: bool = False) -> Any:
    """`fn`, never traced by Dynamo, and run eagerly, with what it calls, from `torch.compile`d code.

    `callees=True`: only `fn`'s own frame is skipped; what it calls is compiled as if called
    from the compiled code directly (a wrapper around the user's `opt.step` stays out of its
    graphs, while the step itself is compiled as without kvguard).

    kvguard's wrappers, kernels and callbacks run inside compiled functions too, where
    Dynamo would trace them (and crash on weak references, frames, dispatch modes). The
    code object is marked for the frame evaluator to skip, recursively: no cost per call
    and no frame of torch's in between. `_torchdynamo_disable` makes Dynamo's tracer break
    the graph at a call of `fn` instead of inlining it. Without the first (another torch),
    the `torch._dynamo.disable` wrapper does both, at ~45 µs a call.
    """
    try:
        from torch._C._dynamo import eval_frame

        skip = eval_frame._FrameAction.SKIP
        inside = eval_frame._FrameAction.DEFAULT if callees else skip
        eval_frame.set_code_exec_strategy(fn.__code__, eval_frame._FrameExecStrategy(skip, inside))
    except Exception:  # noqa: BLE001 - another torch: the slow wrapper
        return getattr(torch, "_disable_dynamo")(fn, recursive=not callees)
    try:
        setattr(fn, "_torchdynamo_disable", True)
        setattr(fn, "_torchdynamo_disable_msg", "kvguard runs eagerly")
    except (AttributeError, TypeError):  # noqa: BLE001 - an object without attributes: marked code only
        pass
    return fn


def pytree() -> Any:
    """`torch.utils._pytree` (its registered nodes and key classes), or None in a torch without it."""
    try:
        import torch.utils._pytree as module
    except Exception:  # noqa: BLE001 - a torch without it: no pytree nodes
        return None
    return module


def cxx11_abi() -> int:
    """The `_GLIBCXX_USE_CXX11_ABI` torch was built with, for compiling against it."""
    return int(torch._C._GLIBCXX_USE_CXX11_ABI)


# -- autograd's saved tensors (`kvguard._protect.saved`) ------------------------------------

def top_saved_tensors_pack() -> Any:
    """The pack hook of the innermost `saved_tensors_hooks` active on this thread (None: none)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks[0] if hooks is not None else None


def saved_tensors_hooks_disabled() -> bool:
    """Whether saved-tensor hooks are refused here (inside `torch.func.grad`, `vjp`, `jacrev`, `hessian`)."""
    return not torch._C._autograd._saved_tensors_hooks_is_enabled()  # type: ignore[attr-defined]


def let_func_transforms_run(is_ours: Callable[[Any], bool], set_aside: Callable[[Any], None]) -> None:
    """`torch.func.grad`, `vjp`, `jacrev` and `hessian` refuse to run under saved-tensor hooks
    (`torch.autograd.graph.disable_saved_tensors_hooks` raises): make that context set ours
    aside for its stretch when ours are the innermost, as if no hooks were installed, and tell
    `set_aside(pack)`, so the stretch is counted as not looked at.

    Patched once for the process; with anyone else's hooks innermost it behaves as torch's.
    """
    import contextlib

    import torch.autograd.graph as graph

    original = graph.disable_saved_tensors_hooks
    if getattr(original, "_kvguard_aside", False):
        return
    autograd = torch._C._autograd

    @contextlib.contextmanager
    def disable_saved_tensors_hooks(error_message: str) -> Any:
        top = autograd._top_saved_tensors_default_hooks(False)
        if top is None or not is_ours(top[0]):
            with original(error_message):
                yield
            return
        autograd._pop_saved_tensors_default_hooks()
        set_aside(top[0])
        try:
            with original(error_message):
                yield
        finally:
            autograd._push_saved_tensors_default_hooks(*top)

    disable_saved_tensors_hooks._kvguard_aside = True  # type: ignore[attr-defined]
    disable_saved_tensors_hooks.__doc__ = original.__doc__
    graph.disable_saved_tensors_hooks = disable_saved_tensors_hooks


def compose_saved_tensors_hooks(compose: Callable[[Any, Any], Optional[tuple[Any, Any]]]) -> None:
    """Saved-tensor hooks do not nest (only the innermost pair runs): let `compose(pack, unpack)`
    replace each pair pushed from now on (`saved_tensors_hooks.__enter__`, so checkpointing,
    `save_on_cpu`, offloading), or return None to leave it as it is.

    Patched once for the process, on the one function every Python context pushes through.
    """
    autograd = torch._C._autograd
    original = autograd._push_saved_tensors_default_hooks
    if getattr(original, "_kvguard_compose", False):
        return

    def push(pack: Any, unpack: Any) -> None:
        pair = compose(pack, unpack)
        original(*(pair if pair is not None else (pack, unpack)))

    push._kvguard_compose = True  # type: ignore[attr-defined]
    push.__doc__ = original.__doc__
    autograd._push_saved_tensors_default_hooks = push  # type: ignore[assignment]


def inlineable_hook(hook: Any) -> bool:
    """Whether `torch.compile` inlines this saved-tensor hook into its graphs (an fx GraphModule)."""
    return isinstance(hook, torch.fx.GraphModule)


def view_base(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor `tensor` is a view of (None: not a view)."""
    try:
        return tensor._base if tensor._is_view() else None
    except Exception:  # noqa: BLE001 - a subclass without view tracking
        return None


def current_graph_task_id() -> int:
    """The backward pass (graph task) running on this thread; -1 outside backward."""
    return int(torch._C._current_graph_task_id())


def allowing_mutation_on_saved_tensors() -> bool:
    """Whether `torch.autograd.graph.allow_mutation_on_saved_tensors()` is active: writes to saved
    tensors are legal there (autograd keeps a copy)."""
    import torch.autograd.graph as graph

    return bool(getattr(graph, "_allow_mutation_on_saved_tensors_enabled", False))


def current_autograd_node() -> Any:
    """The backward node running now on this thread (None outside backward)."""
    return torch._C._current_autograd_node()


def node_serial(node: Any) -> Optional[int]:
    """A backward node's sequence number: which node it is, while it lives."""
    try:
        return int(node._sequence_nr())
    except Exception:  # noqa: BLE001
        return None


def saved_slots(node: Any) -> list[tuple[str, Any]]:
    """(slot, what was packed) for each tensor `node` saved for backward, read without unpacking.

    A `SavedTensor`'s `.data` is the pack hook's result when a hook packed it: reading it runs
    no unpack hook (no checkpoint recomputation, no copy back from the CPU).
    """
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = _SAVED_NAMES[type(node)] = tuple(n for n in dir(type(node)) if n.startswith("_raw_saved_"))
    found: list[tuple[str, Any]] = []
    for name in names:
        try:
            raw = getattr(node, name)
        except Exception:  # noqa: BLE001 - freed by a backward already run
            continue
        slot = "saved_tensors" if name == "_raw_saved_tensors" and isinstance(
            node, torch.autograd.function.BackwardCFunction) else name[len("_raw_saved_"):]
        for i, saved in enumerate(raw) if isinstance(raw, (list, tuple)) else ((None, raw),):
            try:
                data = saved.data
            except Exception:  # noqa: BLE001
                continue
            found.append((slot if i is None else f"{slot}[{i}]", data))
    return found


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def next_nodes(node: Any) -> list[Any]:
    """The nodes `node` feeds gradients to (its inputs' grad_fns and accumulators)."""
    try:
        return [n for n, _ in node.next_functions if n is not None]
    except Exception:  # noqa: BLE001
        return []


def shares_version_counter(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a write to `a` bumps the version counter `b` reads (views of one base share one).

    Asked by bumping `a`'s counter and setting it back: the counters end as they were.
    """
    try:
        if a.is_inference() or b.is_inference():
            return False
        before_a, before_b = a._version, b._version
        torch.autograd.graph.increment_version(a)
        try:
            return bool(b._version != before_b)
        finally:
            torch._C._autograd._unsafe_set_version_counter((a,), (before_a,))
    except Exception:  # noqa: BLE001 - a subclass without a counter
        return False


def argument_count(func: Any) -> int:
    """How many arguments the op's schema takes (`aten.relu_`: 1, `self` only); 0 when it has no schema."""
    schema = getattr(func, "_schema", None)
    return len(schema.arguments) if schema is not None else 0


def end_dataloader_workers(iterator: Any) -> None:
    """End a DataLoader iterator's worker processes as deleting it does: each worker leaves its
    loop and exits normally (its exit functions run). Nothing for an iterator without workers,
    or one shut down already."""
    shut_down = getattr(iterator, "_shutdown_workers", None)
    if callable(shut_down):
        shut_down()

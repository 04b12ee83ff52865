"""Text summaries of a tensor's values, and the diff between two versions of it.

Called only on a protected write, never on the hot path. Everything returned is a
string; the snapshot tensor lives only until the guard exits.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Concatenate, NamedTuple, Optional, ParamSpec, TypeVar

import torch

SHOW_VALUES = 4  # sample values shown in a summary or a diff
MAX_SNAPSHOT_NUMEL = 1 << 24  # larger tensors: the diff covers the first 16M elements
MAX_WHY_CHARS = 160  # of an exception's first line, in a "values not summarised" text

NO_COPY = "no copy of the values from before the write"

P = ParamSpec("P")
R = TypeVar("R")
Summary = Callable[Concatenate[torch.Tensor, P], R]

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
    """A tensor's values as a flat plain tensor, and how to name an index into it."""

    flat: torch.Tensor
    shape: Optional[torch.Size]  # for `[i, j]` indices; None: flat indices into `flat`
    noun: str  # what `flat` holds: "elements", or "stored values" of a sparse tensor


def _data(t: torch.Tensor) -> _Data:
    """The values that can be read cheaply: a DTensor's local shard, a nested or sparse
    tensor's stored values, a quantized tensor dequantized; no communication, ever."""
    dtensor = _as_dtensor(t)
    if dtensor is not None:
        t = dtensor.to_local()  # never full_tensor(): that is a collective, other ranks may not join
    t = t.detach()
    if t.is_nested:
        return _Data(t.values().reshape(-1), None, "elements")
    if t.layout == torch.sparse_coo:
        return _Data(t._values().reshape(-1), None, "stored values")
    if t.layout != torch.strided:  # compressed sparse layouts
        return _Data(t.values().reshape(-1), None, "stored values")
    if t.device.type == "meta":
        raise ValueError("a meta tensor holds no data")
    if t.is_quantized:
        t = t.dequantize()
    return _Data(t.reshape(-1), t.shape, "elements")


def _no_copy(why: str) -> Optional[torch.Tensor]:
    return None


@_never_raises(_no_copy)
def snapshot(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A detached copy of (at most the first MAX_SNAPSHOT_NUMEL of) `t`'s readable values."""
    return _data(t).flat[:MAX_SNAPSHOT_NUMEL].clone()


@_never_raises(_no_copy)
def advance(t: torch.Tensor, before: torch.Tensor) -> Optional[torch.Tensor]:
    """Move a snapshot to `t`'s current values, in place when the layout allows."""
    flat = _data(t).flat[: before.numel()]
    if flat.shape == before.shape and flat.dtype == before.dtype:
        return before.copy_(flat)
    return snapshot(t)


@_never_raises(_not_summarised)
def values(t: torch.Tensor, around: int = 0) -> str:
    """A few values from flat index `around` on: `[0.125, -0.5, 0.3, 1 … (+1020)]`."""
    flat = _data(t).flat
    start = max(0, min(around, flat.numel() - SHOW_VALUES))
    shown = ", ".join(_fmt(v) for v in flat[start:start + SHOW_VALUES].tolist())
    head = f"(+{start}) … " if start else ""
    rest = flat.numel() - start - SHOW_VALUES
    return f"[{head}{shown}{f' … (+{rest})' if rest > 0 else ''}]"


@_never_raises(lambda why: 0)
def first_change(t: torch.Tensor, before: Optional[torch.Tensor]) -> int:
    """The flat index of the first element that differs from `before` (0 if none)."""
    if before is None:
        return 0
    after = _data(t).flat[: before.numel()]
    if after.shape != before.shape or after.dtype != before.dtype:
        return 0
    idx = _changed(before, after)
    return int(idx[0]) if idx.numel() else 0


def _changed(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Flat indices where the values differ; NaN stays NaN is no change. Uses only `!=`,
    `isnan` and `nonzero`, which every dtype has (float8 and uint16-64 lack `<`, `-`)."""
    neq = before != after
    if before.dtype.is_floating_point or before.dtype.is_complex:
        neq &= ~(before.isnan() & after.isnan())
    return neq.nonzero().reshape(-1)


@_never_raises(_not_summarised)
def diff(t: torch.Tensor, before: Optional[torch.Tensor]) -> str:
    """`3/6 elements changed, max |Δ| 0.95, 2 sign flips; [0] 0.1 → 0.005 …`."""
    data = _data(t)  # first: if `t` cannot be read, the text says why
    if before is None:
        return f"values not compared ({NO_COPY})"
    after = data.flat[: before.numel()]
    total = data.flat.numel()
    if after.shape != before.shape or after.dtype != before.dtype:
        return f"layout changed: {before.numel()} → {total} {data.noun}"
    idx = _changed(before, after)
    changed = idx.numel()
    scope = "" if before.numel() == total else f" (first {before.numel()} compared)"
    if changed == 0:
        return f"0/{total} {data.noun} changed{scope}: the write stored identical values"
    parts = [f"{changed}/{total} {data.noun} changed{scope}"] + _magnitude(before[idx], after[idx])
    samples = "   ".join(
        f"[{_label(int(i), data.shape)}] {_fmt(before[i].item())} → {_fmt(after[i].item())}"
        for i in idx[:SHOW_VALUES].tolist()
    )
    more = f"   … (+{changed - SHOW_VALUES})" if changed > SHOW_VALUES else ""
    return ", ".join(parts) + "; " + samples + more


def _magnitude(before: torch.Tensor, after: torch.Tensor) -> list[str]:
    """`max |Δ| 0.95`, `2 sign flips` of the changed values, computed in float64 (or
    complex128) so that dtypes without arithmetic kernels (float8, uint16-64) get them."""
    if before.dtype == torch.bool:
        return []
    wide = torch.complex128 if before.dtype.is_complex else torch.float64
    b, a = before.to(wide), after.to(wide)
    parts = [f"max |Δ| {_fmt((a - b).abs().max().item())}"]
    if before.dtype.is_signed and not before.dtype.is_complex:
        flips = int(((b > 0) & (a < 0) | (b < 0) & (a > 0)).sum())
        parts.append(f"{flips} sign flip{'s' if flips != 1 else ''}")
    return parts


def _label(flat: int, shape: Optional[torch.Size]) -> str:
    return _index(flat, shape) if shape is not None else f"#{flat}"


def _index(flat: int, shape: torch.Size) -> str:
    coords = []
    for n in reversed(shape):
        coords.append(flat % n if n else 0)
        flat //= n if n else 1
    return ", ".join(map(str, reversed(coords))) if coords else ""


def _fmt(v: object) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, complex):
        return f"{v.real:.4g}{v.imag:+.4g}j"
    return str(v)

"""Text summaries of a tensor's values, and the diff between two versions of it.

Called only on a protected write, never on the hot path. Everything returned is a
string; the snapshot tensor lives only until the guard exits.
"""

from __future__ import annotations

from typing import Optional

import torch

SHOW_VALUES = 4  # sample values shown in a summary or a diff
MAX_SNAPSHOT_NUMEL = 1 << 24  # larger tensors: the diff covers the first 16M elements

_DTYPE_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


def describe(t: torch.Tensor) -> str:
    """`f32[4, 1024] cpu`: dtype, shape and device, DebugMode-style."""
    dtype = _DTYPE_SHORT.get(t.dtype, str(t.dtype).replace("torch.", ""))
    layout = "" if t.layout == torch.strided else f" {str(t.layout).replace('torch.', '')}"
    return f"{dtype}[{', '.join(map(str, t.shape))}] {t.device}{layout}"


def _readable(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and t.device.type != "meta"


def snapshot(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A detached copy of (at most the first MAX_SNAPSHOT_NUMEL elements of) `t`."""
    if not _readable(t):
        return None
    with torch.no_grad():
        flat = t.detach().reshape(-1)
        return flat[:MAX_SNAPSHOT_NUMEL].clone()


def advance(before: torch.Tensor, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Move a snapshot to `t`'s current values, in place when the layout allows."""
    if t is None or not _readable(t):
        return None
    with torch.no_grad():
        flat = t.detach().reshape(-1)[: before.numel()]
        if flat.shape == before.shape and flat.dtype == before.dtype:
            return before.copy_(flat)
        return snapshot(t)


def values(t: torch.Tensor, around: int = 0) -> str:
    """A few values from flat index `around` on: `[0.125, -0.5, 0.3, 1 … (+1020)]`."""
    if not _readable(t):
        return describe(t)
    flat = t.detach().reshape(-1)
    start = max(0, min(around, flat.numel() - SHOW_VALUES))
    shown = ", ".join(_fmt(v) for v in flat[start:start + SHOW_VALUES].tolist())
    head = f"(+{start}) … " if start else ""
    rest = flat.numel() - start - SHOW_VALUES
    return f"[{head}{shown}{f' … (+{rest})' if rest > 0 else ''}]"


def first_change(before: Optional[torch.Tensor], t: torch.Tensor) -> int:
    """The flat index of the first element that differs from `before` (0 if none)."""
    if before is None or not _readable(t):
        return 0
    with torch.no_grad():
        after = t.detach().reshape(-1)[: before.numel()]
        if after.shape != before.shape or after.dtype != before.dtype:
            return 0
        idx = (before != after).nonzero()
        return int(idx[0, 0]) if idx.numel() else 0


def diff(before: Optional[torch.Tensor], t: torch.Tensor) -> str:
    """`3/6 elements changed, max |Δ| 0.95, 2 sign flips; [0] 0.1 → 0.005 …`."""
    if before is None or not _readable(t):
        return "values not compared (no readable data)"
    with torch.no_grad():
        after = t.detach().reshape(-1)[: before.numel()]
        if after.shape != before.shape or after.dtype != before.dtype:
            return f"layout changed: {before.numel()} → {t.numel()} elements"
        total = t.numel()
        if before.dtype.is_floating_point or before.dtype.is_complex:
            neq = ~((before == after) | (before.isnan() & after.isnan()))
        else:
            neq = before != after
        idx = neq.nonzero().reshape(-1)
        changed = idx.numel()
        scope = "" if before.numel() == total else f" (first {before.numel()} compared)"
        if changed == 0:
            return f"0/{total} elements changed{scope}: the write stored identical values"
        parts = [f"{changed}/{total} elements changed{scope}"]
        if before.dtype != torch.bool:
            delta = (after[idx].to(torch.complex128 if before.dtype.is_complex else torch.float64)
                     - before[idx].to(torch.complex128 if before.dtype.is_complex else torch.float64)).abs()
            parts.append(f"max |Δ| {_fmt(delta.max().item())}")
        if not before.dtype.is_complex and before.dtype != torch.bool:
            flips = int(((before[idx] > 0) & (after[idx] < 0) | (before[idx] < 0) & (after[idx] > 0)).sum())
            parts.append(f"{flips} sign flip{'s' if flips != 1 else ''}")
        samples = "   ".join(
            f"[{_index(int(i), t.shape)}] {_fmt(before[i].item())} → {_fmt(after[i].item())}"
            for i in idx[:SHOW_VALUES].tolist()
        )
        more = f"   … (+{changed - SHOW_VALUES})" if changed > SHOW_VALUES else ""
        return ", ".join(parts) + "; " + samples + more


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

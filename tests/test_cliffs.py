"""Issue 8, "no cliffs on the hot path": exact overlap of strided views by stride arithmetic
(never an element list), and write reports that take one pass in bounded extra memory.

The overlap oracle here is the property test's: the set of byte addresses each tensor's
elements cover, in plain Python. The diff oracle is the whole-tensor diff kvguard computed
before the chunked one (masks and float64 over every changed element), kept here verbatim.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch

import kvguard
from kvguard._engine import diff as _diff
from kvguard._protect import geometry as _geometry

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------
# Overlap: exact on adversarial layouts


def byte_set(t: torch.Tensor) -> frozenset[int]:
    if t.numel() == 0:
        return frozenset()
    out: set[int] = set()
    size = t.element_size()
    for idx in itertools.product(*(range(n) for n in t.shape)):
        start = t.data_ptr() + sum(i * s for i, s in zip(idx, t.stride())) * size
        out.update(range(start, start + size))
    return frozenset(out)


def truth(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(byte_set(a) & byte_set(b))


BASE = torch.arange(4096, dtype=torch.float32)  # 16 KiB that every layout below views
S = BASE[:600].reshape(20, 30)
L = BASE[:2 * 8 * 16].reshape(2, 8, 16)  # a small `logits`

LAYOUTS: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
    # the case: the last row of each batch against all the other rows
    "logits-prefix-vs-last-row": lambda: (L[:, :-1, :], L[:, -1, :]),
    "logits-prefix-vs-row-5": lambda: (L[:, :-1, :], L[:, 5, :]),
    "logits-prefix-vs-column": lambda: (L[:, :-1, :], L[:, :, 3]),
    "logits-suffix-vs-first-row": lambda: (L[:, 1:, :], L[:, 0, :]),
    # interleaved column chunks and strided halves: byte spans overlap, elements do not
    "column-chunks": lambda: (S[:, :7], S[:, 7:]),
    "column-chunk-vs-its-column": lambda: (S[:, :7], S[:, 6]),
    "even-vs-odd-columns": lambda: (S[:, ::2], S[:, 1::2]),
    "even-columns-vs-column-3": lambda: (S[:, ::2], S.t()[3]),
    "even-columns-vs-column-4": lambda: (S[:, ::2], S.t()[4]),
    "every-third-row-vs-row-4": lambda: (S[1::3], S[4]),
    "every-third-row-vs-row-5": lambda: (S[1::3], S[5]),
    # transposed and permuted views
    "transposed-vs-row": lambda: (S.t(), S[3, 2:5]),
    "transposed-slice-vs-rows": lambda: (S.t()[:5], S[:, 5:9]),
    "transposed-slice-vs-next-columns": lambda: (S.t()[:5], S[:, 5:]),
    "permuted-3d": lambda: (L.permute(2, 0, 1)[::3], L.permute(1, 2, 0)[:, 1::3]),
    "permuted-3d-miss": lambda: (L.permute(2, 0, 1)[::2], L.permute(1, 2, 0)[:, 1::2]),
    # dtype views with other element sizes
    "u8-view-vs-f32-column": lambda: (S.view(torch.uint8)[:, 1::4], S[:, 0]),
    "u8-view-vs-f32-next-column": lambda: (S.view(torch.uint8)[:, 4::8], S[:, 0]),
    "f64-view-vs-odd-f32": lambda: (BASE[:64].view(torch.float64)[::2], BASE[:64][2::4]),
    "f64-view-vs-odd-f32-miss": lambda: (BASE[:64].view(torch.float64)[::2], BASE[:64][2::4][1:]),
    "complex-imag-vs-real": lambda: (torch.view_as_real(BASE[:64].view(torch.complex64))[:, 1],
                                     torch.view_as_real(BASE[:64].view(torch.complex64))[:, 0]),
    "i16-halves": lambda: (BASE[:32].view(torch.int16)[::2], BASE[:32].view(torch.int16)[1::2]),
    "u8-every-third-byte-vs-f32": lambda: (BASE[:64].view(torch.uint8)[::3], BASE[1:64:3]),
    # stride 0 (expand) and overlapping rows (unfold, as_strided)
    "expanded-column-vs-next": lambda: (S[:, 3:4].expand(20, 9), S[:, 4]),
    "expanded-column-vs-itself": lambda: (S[:, 3:4].expand(20, 9), S[7, 3]),
    "stride-0-as-strided": lambda: (torch.as_strided(BASE, (5, 4), (0, 3), 10), BASE[20:22]),
    "stride-0-as-strided-miss": lambda: (torch.as_strided(BASE, (5, 4), (0, 3), 10), BASE[20:21]),
    "overlapping-rows": lambda: (torch.as_strided(BASE, (10, 4), (2, 1), 100), BASE[121:125]),
    "overlapping-rows-miss": lambda: (torch.as_strided(BASE, (10, 4), (2, 1), 100), BASE[122:125]),
    "unfold-windows-vs-gap": lambda: (BASE[:40].unfold(0, 3, 5), BASE[3:40:5]),
    "unfold-windows-vs-gap-hit": lambda: (BASE[:40].unfold(0, 3, 5), BASE[2:40:5]),
    "interleaved-strides": lambda: (torch.as_strided(BASE, (3, 2), (2, 3), 0), BASE[1:2]),
    "interleaved-strides-hit": lambda: (torch.as_strided(BASE, (3, 2), (2, 3), 0), BASE[7:8]),
    "coprime-strides": lambda: (torch.as_strided(BASE, (20, 20, 5), (7, 11, 13), 0),
                                torch.as_strided(BASE, (9, 9), (23, 29), 5)),
    # zero-size dims and storage offsets
    "empty-slice": lambda: (S[:, 3:3], S),
    "zero-size-dim": lambda: (torch.as_strided(BASE, (0, 5), (1, 1), 3), BASE[3:8]),
    "offset-far-apart": lambda: (torch.as_strided(BASE, (4, 4), (100, 1), 1000), BASE[1104:1200]),
    "offset-adjacent": lambda: (BASE[100:200:2], BASE[199:300]),
    "offset-adjacent-hit": lambda: (BASE[100:201:2], BASE[199:300]),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_overlap_is_exact_on_adversarial_layouts(name: str) -> None:
    a, b = LAYOUTS[name]()
    want = truth(a, b)
    assert _geometry.elements_overlap(a, b) == want
    assert _geometry.elements_overlap(b, a) == want


def test_the_layouts_cover_both_answers() -> None:
    answers = [truth(*make()) for make in LAYOUTS.values()]
    assert answers.count(True) >= 12 and answers.count(False) >= 12


def _random_view(rng: random.Random, base: torch.Tensor) -> Optional[torch.Tensor]:
    """A natural view chain (slices, steps, transposes, selects, unfolds, dtype views) or
    an arbitrary as_strided layout, over the same bytes."""
    t = base.view(rng.choice([torch.float32, torch.uint8, torch.int16, torch.float64]))
    if rng.random() < 0.4:
        rank = rng.randint(0, 3)
        shape = [rng.randint(0, 6) for _ in range(rank)]
        stride = [rng.choice([0, 1, 2, 3, 5, 7, 8, 12, 30, 31]) for _ in range(rank)]
        reach = sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
        if reach >= t.numel():
            return None
        return torch.as_strided(t, shape, stride, rng.randint(0, t.numel() - 1 - reach))
    m = rng.choice([24, 48, 60])
    t = t[rng.randrange(t.numel() - m):][:m]
    t = t.view(rng.choice({24: [(2, 3, 4), (6, 4), (24,)], 48: [(4, 12), (2, 4, 6)], 60: [(5, 12), (3, 4, 5)]}[m]))
    for _ in range(rng.randint(0, 3)):
        if t.dim() == 0:
            break
        d = rng.randrange(t.dim())
        n = t.shape[d]
        op = rng.choice(["narrow", "step", "transpose", "select", "unfold"])
        if op == "narrow" and n:
            start = rng.randrange(n)
            t = t.narrow(d, start, rng.randint(0, n - start))
        elif op == "step" and n:
            t = t[(slice(None),) * d + (slice(rng.randrange(n), None, rng.randint(1, 3)),)]
        elif op == "transpose" and t.dim() > 1:
            t = t.transpose(d, (d + 1) % t.dim())
        elif op == "select" and n:
            t = t.select(d, rng.randrange(n))
        elif op == "unfold" and n > 1:
            t = t.unfold(d, rng.randint(1, n), rng.randint(1, 3))
    return t


@pytest.mark.parametrize("budget, window", [(_geometry.SEARCH_BUDGET, 1 << 20), (0, 7)],
                         ids=["search", "window-fallback"])
def test_overlap_matches_the_byte_oracle_on_random_layouts(budget: int, window: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The stride search, and the windowed enumeration it falls back on (forced here with a
    zero budget and 7-byte windows, so that runs straddle window edges)."""
    monkeypatch.setattr(_geometry, "SEARCH_BUDGET", budget)
    monkeypatch.setattr(_geometry, "_WINDOW", window)
    rng = random.Random(8)
    base = torch.zeros(1024, dtype=torch.uint8)
    checked = 0
    while checked < 1500:
        a, b = _random_view(rng, base), _random_view(rng, base)
        if a is None or b is None:
            continue
        assert _geometry.elements_overlap(a, b) == truth(a, b), (
            a.dtype, a.shape, a.stride(), a.storage_offset(), b.dtype, b.shape, b.stride(), b.storage_offset())
        checked += 1


def test_runs_fold_dense_dims_and_drop_stride_0() -> None:
    logits = torch.empty(2, 8, 16)
    assert _geometry.runs(logits[:, :-1, :]) == (logits.data_ptr(), 7 * 16 * 4, ((2, 8 * 16 * 4),))
    assert _geometry.runs(logits[:, -1, :]).dims == ((2, 8 * 16 * 4),)
    col = logits[0, :, 3:4].expand(8, 5)
    assert _geometry.runs(col) == (col.data_ptr(), 4, ((8, 64),))
    assert _geometry.runs(torch.as_strided(logits, (10, 4), (2, 1))).length == (9 * 2 + 4) * 4  # rows overlap


def test_logits_sized_overlap_is_decided_by_arithmetic_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case at LLM size (8 x 4096 x 32000 fp32 = 4 GiB of address space that is
    never touched): no enumeration, one term, a few search nodes."""
    def no_enumeration(*args: Any) -> bool:
        raise AssertionError("enumerated runs")
    monkeypatch.setattr(_geometry, "_runs_meet_in_windows", no_enumeration)
    monkeypatch.setattr(_geometry, "run_starts", no_enumeration)
    # as_strided over a small tensor's metadata only: runs() and spans() read no memory
    base = torch.empty(8 * 4096 * 32000, dtype=torch.float32, device="meta")
    shape, stride = (8, 4096, 32000), (4096 * 32000, 32000, 1)
    logits = torch.as_strided(base, shape, stride)
    prefix, last = _geometry.runs(logits[:, :-1, :]), _geometry.runs(logits[:, -1, :])
    assert len(prefix.dims) == len(last.dims) == 1
    assert _geometry.runs_meet(prefix, last, budget=4) is False
    assert _geometry.runs_meet(prefix, _geometry.runs(logits[:, 5, :]), budget=4) is True
    assert _geometry.runs_meet(prefix, _geometry.runs(logits[3, -1, 100:200]), budget=4) is False
    assert _geometry.runs_meet(prefix, _geometry.runs(logits[3, -2, 100:200]), budget=4) is True


def test_logits_overlap_in_a_guard_is_exact_and_cheap() -> None:
    logits = torch.zeros(2, 64, 512)
    with kvguard.guard({"prefix": logits[:, :-1, :]}, name="d", action="record") as g:
        logits[:, -1, :].fill_(1.0)  # the sampled token's row: not protected
        logits[1, -1, ::3].mul_(2)
    assert g.report.ok
    with kvguard.guard({"prefix": logits[:, :-1, :]}, name="d", action="record") as g:
        logits[1, 62, 7] = 3.0
    assert [e.diff for e in g.report.events] == ["1/64512 elements changed, max |Δ| 3, 0 sign flips; [1, 62, 7] 0 → 3"]


# ---------------------------------------------------------------------------------------
# Which elements a write can change: ranges in memory order


@pytest.mark.parametrize("name", LAYOUTS)
def test_flat_ranges_hold_every_element_the_write_can_change(name: str) -> None:
    protected, written = LAYOUTS[name]()
    ranges = _geometry.flat_ranges(protected, _geometry.write_windows([written]))
    order = _geometry.memory_order(protected)
    if ranges is None:  # "all": always safe
        return
    assert order is not None
    view = protected.permute(order)
    touched = byte_set(written)
    size, ptr = view.element_size(), view.data_ptr()
    for i, idx in enumerate(itertools.product(*(range(n) for n in view.shape))):
        start = ptr + sum(c * s for c, s in zip(idx, view.stride())) * size
        if touched & set(range(start, start + size)):
            assert any(lo <= i < hi for lo, hi in ranges), (i, ranges)
    assert all(0 <= lo < hi <= protected.numel() for lo, hi in ranges)


def test_flat_ranges_copy_what_was_written_not_the_span() -> None:
    def ranges(t: torch.Tensor, *written: torch.Tensor) -> Optional[list[tuple[int, int]]]:
        return _geometry.flat_ranges(t, _geometry.write_windows(written))
    logits = torch.empty(2, 64, 512)
    prefix = logits[:, :-1, :]
    assert ranges(prefix, logits[:, 5, :]) == [(5 * 512, 6 * 512), (68 * 512, 69 * 512)]
    big = torch.empty(1000, 100)
    assert ranges(big, big[900, 3]) == [(90003, 90004)]
    assert ranges(big.t(), big[7]) == [(700, 800)]  # memory order: big's rows
    assert ranges(big, big[:, 3]) == [(3, 99904)]  # 1000 runs: the span
    assert ranges(big, big[5, :2], torch.empty(3), big[1]) == [(100, 200), (500, 502)]
    assert ranges(big[10:20], big[:2], big[30:]) is None  # no window meets it: take all
    assert ranges(torch.empty(0), big) is None


# ---------------------------------------------------------------------------------------
# Diffs: the chunked pass says exactly what the whole-tensor diff said


def reference_diff(before: torch.Tensor, after: torch.Tensor, shape: torch.Size) -> str:
    """kvguard's diff before the chunked pass: masks and float64 over the whole tensor.

    A value changed when its bits did (the fingerprints' rule): `0 ↔ -0` and a NaN whose
    bits changed count, and have no magnitude.
    """
    floating = before.dtype.is_floating_point or before.dtype.is_complex
    if floating:
        real_b = torch.view_as_real(before) if before.dtype.is_complex else before.reshape(-1, 1)
        real_a = torch.view_as_real(after) if after.dtype.is_complex else after.reshape(-1, 1)
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[real_b.element_size()]
        neq = (real_b.view(ints) != real_a.view(ints)).any(-1)
        zeros = neq & (before == 0) & (after == 0)
        nans = neq & before.isnan() & after.isnan()
    else:
        neq = before != after
        zeros = nans = torch.zeros_like(neq)
    idx = neq.nonzero().reshape(-1)
    numeric = (neq & ~zeros & ~nans).nonzero().reshape(-1)
    total = before.numel()
    if idx.numel() == 0:
        return f"0/{total} elements changed: the write stored identical values"
    parts = [f"{idx.numel()}/{total} elements changed"]
    for count, every, some in ((int(zeros.sum()), "sign of zero changed (0 ↔ -0)", "only in the sign of zero (0 ↔ -0)"),
                               (int(nans.sum()), "NaN bits changed (payload or sign)", "NaN to NaN with other bits")):
        if count:
            parts.append(every if count == idx.numel() else f"{count} {some}")
    if before.dtype != torch.bool:
        wide = torch.complex128 if before.dtype.is_complex else torch.float64
        if numeric.numel():
            b, a = before[numeric].to(wide), after[numeric].to(wide)
            parts.append(f"max |Δ| {_diff._fmt((a - b).abs().max().item())}")
        b, a = before[idx].to(wide), after[idx].to(wide)
        if before.dtype.is_signed and not before.dtype.is_complex:
            flips = int(((b > 0) & (a < 0) | (b < 0) & (a > 0)).sum())
            parts.append(f"{flips} sign flip{'s' if flips != 1 else ''}")

    def label(i: int) -> str:
        return ", ".join(map(str, _diff._unravel(i, shape)))
    samples = "   ".join(f"[{label(i)}] {_diff._fmt(before[i].item())} → {_diff._fmt(after[i].item())}"
                         for i in idx[:4].tolist())
    more = f"   … (+{idx.numel() - 4})" if idx.numel() > 4 else ""
    return ", ".join(parts) + "; " + samples + more


SPECIAL = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-45, -1e-45, 65504.0, -65504.0, 3e38, -3e38]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64,
          torch.uint8, torch.uint16, torch.bool, torch.complex64, torch.float8_e4m3fn]


def random_values(dtype: torch.dtype, n: int, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if not (dtype.is_floating_point or dtype.is_complex):
        info = torch.iinfo(dtype if dtype != torch.uint16 else torch.int32)
        lo, hi = max(info.min, -200), min(info.max, 200)
        return torch.randint(0 if dtype in (torch.uint8, torch.uint16) else lo, hi, (n,), generator=g).to(dtype)
    v = torch.randn(n, generator=g, dtype=torch.float64) * 100
    picks = torch.randint(0, len(SPECIAL), (n,), generator=g)
    special = torch.rand(n, generator=g) < 0.1
    v[special] = torch.tensor(SPECIAL, dtype=torch.float64)[picks[special]]
    if dtype.is_complex:
        return torch.complex(v, v.flip(0)).to(dtype)
    return v.to(dtype)


def mutate(t: torch.Tensor, g: torch.Generator, fraction: float) -> None:
    """Overwrite a random subset of `t`'s elements (NaN over NaN, sign flips, equal values...)."""
    flat = t.reshape(-1) if t.is_contiguous() else None
    new = random_values(t.dtype, t.numel(), g).reshape(t.shape)
    mask = (torch.rand(t.shape, generator=g) < fraction)
    if t.dtype.is_floating_point and t.dtype != torch.float8_e4m3fn:
        mask |= torch.rand(t.shape, generator=g) < fraction / 4
        new = torch.where(torch.rand(t.shape, generator=g) < 0.3, -t, new)  # sign flips
    t.copy_(torch.where(mask, new, t))
    del flat


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.5, 1.0])
def test_chunked_diff_equals_the_whole_tensor_diff(dtype: torch.dtype, fraction: float,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_diff, "CHUNK", 64)  # many chunks, changes across their edges
    g = torch.Generator().manual_seed(hash((str(dtype), fraction)) % 2**31)
    t = random_values(dtype, 3 * 7 * 61, g).reshape(3, 7, 61)
    kept = t.clone()
    before = _diff.snapshot(t)
    assert before is not None and torch.equal(before.view(torch.uint8), kept.reshape(-1).view(torch.uint8))
    mutate(t, g, fraction)
    want = reference_diff(kept.reshape(-1), t.reshape(-1), t.shape)
    assert _diff.diff(t, before) == want
    first, text = _diff.compare(t, before)
    assert text == want
    changed = want.split(";", 1)[1].strip().split("]", 1)[0].lstrip("[") if ";" in want else None
    expected_first = _diff._ravel([int(c) for c in changed.split(", ")], t.shape) if changed else 0
    assert first == expected_first == _diff.first_change(t, before)


@pytest.mark.parametrize("make", [lambda t: t.t(), lambda t: t[:, ::3], lambda t: t.t()[5:40:2]],
                         ids=["transposed", "strided", "transposed-strided"])
def test_diff_of_non_contiguous_tensors(make: Callable[[torch.Tensor], torch.Tensor],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Same counts and magnitudes; samples are the first changes in memory order, labelled
    by the tensor's own indices."""
    monkeypatch.setattr(_diff, "CHUNK", 50)
    g = torch.Generator().manual_seed(3)
    base = torch.randn(60, 45, generator=g)
    t = make(base)
    kept = t.clone()
    before = _diff.snapshot(t)
    mutate(t, g, 0.3)
    want = reference_diff(kept.reshape(-1), t.reshape(-1), t.shape)
    got = _diff.diff(t, before)
    assert got.split(";")[0] == want.split(";")[0]
    for sample in got.split(";")[1].split("   ")[:4]:
        index, values = sample.strip().lstrip("[").split("] ")
        i = tuple(int(c) for c in index.split(", "))
        assert values == f"{_diff._fmt(kept[i].item())} → {_diff._fmt(t[i].item())}"


def test_max_delta_is_the_float64_one_at_a_rounding_boundary() -> None:
    """The screen in float32 rounds 1.2345000505 - 5.5e-08 up to 1.2345000505 (prints
    1.235); the float64 difference prints 1.234, as the whole-tensor diff said."""
    a = torch.tensor(1.2345, dtype=torch.float32)
    a = a if a.item() > 1.2345 else torch.nextafter(a, torch.tensor(2.0))
    b = torch.tensor(5.5e-8, dtype=torch.float32)
    assert (a - b).item() == a.item() and f"{a.item() - b.item():.4g}" == "1.234"
    t = torch.stack([b, torch.tensor(0.0), -b])
    before = _diff.snapshot(t)
    t.copy_(torch.stack([a, torch.tensor(0.5), -a]))
    assert _diff.diff(t, before).startswith("3/3 elements changed, max |Δ| 1.234, 0 sign flips")


def test_a_write_deep_in_a_big_tensor_is_found() -> None:
    """The old diff compared the first 16M elements and said a write at element 40M of 52M
    stored identical values. Now the copy is of what the write can change, wherever it is."""
    x = torch.zeros(3_000_000)
    with kvguard.guard({"x": x}, name="d", action="record") as g:
        x[2_900_000] = 7.0
        x[-2:] = torch.tensor([1.0, 2.0])
    first, last = g.report.events
    assert first.diff == "1/3000000 elements changed, max |Δ| 7, 0 sign flips; [2900000] 0 → 7"
    assert (first.before, first.after) == ("[(+2900000) … 0, 0, 0, 0 … (+99996)]",
                                           "[(+2900000) … 7, 0, 0, 0 … (+99996)]")
    assert last.diff.startswith("2/3000000 elements changed, max |Δ| 2, 0 sign flips; [2999998] 0 → 1")
    assert (last.before, last.after) == ("[(+2999996) … 0, 0, 0, 0]", "[(+2999996) … 0, 0, 1, 2]")


def test_a_write_beyond_the_copy_limit_says_what_was_not_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_diff, "MAX_SNAPSHOT_BYTES", 4096)  # 1024 fp32 values
    x = torch.zeros(5000)
    with kvguard.guard({"x": x}, name="d", action="record") as g:
        x[3000:].copy_(torch.cat([torch.zeros(1024), torch.ones(976)]))  # changes only past the copy
        x[100:3100].fill_(2.0)
    beyond, partly = (e.diff for e in g.report.events)
    assert beyond == ("0/5000 elements changed in the first 1024 of the 2000 written (the other 976 were "
                      "not compared: copying them would take over 4 KiB)")
    assert partly.startswith("1024/5000 elements changed in the first 1024 of the 3000 written (the other 1976"
                             " were not compared: copying them would take over 4 KiB), max |Δ| 2, 0 sign flips;")


def test_before_values_come_from_the_copy_inside_the_written_ranges_only() -> None:
    logits = torch.arange(2 * 6 * 5.0).reshape(2, 6, 5)
    prefix = logits[:, :-1, :]
    with kvguard.guard({"p": prefix}, name="d", action="record") as g:
        logits[1, 2, 3:].mul_(-1)  # the shown window runs on past the written elements
    (ev,) = g.report.events
    assert ev.diff == "2/50 elements changed, max |Δ| 88, 2 sign flips; [1, 2, 3] 43 → -43   [1, 2, 4] 44 → -44"
    assert (ev.before, ev.after) == ("[(+38) … 43, 44, 45, 46 … (+8)]", "[(+38) … -43, -44, 45, 46 … (+8)]")


def test_transposed_protected_tensor_reports_in_its_own_indices() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    y = base.t()
    with kvguard.guard({"y": y}, name="d", action="record") as g:
        base[1].add_(100)  # y[:, 1]
    (ev,) = g.report.events
    assert ev.diff == ("4/12 elements changed, max |Δ| 100, 0 sign flips; "
                       "[0, 1] 4 → 104   [1, 1] 5 → 105   [2, 1] 6 → 106   [3, 1] 7 → 107")
    assert (ev.before, ev.after) == ("[(+1) … 4, 8, 1, 5 … (+7)]", "[(+1) … 104, 8, 1, 105 … (+7)]")


def test_lazy_conjugate_and_negative_views_are_compared_as_values() -> None:
    c = torch.complex(torch.arange(4.0), torch.arange(4.0) + 1)
    with kvguard.guard({"im": c.conj().imag, "cc": c.conj()}, name="d", action="record") as g:
        c.imag.mul_(-2)
    diffs = {e.path: e.diff for e in g.report.events}
    assert diffs["d['im']"] == "4/4 elements changed, max |Δ| 12, 4 sign flips; [0] -1 → 2   [1] -2 → 4   [2] -3 → 6   [3] -4 → 8"
    assert diffs["d['cc']"].startswith("4/4 elements changed, max |Δ| 12; [0] 0-1j → 0+2j")


def test_every_write_is_compared_with_the_values_just_before_it() -> None:
    x = torch.zeros(10)
    with kvguard.guard({"x": x}, name="d", action="record") as g:
        x[2:4] = 1.0
        x[3:5] = 2.0
    assert [e.diff.split(";")[0] for e in g.report.events] == [
        "2/10 elements changed, max |Δ| 1, 0 sign flips", "2/10 elements changed, max |Δ| 2, 0 sign flips"]
    assert g.report.events[1].diff.endswith("[3] 1 → 2   [4] 0 → 2")


# ---------------------------------------------------------------------------------------
# Bounded memory, measured in a fresh interpreter


CHILD = """
import sys
import torch
import kvguard

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

def case(name):
    if name == "logits":  # 128 MiB of address space, never touched
        logits = torch.empty(4, 2048, 4096)
        return {"p": logits[:, :-1, :]}, lambda: logits[:, -1, :].fill_(0.0)
    if name == "logits-hit":
        logits = torch.empty(4, 2048, 4096)
        return {"p": logits[:, :-1, :]}, lambda: logits[:, 5, :].fill_(1.0)
    x = torch.zeros(4000, 4000)  # 64 MB
    if name == "one":
        return {"x": x}, lambda: x.view(-1).__setitem__(15_000_000, 1.0)
    return {"x": x.t()}, lambda: x.add_(1)  # the protected view is transposed

torch.set_num_threads(1)
warm = {"w": torch.ones(8)}
with kvguard.guard(warm, action="record"):
    warm["w"][2:5].mul_(2)
for name in sys.argv[1:]:
    d, op = case(name)
    with kvguard.guard(d, name="d", action="record") as g:
        open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the RSS now
        start = status("VmRSS:")
        op()
        extra = status("VmHWM:") - start
    print(name, extra, g.report.events[0].diff if g.report.events else "", sep="\t")
    del d, op, g
"""
CASES = ("logits", "logits-hit", "one", "all")
MiB = 1 << 20


@pytest.fixture(scope="module")
def extra_memory() -> dict[str, tuple[int, str]]:
    """Peak resident memory above the start of each op, and its diff, from one fresh interpreter."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the peak RSS")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), *CASES], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0 and "clear_refs" in proc.stderr:
        pytest.skip("cannot reset the peak RSS here")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("\t") for line in proc.stdout.strip().splitlines()]
    return {name: (int(extra), diff) for name, extra, diff in rows}


def test_logits_overlap_costs_no_memory(extra_memory: dict[str, tuple[int, str]]) -> None:
    extra, diff = extra_memory["logits"]
    assert diff == "" and extra < 4 * MiB  # the old element list took 8 bytes per element: 256 MiB


def test_a_reported_row_write_copies_the_row(extra_memory: dict[str, tuple[int, str]]) -> None:
    extra, diff = extra_memory["logits-hit"]
    assert diff.startswith("16384/33538048 elements changed") and extra < 4 * MiB


def test_one_element_written_in_a_64_mb_tensor_copies_one_element(extra_memory: dict[str, tuple[int, str]]) -> None:
    extra, diff = extra_memory["one"]
    assert diff == "1/16000000 elements changed, max |Δ| 1, 0 sign flips; [3750, 0] 0 → 1"
    assert extra < 4 * MiB


def test_a_whole_write_costs_one_copy_plus_bounded_temporaries(extra_memory: dict[str, tuple[int, str]]) -> None:
    extra, diff = extra_memory["all"]
    assert diff.startswith("16000000/16000000 elements changed, max |Δ| 1, 0 sign flips; [0, 0] 0 → 1")
    assert extra < 16_000_000 * 4 + 8 * MiB  # the copy, then a few chunk-sized temporaries

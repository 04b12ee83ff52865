"""A write's diff and the boundary fingerprint follow one rule: a value changed when its bits did.

`x.mul_(-1)` on zeros stores `-0.0`: equal as a number, different as bits, and the
fingerprint (a digest of raw bits) calls it a change, so the diff does too and says it
is the sign of zero. A NaN that keeps its bits is no change; one whose payload or sign
changed is. For every dtype, the diff's count is the number of values whose bits
changed, "identical values" is said exactly when none did, and the digests differ
exactly when the diff counts a change. Runs under every engine.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import kvguard
from kvguard._engine import diff as _diff
from kvguard._protect import digest as _digest

ENGINES = ("compiled", "kernels", "mode")
pytestmark = pytest.mark.parametrize("engine", ENGINES, indirect=True)
IDENTICAL = "the write stored identical values"


def _one_write(x: torch.Tensor, write: Any, **options: Any) -> Any:
    with kvguard.guard({"x": x}, name="rd", action="record", **options) as g:
        write(x)
    return g


def test_mul_by_minus_one_on_zeros_is_a_change_of_the_sign_of_zero() -> None:
    x = torch.zeros(3)
    (event,) = _one_write(x, lambda x: x.mul_(-1)).report.events
    assert event.diff == ("3/3 elements changed, sign of zero changed (0 ↔ -0), 0 sign flips; "
                          "[0] 0 → -0   [1] 0 → -0   [2] 0 → -0")
    assert IDENTICAL not in event.diff


def test_the_boundary_fingerprint_agrees_on_the_sign_of_zero() -> None:
    x = torch.zeros(3)
    g = _one_write(x, lambda x: x.mul_(-1), level="light")  # no op watched: only the fingerprint sees it
    assert [(e.path, e.kind) for e in g.report.events] == [("rd['x']", "unobserved")]


def test_minus_zero_back_to_zero_and_a_mix_with_real_changes() -> None:
    (back,) = _one_write(-torch.zeros(2), lambda x: x.abs_()).report.events
    assert back.diff.startswith("2/2 elements changed, sign of zero changed (0 ↔ -0)")
    (mixed,) = _one_write(torch.tensor([0.0, 1.0, 2.0]), lambda x: x.neg_()).report.events
    assert mixed.diff.startswith("3/3 elements changed, 1 only in the sign of zero (0 ↔ -0), max |Δ| 4, "
                                 "2 sign flips; [0] 0 → -0   [1] 1 → -1")


def test_nan_keeping_its_bits_is_no_change_and_a_new_payload_is_one() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    (same,) = _one_write(nan, lambda x: x.copy_(x.clone())).report.events
    assert same.diff == f"0/2 elements changed: {IDENTICAL}"
    (payload,) = _one_write(nan, lambda x: x.view(torch.int32)[0].add_(1)).report.events
    assert payload.path == "rd['x']"
    assert payload.diff.startswith("1/2 elements changed, NaN bits changed (payload or sign)")
    (sign,) = _one_write(torch.tensor([float("nan"), 1.0]), lambda x: x.neg_()).report.events
    assert sign.diff.startswith("2/2 elements changed, 1 NaN to NaN with other bits, max |Δ| 2")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.complex64,
                                   torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_the_sign_of_zero_in_every_float_dtype(dtype: torch.dtype) -> None:
    x = torch.zeros(4, dtype=dtype)
    (event,) = _one_write(x, lambda x: x.copy_(torch.full((4,), -0.0).to(dtype))).report.events
    assert event.diff.startswith("4/4 elements changed, sign of zero changed (0 ↔ -0)")


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.bool], ids=str)
def test_integers_and_bool_have_no_sign_of_zero(dtype: torch.dtype) -> None:
    (event,) = _one_write(torch.zeros(3, dtype=dtype), lambda x: x.copy_(-torch.zeros(3))).report.events
    assert event.diff == f"0/3 elements changed: {IDENTICAL}"


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
          torch.uint16, torch.uint32, torch.uint64, torch.bool]


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of `t`, one row per element (a complex value has two parts)."""
    parts = torch.view_as_real(t) if t.dtype.is_complex else t.reshape(-1, 1)
    return parts.view(_INTS[parts.element_size()]) if t.dtype != torch.bool else parts


def _random(dtype: torch.dtype, n: int, g: torch.Generator) -> torch.Tensor:
    """Random bit patterns of `dtype`: NaNs with any payload, ±0, infinities, subnormals."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    parts = 2 if dtype.is_complex else 1
    size = torch.empty(0, dtype=dtype).element_size() // parts
    ints = _INTS[size]
    info = torch.iinfo(ints)
    raw = torch.randint(info.min, info.max, (n * parts,), generator=g, dtype=torch.int64).to(ints)
    special = torch.rand(n * parts, generator=g) < 0.2
    raw[special] = 0  # zeros, whose sign the mutation below flips
    return raw.view(dtype)


def _mutate(before: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A copy where each value is kept, has its sign bit flipped (±0, NaN sign), or is random."""
    after = before.clone()
    n = before.numel()
    pick = torch.randint(0, 3, (n,), generator=g)
    if before.dtype.is_floating_point or before.dtype.is_complex:
        bits = _bits_of(after)
        sign = torch.tensor(torch.iinfo(bits.dtype).min if bits.dtype != torch.uint8 else 0x80, dtype=bits.dtype)
        bits[pick == 1, 0] ^= sign
    fresh = _random(before.dtype, n, g)
    if before.dtype == torch.bool:
        return torch.where(pick == 2, fresh, after)
    rows = (pick == 2).reshape(-1, 1)  # by bits: uint16-64 have no index_put
    return torch.where(rows, _bits_of(fresh), _bits_of(after)).view(-1).view(before.dtype).reshape(before.shape)


def _changed_count(diff: str) -> int:
    found = re.match(r"(\d+)/\d+ elements changed", diff)
    assert found is not None, diff
    return int(found.group(1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_diff_counts_exactly_the_values_whose_bits_changed_and_agrees_with_the_digest(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_diff, "CHUNK", 32)  # many chunks: the rule holds across their edges
    g = torch.Generator().manual_seed(DTYPES.index(dtype))
    for trial in range(4):
        before = _random(dtype, 200, g)
        after = _mutate(before, g) if trial else before.clone()
        expected = int((_bits_of(before) != _bits_of(after)).reshape(200, -1).any(-1).sum())
        x = before.clone()
        was = _digest.digests([x])[0]
        (event,) = _one_write(x, lambda x: x.copy_(after)).report.events
        assert _changed_count(event.diff) == expected, event.diff
        assert (IDENTICAL in event.diff) == (expected == 0)
        assert _digest.same(was, _digest.digests([x])[0]) == (expected == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64, torch.float8_e5m2], ids=str)
def test_a_write_of_identical_bits_leaves_nothing_for_the_exit_check(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    x = _random(dtype, 64, g)
    same = x.clone()
    result = _one_write(x, lambda x: x.copy_(same))
    assert [e.kind for e in result.report.events] == ["write"]
    assert IDENTICAL in result.report.events[0].diff
    light = _one_write(x, lambda x: x.copy_(same), level="light")
    assert light.report.ok  # the fingerprint saw no change either

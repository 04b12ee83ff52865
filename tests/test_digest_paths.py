"""The C digest's two stripe loops (AVX2 where the CPU has it, plain C) give the same digests,
and the digest sees what a fingerprint must: any one changed byte, moved words, moved
stripes and groups of stripes, the shape; never the memory layout."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

digest_module: Any = pytest.importorskip("kvguard._native.digest")
if not hasattr(digest_module, "_path"):  # pragma: no cover - a stale build
    pytest.skip("kvguard._native.digest predates _path()", allow_module_level=True)

PATHS = ["c"] + (["avx2"] if digest_module._path() == "avx2" else [])


def _spec(t: torch.Tensor) -> tuple[Any, ...]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes(), t.storage_offset(), t.element_size(), tuple(t.shape), tuple(t.stride()))


def _d(t: torch.Tensor) -> int:
    value: int = digest_module.digest([_spec(t)])[0]
    return value


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    before = digest_module._path()
    digest_module._path(request.param)
    try:
        yield request.param
    finally:
        digest_module._path(before)


SIZES = [0, 1, 3, 8, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1000, 4096, 10_007]


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) for n in SIZES] + [torch.randn(37, 53, generator=g).t()]


@pytest.mark.skipif(len(PATHS) < 2, reason="no AVX2 on this CPU")
def test_both_stripe_loops_agree() -> None:
    found = {}
    before = digest_module._path()
    try:
        for name in PATHS:
            digest_module._path(name)
            found[name] = [_d(t) for t in _tensors()]
    finally:
        digest_module._path(before)
    assert found["c"] == found["avx2"]


def test_one_changed_byte_anywhere_changes_it(path: str) -> None:
    t = torch.randn(1000)
    base = _d(t)
    raw = t.view(torch.uint8)
    for i in range(0, raw.numel(), 7):
        for bit in (0, 7):
            raw[i] ^= 1 << bit
            assert _d(t) != base, (i, bit)
            raw[i] ^= 1 << bit
    assert _d(t) == base


@pytest.mark.parametrize("a, b, n", [(0, 2, 2), (0, 4, 4), (0, 16, 16), (16, 32, 16), (0, 256, 16), (0, 512, 256)])
def test_moving_words_stripes_and_groups_changes_it(path: str, a: int, b: int, n: int) -> None:
    """Elements of 4 bytes: 2 a word, 16 a stripe, 256 a group of stripes between scrambles."""
    t = torch.randn(4096)
    moved = t.clone()
    moved[a:a + n], moved[b:b + n] = t[b:b + n], t[a:a + n]
    assert _d(moved) != _d(t)


def test_layout_does_not_count_and_shape_does(path: str) -> None:
    a = torch.randn(37, 53)
    assert _d(a) == _d(a.t().contiguous().t())  # the same values in another memory layout
    v = torch.randn(600)[::2]
    assert _d(v) == _d(v.clone())  # strided, gathered element by element
    row = torch.randn(3, 300)[1]
    assert _d(row) == _d(row.clone())
    flat = torch.randn(1000)
    assert len({_d(flat.view(10, 100)), _d(flat.view(100, 10)), _d(flat)}) == 3
    assert len({_d(torch.zeros(n)) for n in range(300)}) == 300  # the length counts, zeros too


def test_raw_bits_of_every_dtype(path: str) -> None:
    for t in (torch.arange(999), torch.arange(257, dtype=torch.uint8), torch.ones(100, dtype=torch.bool),
              torch.randn(33, dtype=torch.complex64), torch.full((70,), float("nan"))):
        changed = t.clone()
        changed.view(torch.uint8)[5] ^= 1
        assert _d(changed) != _d(t)
        assert _d(t.clone()) == _d(t)  # an untouched NaN is no change


def test_unknown_path_is_refused() -> None:
    with pytest.raises(ValueError, match="no stripe loop"):
        digest_module._path("sse9")

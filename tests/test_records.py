"""What the protected set records of a tensor: the compiled reading agrees with Python's.

`write_hook.describe` reads a batch of plain tensors in C++; everything else, and every
tensor where the extension is missing, is read in Python. Both must give the same spans,
density and digest, and a layout token that changes exactly when the tensor is
re-pointed or reshaped.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch

from kvguard._protect import digest as _digest
from kvguard._protect import geometry as _geometry
from kvguard._protect import records as _records
from kvguard._native import build as _build

COMPILED = _build.load()
pytestmark = pytest.mark.skipif(COMPILED is None, reason=f"no compiled extension here: {_build.reason()}")


class Tagged(torch.Tensor):  # a plain subclass: read in Python
    pass


def _views() -> list[tuple[str, Callable[[], torch.Tensor]]]:
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    return [
        ("contiguous", lambda: torch.randn(256)),
        ("zero-d", lambda: torch.tensor(3.5)),
        ("empty", lambda: torch.empty(0)),
        ("empty-2d", lambda: torch.empty(3, 0)),
        ("transposed", lambda: base.transpose(0, 2)),
        ("sliced-rows", lambda: base[:, :-1, :]),
        ("strided", lambda: base[:, ::2, 1::3]),
        ("offset", lambda: base[1:, 2]),
        ("expanded", lambda: torch.randn(3, 1).expand(3, 4)),
        ("as-strided-overlap", lambda: torch.randn(10).as_strided((4, 3), (1, 1))),
        ("bool", lambda: torch.rand(7) > 0.5),
        ("int8", lambda: torch.randint(-5, 5, (9,), dtype=torch.int8)),
        ("uint16", lambda: torch.randint(0, 9, (5,)).to(torch.uint16)),
        ("bfloat16", lambda: torch.randn(6, dtype=torch.bfloat16)),
        ("float8", lambda: torch.randn(8).to(torch.float8_e4m3fn)),
        ("complex", lambda: torch.randn(4, dtype=torch.complex64)),
        ("nan", lambda: torch.tensor([float("nan"), 1.0])),
        ("parameter", lambda: torch.nn.Parameter(torch.randn(3, 3))),
        ("requires-grad", lambda: torch.randn(4, requires_grad=True)),
        ("channels-last", lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)),
        ("subclass", lambda: torch.randn(5).as_subclass(Tagged)),
        ("sparse", lambda: torch.randn(4, 4).to_sparse()),
        ("csr", lambda: _quiet(lambda: torch.randn(4, 4).relu().to_sparse_csr())),
        ("meta", lambda: torch.empty(3, device="meta")),
        ("nested", lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged)),
        ("quantized", lambda: _quiet(lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8))),
        ("resized-away", lambda: _freed()),
    ]


def _quiet(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CSR is "in beta", quantized tensors are deprecated
        return make()


def _freed() -> torch.Tensor:
    t = torch.randn(8)
    view = t[2:]
    t.untyped_storage().resize_(0)  # the view's elements now lie outside its storage
    return view


VIEWS = _views()


def _where(spans: list[_geometry.Span]) -> list[tuple[Any, int, int]]:
    return [(s.device, s.start, s.stop) for s in spans]


@pytest.mark.parametrize("make", [m for _, m in VIEWS], ids=[n for n, _ in VIEWS])
@pytest.mark.parametrize("digest", [True, False], ids=["digest", "no-digest"])
def test_compiled_and_python_records_agree(make: Callable[[], torch.Tensor], digest: bool) -> None:
    tensor = make()  # never in an assert: torch's repr crashes on a freed storage
    (fast,) = _records.describe([tensor], digest, COMPILED)
    (slow,) = _records.describe([tensor], digest, None)
    spans = _geometry.spans(tensor)
    assert _where(_records.spans(fast)) == _where(spans) == _where(_records.spans(slow))
    # Density is decided eagerly in C++ and lazily in Python (None: "ask `dense`"); never differently.
    assert [_geometry.dense(s, tensor) for s in _records.spans(fast)] == [
        _geometry.dense(s, tensor) for s in _geometry.spans(tensor)]
    assert _digest.same(fast[_records.DIGEST], slow[_records.DIGEST])
    assert (fast[_records.DIGEST] is None) == (slow[_records.DIGEST] is None)
    if digest:
        assert _digest.same(fast[_records.DIGEST], _digest.digests([tensor])[0])
    assert fast[_records.IMPL] == slow[_records.IMPL]
    assert _records.has_memory(fast) == _records.has_memory(slow) == bool(spans)
    assert sorted(_records.intervals([fast])) == sorted(_records.intervals([slow]))


def test_a_batch_reads_each_tensor_as_alone() -> None:
    tensors = [make() for _, make in VIEWS]
    batch = _records.describe(tensors, True, COMPILED)
    alone = [_records.describe([t], True, COMPILED)[0] for t in tensors]
    for got, want in zip(batch, alone):
        assert got[:_records.DIGEST] == want[:_records.DIGEST]
        assert _digest.same(got[_records.DIGEST], want[_records.DIGEST])


REPOINTS: list[tuple[str, Callable[[torch.Tensor], Any], bool]] = [
    ("data-assign", lambda t: setattr(t, "data", torch.randn(4, 4)), True),
    ("t_", lambda t: t.t_(), True),
    ("resize_", lambda t: t.resize_(20), True),
    ("set_", lambda t: t.set_(torch.randn(16).untyped_storage(), 0, (4, 4), (4, 1)), True),
    ("as_strided_", lambda t: t.as_strided_((2, 8), (8, 1)), True),
    ("unsqueeze_", lambda t: t.unsqueeze_(0), True),
    ("mul_", lambda t: t.mul_(2), False),
    ("copy_", lambda t: t.copy_(torch.ones(4, 4)), False),
    ("read", lambda t: t.sum(), False),
]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("change, moves", [r[1:] for r in REPOINTS], ids=[r[0] for r in REPOINTS])
def test_the_layout_token_changes_exactly_when_memory_or_layout_does(
        change: Callable[[torch.Tensor], Any], moves: bool, compiled: bool) -> None:
    module = COMPILED if compiled else None
    t = torch.randn(4, 4)
    (before,) = _records.describe([t], True, module)
    change(t)
    (after,) = _records.describe([t], True, module)
    assert (before[_records.LAYOUT] != after[_records.LAYOUT]) is moves
    assert before[_records.IMPL] == after[_records.IMPL]


def test_values_change_the_digest_not_the_layout() -> None:
    t = torch.randn(64)
    (before,) = _records.describe([t], True, COMPILED)
    t[17] += 1
    (after,) = _records.describe([t], True, COMPILED)
    assert before[_records.LAYOUT] == after[_records.LAYOUT]
    assert before[_records.DIGEST] != after[_records.DIGEST]


def test_describe_refuses_bad_arguments_with_clear_errors() -> None:
    with pytest.raises(TypeError):
        COMPILED.describe((torch.ones(1),), (torch.Tensor,), True)  # a tuple, not a list
    with pytest.raises(TypeError):
        COMPILED.describe([torch.ones(1)], [torch.Tensor], True)  # types must be a tuple
    # Objects that are not tensors are left to Python (None), never read.
    assert COMPILED.describe([object(), 3, None], (torch.Tensor,), True) == [None, None, None]
    assert _records.describe([torch.ones(2)], True, COMPILED)[0][_records.DIGEST] is not None


def test_a_layout_text_reads_like_a_report() -> None:
    t = torch.randn(4, 4)
    (fast,) = _records.describe([t], False, COMPILED)
    (slow,) = _records.describe([t], False, None)
    assert _records.layout_text(fast).startswith(f"elements at {t.data_ptr():#x}..")
    assert _records.layout_text(slow) == _records.tensor_text(t) == (
        f"data_ptr {t.data_ptr():#x}, shape (4, 4), stride (4, 1), offset 0")


def test_without_the_c_digest_the_compiled_describe_leaves_digests_to_python() -> None:
    """The C digest extension may be missing (it is optional) while the compiled hook loads: its
    describe() must then leave each CPU digest to Python, not give none (found by running a
    checkout without the built extensions: a numpy write went unseen at the exit)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        sys.modules["kvguard._native.digest"] = None  # as where the optional extension did not build
        import numpy, torch, kvguard
        from kvguard._native import build
        from kvguard._protect import digest, records
        assert build.load() is not None, build.reason()
        assert digest._digest_c is None
        t = torch.zeros(2, 3)
        (record,) = records.describe([t], True, records.compiled_describe())
        assert record[records.DIGEST] is not None, record
        rd = {"l": [torch.zeros(1), t]}
        with kvguard.guard(rd, name="rd", action="record") as g:
            t.numpy()[0, 0] = 5.0  # no dispatched op: found at the exit check
        print([(e.path, e.kind) for e in g.report.events])
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "KVGUARD_ENGINE": "compiled"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[(\"rd['l'][1]\", 'unobserved')]"

"""Issue 6: kvguard never kills the job. Odd tensors (float8, uint16-64, DTensor, nested,
sparse, complex, bool, zero-element, hostile subclasses) are reported with whatever
summary can be read; the only exception a guard raises is `MutationError` under raise."""

from __future__ import annotations

import io
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

import kvguard
from kvguard._engine import diff as _diff
from kvguard._report import render as _render
from kvguard._report.events import MutationEvent
from processes import free_port

ACTIONS = ("record", "warn", "raise")
FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                      "float8_e5m2fnuz") if hasattr(torch, n)]


def quietly(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Nested and sparse CSR constructors warn that they are prototypes or beta."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


def quantized(values: list[float]) -> torch.Tensor:
    """Quantized tensors are deprecated, but jobs still hold them."""
    return quietly(lambda: torch.quantize_per_tensor(torch.tensor(values), 0.5, 0, torch.qint8))


def raw(t: torch.Tensor) -> torch.Tensor:
    """A bitwise copy of the values `t` holds, whatever its layout."""
    if t.is_nested or t.layout in (torch.sparse_csr, torch.sparse_csc):
        t = t.values()
    elif t.layout == torch.sparse_coo:
        t = t._values()
    elif hasattr(t, "to_local"):
        t = t.to_local()
    elif t.is_quantized:
        t = t.int_repr()  # viewing a quantized tensor's bytes crashes the process
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def run(action: str, protected: dict[str, torch.Tensor], write: Callable[[], Any]) -> kvguard.Guard:
    """Guard `protected`, run `write`; only MutationError (under raise) may come out."""
    g = kvguard.guard(protected, name="d", action=action)
    if action == "raise":
        with pytest.raises(kvguard.MutationError) as caught:
            with g:
                write()
        assert caught.value.event in g.report.events
    elif action == "warn":
        with pytest.warns(kvguard.MutationWarning), g:
            write()
    else:
        with g:
            write()
    return g


def only_event(g: kvguard.Guard, path: str, op: str) -> MutationEvent:
    events = [e for e in g.report.events if e.path == path and e.op == op]
    assert events, g.report.events
    g.report.format()  # a report summary never raises either
    return events[0]


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], torch.Tensor]
    write: Callable[[torch.Tensor], Any]
    op: str
    tensor: str  # how the tensor is described (a prefix)
    before: str
    after: str
    diff: str  # the diff's text (a prefix)


CASES = [
    *(Case(f"{dt}".replace("torch.", ""), lambda dt=dt: torch.tensor([1.0, -2.0, 3.0, 0.5]).to(dt),
           lambda x: x.copy_(torch.tensor([1.0, 2.0, -3.0, 0.5])), "aten.copy_.default",
           f"f8{str(dt).replace('torch.float8_', '')}[4] cpu", "[1, -2, 3, 0.5]", "[1, 2, -3, 0.5]",
           "2/4 elements changed, max |Δ| 6, 2 sign flips; [1] -2 → 2   [2] 3 → -3")
      for dt in FLOAT8),
    *(Case(f"{dt}".replace("torch.", ""), lambda dt=dt: torch.tensor([1, 2, 3, 4]).to(dt),
           lambda x: x.fill_(2), "aten.fill_.Scalar", f"u{dt.itemsize * 8}[4] cpu",
           "[1, 2, 3, 4]", "[2, 2, 2, 2]", "3/4 elements changed, max |Δ| 2; [0] 1 → 2   [2] 3 → 2")
      for dt in (torch.uint16, torch.uint32, torch.uint64)),
    Case("complex64", lambda: torch.tensor([1 + 1j, 2, 3, 4], dtype=torch.complex64),
         lambda x: x.mul_(1j), "aten.mul_.Tensor", "c64[4] cpu", "[1+1j, 2+0j, 3+0j, 4+0j]",
         "[-1+1j, 0+2j, 0+3j, 0+4j]", "4/4 elements changed, max |Δ| 5.657; [0] 1+1j → -1+1j"),
    Case("bool", lambda: torch.tensor([True, False, True]), lambda x: x.logical_not_(),
         "aten.logical_not_.default", "b8[3] cpu", "[True, False, True]", "[False, True, False]",
         "3/3 elements changed; [0] True → False"),
    Case("nested", lambda: quietly(lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])),
         lambda x: x.mul_(-2), "aten.mul_.Tensor", "f32[2, *] cpu nested", "[1, 1, 1, 1 … (+1)]",
         "[-2, -2, -2, -2 … (+1)]", "5/5 elements changed, max |Δ| 3, 5 sign flips; [#0] 1 → -2"),
    Case("jagged", lambda: quietly(lambda: torch.nested.nested_tensor(
        [torch.ones(2, 4), torch.ones(3, 4)], layout=torch.jagged)), lambda x: x.mul_(2),
         "aten.mul_.Tensor", "f32[2, j", "[1, 1, 1, 1 … (+16)]", "[2, 2, 2, 2 … (+16)]",
         "20/20 elements changed, max |Δ| 1, 0 sign flips; [#0] 1 → 2"),
    Case("sparse_coo", lambda: torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse(),
         lambda x: x.mul_(2), "aten.mul_.Tensor", "f32[2, 2] cpu sparse_coo", "[1, 2]", "[2, 4]",
         "2/2 stored values changed, max |Δ| 2, 0 sign flips; [#0] 1 → 2   [#1] 2 → 4"),
    Case("sparse_csr", lambda: quietly(lambda: torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse_csr()),
         lambda x: x.mul_(2), "aten.mul_.Tensor", "f32[2, 2] cpu sparse_csr", "[1, 2]", "[2, 4]",
         "2/2 stored values changed, max |Δ| 2, 0 sign flips; [#0] 1 → 2   [#1] 2 → 4"),
    Case("quantized", lambda: quantized([1.0, 2.0]), lambda x: x.copy_(quantized([1.0, -1.0])),
         "aten.copy_.default", "qint8[2] cpu", "[1, 2]", "[1, -1]",
         "1/2 elements changed, max |Δ| 3, 1 sign flip; [1] 2 → -1"),
]


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_odd_dtypes_and_layouts_are_reported_with_real_values(case: Case, action: str) -> None:
    x = case.make()
    kept = raw(x)
    g = run(action, {"x": x}, lambda: case.write(x))
    event = only_event(g, "d['x']", case.op)
    assert event.tensor.startswith(case.tensor)
    assert event.before == case.before
    if action == "raise":
        assert torch.equal(raw(x), kept), "raise must leave the data bitwise intact"
        assert event.blocked and event.after is None
    else:
        assert (event.after, event.diff[:len(case.diff)]) == (case.after, case.diff)


def test_uint64_beyond_int64_shows_exact_values_and_a_float_delta() -> None:
    x = torch.full((2,), 2**64 - 1, dtype=torch.uint64)
    g = run("record", {"x": x}, lambda: x.fill_(0))
    event = only_event(g, "d['x']", "aten.fill_.Scalar")
    assert event.before == "[18446744073709551615, 18446744073709551615]"
    assert event.diff.startswith("2/2 elements changed, max |Δ| 1.845e+19; [0] 18446744073709551615 → 0")


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_float8_inf_nan_and_out_of_range_values(dtype: torch.dtype) -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).to(dtype)
    g = run("record", {"x": x}, lambda: x.copy_(torch.tensor([float("inf"), float("nan"), 1e9, -1.0])))
    event = only_event(g, "d['x']", "aten.copy_.default")
    assert "nan" in str(event.after) and event.diff.startswith("4/4 elements changed, max |Δ| ")
    assert "[3] 4 → -1" in event.diff


def test_nan_to_nan_is_no_change_in_float8() -> None:
    x = torch.tensor([float("nan"), 1.0]).to(torch.float8_e5m2)
    g = run("record", {"x": x}, lambda: x[1:].fill_(2))
    assert only_event(g, "d['x']", "aten.fill_.Scalar").diff.startswith("1/2 elements changed")


# -- DTensor on a real one-process gloo mesh ---------------------------------------------


@pytest.fixture(scope="module")
def mesh() -> Iterator[Any]:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of its own")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("placement", ["Shard(0)", "Replicate()"])
def test_dtensor_writes_are_reported_from_the_local_shard(mesh: Any, placement: str, action: str) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    w = distribute_tensor(torch.tensor([1.0, -2.0, 3.0, 4.0]), mesh, [eval(placement)])
    kept = raw(w)
    g = run(action, {"w": w}, lambda: w.mul_(2))
    event = only_event(g, "d['w']", "aten.mul_.Tensor")  # more events (the local shard) are fine
    short = "S(0)" if placement.startswith("Shard") else "R"
    assert event.tensor == f"f32[4] cpu DTensor({short})"
    assert event.before == "[1, -2, 3, 4]"
    if action == "raise":
        assert torch.equal(raw(w), kept)
    else:
        assert event.after == "[2, -4, 6, 8]"
        assert event.diff.startswith("4/4 elements changed, max |Δ| 4, 0 sign flips; [0] 1 → 2")


# -- zero-element tensors ----------------------------------------------------------------


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("shape", [(0,), (2, 0, 3)], ids=str)
def test_a_zero_element_write_touches_no_bytes_and_raises_nothing(shape: tuple[int, ...], action: str) -> None:
    z = torch.ones(shape)
    with kvguard.guard({"z": z}, action=action) as g:
        z.mul_(2)
        z.fill_(1)
    assert g.report.ok  # no element, no byte written: nothing to report


def test_zero_element_metadata_changes_are_summarised() -> None:
    z = torch.ones(0, 3)
    g = run("record", {"z": z}, lambda: z.t_())
    event = only_event(g, "d['z']", "aten.t_.default")
    assert (event.before, event.after) == ("f32[0, 3] cpu", "f32[3, 0] cpu")


@pytest.mark.parametrize("t", [torch.ones(0), torch.ones(2, 0, 3), torch.ones(()), torch.ones(0).to(torch.uint16)],
                         ids=["0", "2x0x3", "scalar", "u16-0"])
def test_summaries_of_empty_and_scalar_tensors(t: torch.Tensor) -> None:
    before = _diff.snapshot(t)
    assert before is not None
    assert _diff.values(t) == ("[1]" if t.dim() == 0 else "[]")
    assert _diff.first_change(t, before) == 0
    assert "0/" in _diff.diff(t, before) and "identical" in _diff.diff(t, before)


# -- the one rule: nothing escapes a summary ---------------------------------------------


class Fussy(torch.Tensor):
    """A wrapper subclass that performs the user's `mul_` and refuses every other op."""

    wrapped: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Fussy:
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        t.wrapped = inner
        return t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        if func is torch.ops.aten.mul_.Tensor:
            args[0].wrapped.mul_(args[1])
            return args[0]
        raise RuntimeError(f"Fussy refuses {func}")


class Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("no text either")


class Element:
    """What a hostile `tolist` returns: neither `str` nor `format` works on it."""

    def __format__(self, spec: str) -> str:
        raise TypeError("no format")

    def __str__(self) -> str:
        raise TypeError("no str")


class BadList(torch.Tensor):
    def tolist(self) -> Any:
        return [Element() for _ in range(self.numel())]


class NoList(torch.Tensor):
    def tolist(self) -> Any:
        raise Unprintable()


class NoShape(torch.Tensor):
    @property
    def shape(self) -> Any:  # type: ignore[override]
        raise RuntimeError("no shape today")


@pytest.mark.parametrize("action", ACTIONS)
def test_a_subclass_that_refuses_every_summary_op_is_still_reported(action: str) -> None:
    f = Fussy(torch.ones(3))
    g = run(action, {"f": f}, lambda: f.mul_(2))
    event = only_event(g, "d['f']", "aten.mul_.Tensor")
    why = "values not summarised (float32 Fussy: RuntimeError: Fussy refuses aten."
    if action == "raise":
        assert event.before.startswith(why) and torch.equal(f.wrapped, torch.ones(3))
    else:
        assert event.before == _diff.NO_COPY
        assert str(event.after).startswith(why) and event.diff.startswith(why)
        assert torch.equal(f.wrapped, torch.full((3,), 2.0))


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("cls", [BadList, NoList])
def test_the_guard_reads_plain_values_under_a_subclass_override(cls: type, action: str) -> None:
    """Inside the mode, torch-function overrides are off: a hostile `tolist` is not called."""
    x: torch.Tensor = torch.ones(3).as_subclass(cls)
    g = run(action, {"x": x}, lambda: x.mul_(2))
    assert only_event(g, "d['x']", "aten.mul_.Tensor").before == "[1, 1, 1]"


def test_elements_that_cannot_be_formatted() -> None:
    x = torch.ones(3).as_subclass(BadList)
    assert _diff.values(x) == "values not summarised (float32 BadList: TypeError: no str)"
    assert _diff.diff(x, torch.zeros(3)).startswith("values not summarised (float32 BadList: TypeError")


def test_an_exception_without_text_is_named_by_its_type() -> None:
    assert _diff.values(torch.ones(3).as_subclass(NoList)) == "values not summarised (Unprintable)"


def test_a_tensor_that_cannot_be_described() -> None:
    x = torch.ones(3).as_subclass(NoShape)
    g = run("record", {"x": x}, lambda: x.mul_(2))
    event = only_event(g, "d['x']", "aten.mul_.Tensor")
    assert event.tensor == "tensor not described (float32 NoShape: RuntimeError: no shape today)"


@pytest.mark.parametrize("action", ACTIONS)
def test_a_meta_tensor_has_no_values_to_show(action: str) -> None:
    m = torch.ones(3, device="meta")
    g = run(action, {"m": m}, lambda: m.mul_(2))
    event = only_event(g, "d['m']", "aten.mul_.Tensor")
    shown = event.before if action == "raise" else event.after
    assert shown == "(a meta tensor holds no data)"
    assert event.diff.startswith("not applied" if action == "raise" else "values not compared: a meta tensor")


@pytest.mark.parametrize("action", ["record", "warn"])
def test_a_tensor_freed_between_the_write_and_its_summary(action: str, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.ones(3)
    with warnings.catch_warnings(record=True), kvguard.guard({"x": x}, name="d", action=action) as g:
        real, alive = g._protected.tensor_of, iter([True])  # alive for the snapshot before the op
        # The weak reference is dead once the op has run: what a free in between looks like.
        monkeypatch.setattr(g._protected, "tensor_of", lambda e: real(e) if next(alive, False) else None)
        x.mul_(2)
        monkeypatch.undo()
    event = only_event(g, "d['x']", "aten.mul_.Tensor")
    assert (event.tensor, event.before, event.after) == ("<freed>", "[1, 1, 1]", "<freed>")
    assert event.diff.startswith("values not compared (the tensor was freed")


HOSTILE: list[tuple[str, Callable[[torch.Tensor], Any]]] = [
    ("describe", lambda t: _diff.describe(t)),
    ("snapshot", lambda t: _diff.snapshot(t)),
    ("advance", lambda t: _diff.advance(t, torch.ones(3))),
    ("values", lambda t: _diff.values(t, 1)),
    ("first_change", lambda t: _diff.first_change(t, torch.ones(3))),
    ("diff", lambda t: _diff.diff(t, torch.ones(3))),
]


@pytest.mark.parametrize("name, summarise", HOSTILE, ids=[h[0] for h in HOSTILE])
@pytest.mark.parametrize("make", [lambda: Fussy(torch.ones(3)), lambda: torch.ones(3).as_subclass(NoList),
                                  lambda: torch.ones(3).as_subclass(NoShape)],
                         ids=["fussy", "nolist", "noshape"])
def test_every_summary_returns_instead_of_raising(name: str, summarise: Callable[[torch.Tensor], Any],
                                                  make: Callable[[], torch.Tensor]) -> None:
    result = summarise(make())  # the one check that matters: it returned
    assert result is None or isinstance(result, (str, int, torch.Tensor))


def test_every_public_summary_goes_through_the_one_guard_point() -> None:
    public = [v for k, v in vars(_diff).items()
              if callable(v) and not k.startswith("_") and getattr(v, "__module__", "") == _diff.__name__
              and not isinstance(v, type)]
    assert {f.__name__ for f in public} >= {"describe", "snapshot", "advance", "values", "first_change", "diff"}
    guard_point = _diff.describe.__code__  # every wrapper made by _never_raises shares it
    unguarded = [f.__name__ for f in public if f.__code__ is not guard_point or not hasattr(f, "__wrapped__")]
    assert not unguarded, f"summaries that bypass _never_raises: {unguarded}"
    assert guard_point.co_qualname.startswith("_never_raises.")


# -- printing is best effort -------------------------------------------------------------


class Broken(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def _closed() -> io.StringIO:
    stream = io.StringIO()
    stream.close()
    return stream


@pytest.mark.parametrize("stderr", [lambda: None, _closed, Broken], ids=["none", "closed", "broken-pipe"])
def test_warn_with_no_usable_stderr_still_warns_and_records(stderr: Callable[[], Optional[io.StringIO]],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.ones(4).to(torch.float8_e4m3fn)
    monkeypatch.setattr(sys, "stderr", stderr())
    g = run("warn", {"x": x}, lambda: x.fill_(2))  # float8 has no add_ on CPU: fill_ it
    assert only_event(g, "d['x']", "aten.fill_.Scalar").after == "[2, 2, 2, 2]"


@pytest.mark.parametrize("file", [_closed, Broken], ids=["closed", "broken-pipe"])
def test_print_event_to_a_dead_stream_returns_quietly(file: Callable[[], io.StringIO]) -> None:
    x = torch.ones(2)
    g = run("record", {"x": x}, lambda: x.mul_(2))
    _render.print_event(g.report.events[0], tag="rank 0/1", file=file())


def test_warn_prints_the_panel_when_stderr_works(capsys: pytest.CaptureFixture[str]) -> None:
    x = torch.ones(4).to(torch.uint16)
    run("warn", {"x": x}, lambda: x.fill_(3))
    assert "d['x'] was modified in place by aten.fill_.Scalar" in capsys.readouterr().err

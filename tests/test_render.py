"""Rendering: plain text without colour, one write per panel, under 4 KiB, rank tags."""

from __future__ import annotations

import io
from typing import Any

import pytest

from kvguard import _ranks

from kvguard._report import events as _events

from kvguard._report import render as _render
from kvguard._report.events import GuardReport, MutationEvent


def event(**changes: Any) -> MutationEvent:
    fields: dict[str, Any] = dict(
        path="rollout_data['kl'][0]", op="aten.mul_.Tensor", kind="write", blocked=False,
        filename="/src/loss.py", lineno=212, code="k *= kl_coef", function="compute",
        placed_at="loss.py:201", tensor="f32[1024] cpu", before="[0.125, -0.5 … (+1022)]",
        after="[0.00625, -0.025 … (+1022)]", diff="1024/1024 elements changed, max |Δ| 0.95")
    fields.update(changes)
    return MutationEvent(**fields)


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def test_plain_text_first_line_is_one_sentence() -> None:
    text = _events.format_event(event())
    assert text.splitlines()[0] == "rollout_data['kl'][0] was modified in place by aten.mul_.Tensor at loss.py:212"
    assert "  placed   loss.py:201" in text and "\x1b" not in text


def test_blocked_event_says_the_data_is_intact() -> None:
    text = _events.format_event(event(blocked=True, after=None))
    assert text.startswith("rollout_data['kl'][0] would be modified in place")
    assert "raised before the write; the data is intact" in text and "after" not in text


@pytest.mark.parametrize("big", ["code", "diff", "before", "path"])
def test_a_panel_is_one_write_under_4_kib(big: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    stream = CountingStream()
    _render.print_event(event(**{big: "x[1] " * 5000}), tag="rank 3/8", file=stream)
    assert stream.writes == 1
    assert len(stream.getvalue().encode()) < 4096


def test_user_code_is_not_rich_markup() -> None:
    stream = CountingStream()
    _render.print_event(event(code='k *= c  # rollout_data["kl"][i] [bold]x[/bold]'), file=stream)
    assert 'rollout_data["kl"][i] [bold]x[/bold]' in stream.getvalue()


def test_rank_tag_from_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert _ranks.rank_tag() == ""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert _ranks.rank_tag() == "rank 3/8"
    undo = _ranks.register_tagger(lambda: {"tp": 1, "pp": 0})
    try:
        assert _ranks.rank_tag() == "rank 3/8 tp=1 pp=0"
    finally:
        undo()


def test_a_failing_tagger_never_breaks_a_report(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    undo = _ranks.register_tagger(lambda: 1 / 0)  # type: ignore[arg-type,return-value]
    try:
        assert _ranks.rank_tag().startswith("rank 0")
    finally:
        undo()


def test_report_format_and_rich_rendering() -> None:
    report = GuardReport(name="rd", action="record", events=[event(), event(lineno=213)])
    assert report.format().count("was modified in place") == 2
    from rich.console import Console

    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(report)
    assert "kvguard: in-place write" in console.file.getvalue()  # type: ignore[attr-defined]
    assert GuardReport(name="rd", action="raise").format() == (
        "kvguard: no in-place writes to the tensors protected in rd")

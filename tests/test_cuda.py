"""What the first GPU run (an H200, torch 2.11, 2026-12-04) found, kept true.

A protected write while a CUDA graph is being captured was reported by reading values
(a snapshot copy, `.tolist()`): under `record` that broke the user's capture ("operation
failed due to a previous error during capture") and left the device's generator in a
state where every later capture failed. A report during capture now reads no value.
The CPU tests stand in a capturing stream; the others need a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvguard
from kvguard._engine import diff as _diff
from kvguard._engine import judge as _judge
from kvguard._torch import tensors as _tensors

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream that is capturing: reading a value now would break the capture, so any read fails the test."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a value was read while a CUDA graph was being captured")

    monkeypatch.setattr(_tensors, "capturing", lambda: True)
    for name in ("snapshot", "values", "compare"):
        monkeypatch.setattr(_diff, name, refuse)


def test_capturing_is_false_without_a_capture() -> None:
    assert _tensors.capturing() is False


def test_a_write_during_capture_is_reported_without_reading_a_value(capturing: None) -> None:
    data = {"x": torch.ones(4)}
    with kvguard.guard(data, name="d", action="record", fingerprint=False) as g:
        data["x"].mul_(2)
    (event,) = g.report.events
    assert (event.path, event.kind, event.before, event.after, event.diff) == (
        "d['x']", "write", _judge.CAPTURE_VALUES, _judge.CAPTURE_VALUES, _judge.CAPTURE_DIFF)


def test_raise_stops_it_without_reading_a_value(capturing: None) -> None:
    data = {"x": torch.ones(4)}
    with pytest.raises(kvguard.MutationError) as caught:
        with kvguard.guard(data, name="d", action="raise", fingerprint=False):
            data["x"].mul_(2)
    assert caught.value.event.before == _judge.CAPTURE_VALUES and torch.equal(data["x"], torch.ones(4))


def test_a_write_through_shared_elements_during_capture_is_not_counted(capturing: None) -> None:
    data = {"a": torch.ones(2, 1).expand(2, 3)}
    with kvguard.guard(data, name="d", action="record", fingerprint=False) as g:
        data["a"][0, 0:1] = 5.0
    assert [e.kind for e in g.report.events] == ["write"]  # counting would read the device back


@cuda
def test_capture_and_replay_inside_a_guard_with_a_protected_write() -> None:
    data = {"x": torch.randn(1024, device="cuda")}
    side = torch.cuda.Stream()
    with kvguard.guard(data, name="d", action="record") as g:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            data["x"].mul_(1.0)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            data["x"].mul_(2.0)
        before = data["x"].clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(data["x"], before * 2)
    assert _judge.CAPTURE_DIFF in [e.diff for e in g.report.events]
    assert any(e.kind == "unobserved" for e in g.report.events)  # the replay's change, at the exit


@cuda
# The write was stopped before it ran, so the capture holds nothing: torch says so.
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_raise_during_capture_leaves_the_device_able_to_capture() -> None:
    data = {"x": torch.randn(16, device="cuda")}
    kept = data["x"].clone()
    with pytest.raises(kvguard.MutationError):
        with kvguard.guard(data, name="d", action="raise"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                data["x"].mul_(2.0)
    y = torch.zeros(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.add_(1)
    graph.replay()
    assert float(y.sum()) == 8.0 and torch.equal(data["x"], kept)

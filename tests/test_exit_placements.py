"""The guard's exit reads each protected byte once: a tensor first seen there is counted, not digested.

At the exit (not at `g.check()`, not at a guarded generator's pause) the protected set closes
after the check, so a tensor placed since the last look has nothing to be compared with: it
is counted and its top-level key noted, and the containers are not walked again. These tests
pin that what the exit reports, counts and lets go is what a full walk there gave.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch

import kvguard


def _guarded(body: Callable[[dict[str, Any]], None], **options: Any) -> Any:
    d: dict[str, Any] = {"a": [torch.ones(4) for _ in range(3)], "b": torch.zeros(3)}
    with kvguard.guard(d, name="d", action=options.pop("action", "record"), **options) as g:
        body(d)
    return g


def test_tensors_placed_and_first_seen_at_exit_are_counted_once() -> None:
    def body(d: dict[str, Any]) -> None:
        t = torch.ones(3)
        d["kl"] = [torch.ones(2) for _ in range(4)]
        d["x"] = t
        d["y"] = [t, t, d["b"]]  # placed twice, and a tensor protected already

    g = _guarded(body)
    assert g.report.events == []
    assert g.protected_count == 4 + 4 + 1  # entry's 4, kl's 4, t once
    assert {"a", "b", "kl", "x", "y"} <= set(g.keys_seen)


def test_a_key_placed_during_the_call_is_seen_at_exit() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "never appeared" GuardWarning
        g = _guarded(lambda d: d.__setitem__("kl", [torch.ones(2)]), keys=["kl"])
    assert g.protected_count == 1


def test_replacing_lists_many_times_is_counted_once_per_tensor() -> None:
    def body(d: dict[str, Any]) -> None:
        for _ in range(3):
            d["kl"] = [torch.ones(2) for _ in range(2)]

    assert _guarded(body).protected_count == 4 + 2  # only the last list is in the object at exit


@pytest.mark.parametrize("action", ["record", "raise"])
def test_a_write_with_no_op_before_placements_is_reported_with_its_path(action: str) -> None:
    def body(d: dict[str, Any]) -> None:
        d["a"][0].numpy()[0] = 9  # no dispatched op: only the exit's digests can see it
        d["new"] = [torch.ones(1)]

    if action == "raise":
        with pytest.raises(kvguard.MutationError, match=r"d\['a'\]\[0\] changed during the guard"):
            _guarded(body, action=action)
        return
    g = _guarded(body)
    assert [e.path for e in g.report.events] == ["d['a'][0]"]
    event = g.report.events[0]
    assert event.op == "(no dispatched op)" and "[9, 1, 1, 1]" in event.after
    assert g.protected_count == 5


def test_a_write_through_an_alias_after_its_list_moved_keys_names_where_it_is_now() -> None:
    def body(d: dict[str, Any]) -> None:
        x = d["a"]
        d["z"] = x
        del d["a"]
        x[1].numpy()[0] = 4

    g = _guarded(body)
    assert [e.path for e in g.report.events] == ["d['z'][1]"]


def test_a_tensor_dropped_from_the_object_and_dead_by_exit_is_let_go_unread() -> None:
    def body(d: dict[str, Any]) -> None:
        old = d["a"]
        d["a"] = [torch.ones(2)]
        old[0].numpy()[0] = 7  # written after it left the object; it dies with `old`

    g = _guarded(body)
    assert g.report.events == []


def test_a_tensor_dropped_from_the_object_but_alive_is_still_compared() -> None:
    kept: list[Any] = []

    def body(d: dict[str, Any]) -> None:
        kept.append(d["b"])
        d["b"] = torch.zeros(3)
        kept[0].numpy()[0] = 5

    g = _guarded(body)
    assert [e.path for e in g.report.events] == ["d['b']"]


def test_a_write_between_placement_and_a_later_op_is_reported_at_that_op() -> None:
    """A placement seen during the call (a write op looks) has its digest from then on."""
    def body(d: dict[str, Any]) -> None:
        d["kl"] = [torch.ones(2)]
        torch.zeros(1).add_(1)  # the look: kl is protected from here
        d["kl"][0].numpy()[0] = 3  # no op

    g = _guarded(body)
    assert [e.path for e in g.report.events] == ["d['kl'][0]"]


def test_a_placement_on_another_thread_is_counted_at_exit() -> None:
    def body(d: dict[str, Any]) -> None:
        worker = threading.Thread(target=lambda: d.__setitem__("kl", [torch.ones(2), torch.ones(2)]))
        worker.start()
        worker.join()

    g = _guarded(body)
    assert g.report.events == [] and g.protected_count == 6


def test_check_inside_the_block_still_protects_what_was_placed() -> None:
    """`g.check()` is no exit: a tensor it finds placed is digested, and a later change reported."""
    d: dict[str, Any] = {"a": [torch.ones(2)]}
    with kvguard.guard(d, name="d", action="record") as g:
        d["kl"] = [torch.ones(2)]
        assert g.check() == []
        d["kl"][0].numpy()[0] = 8
    assert [e.path for e in g.report.events] == ["d['kl'][0]"]


def test_a_guarded_generator_pause_is_no_exit() -> None:
    """A pause checks as an exit does, but the set stays open: what it found placed is protected."""
    d: dict[str, Any] = {"a": [torch.ones(2)]}

    @kvguard.guarded("d", action="record")
    def gen(d: dict[str, Any]) -> Any:
        d["kl"] = [torch.ones(2)]
        yield 1  # a pause: kl is protected from here (not merely counted)
        d["kl"][0].numpy()[0] = 8
        yield 2

    assert list(gen(d)) == [1, 2]
    assert [e.path for e in gen.last_report.events] == ["d['kl'][0]"]  # type: ignore[attr-defined]


def test_the_exit_walks_only_what_was_placed(monkeypatch: pytest.MonkeyPatch) -> None:
    """No full walk and no row for what is first seen at the exit (here a replaced list, which
    a look during the call answers with a full walk): the exit costs what was placed."""
    from kvguard._protect import native

    if native.table_module() is None:
        pytest.skip("the compiled extension is not loaded")
    walks: list[int] = []
    rows: list[int] = []
    real_scan, real_add = native.NativeSet._scan_now, native.NativeSet._add
    monkeypatch.setattr(native.NativeSet, "_scan_now", lambda self, frames: walks.append(1) or real_scan(self, frames))
    monkeypatch.setattr(native.NativeSet, "_add", lambda self, found, frames: rows.append(1) or real_add(self, found, frames))
    d: dict[str, Any] = {"a": [torch.ones(4) for _ in range(3)]}
    with kvguard.guard(d, name="d", action="raise") as g:
        if g.engine != "compiled":
            pytest.skip("the compiled engine is not in use")
        entry = len(walks)
        d["a"] = [torch.ones(2) for _ in range(5)]
    assert len(walks) == entry and rows == []
    assert g.protected_count == 3 + 5


def test_a_list_placed_whole_is_searched_once_beside_stores_under_other_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rd["kl"] = kl` beside `rd["returns"] = returns` (a list not placed yet): the other store's
    key is not the chain's, so no tensor of `kl` can get another answer: one search for all."""
    from kvguard._protect import placements

    searches: list[int] = []
    real = placements._placement_in_frame

    def counted(*args: Any, **kwargs: Any) -> Any:
        searches.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(placements, "_placement_in_frame", counted)
    rd: dict[str, Any] = {"values": [torch.ones(2) for _ in range(3)]}
    with kvguard.guard(rd, name="rd", action="record") as g:
        kl = [torch.ones(2) for _ in range(40)]
        returns = [k * 2 for k in kl]  # not placed yet
        rd["kl"] = kl
        torch.zeros(1).add_(1)  # a write op: the look that protects kl, with `returns` in the frame
        rd["returns"] = returns
        kl[3].add_(1)  # the look that protects returns, then the write
    assert [e.path for e in g.report.events] == ["rd['kl'][3]"]
    line = _line_of('rd["kl"] = kl')
    assert g.report.events[0].placed_at.endswith(f":{line}"), g.report.events[0].placed_at
    assert len(searches) == 2  # the frame searched once for kl and once for returns (not once per tensor)


def _line_of(text: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(test_a_list_placed_whole_is_searched_once_beside_stores_under_other_keys)
    return start + next(i for i, line in enumerate(lines) if line.strip() == text)

"""Intended writes: `kvguard.allow(reason)` blocks and `allow=` patterns cover every finding.

A write an op reports and a change only a boundary check finds (a write through
`.numpy()`) are the same write to the user: inside an allowed block, or under an
`allow=` pattern, each is counted in `g.report.allowed` with its reason, with no event
and no raise. A change made before the block is not the block's, and one made after it
is not either. Runs under every engine (the boundary checks are the same for all, the
op-reported writes are not).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import kvguard

ENGINES = ("compiled", "kernels", "mode")
REASON = "kvguard.allow('numpy fill')"
pytestmark = pytest.mark.parametrize("engine", ENGINES, indirect=True)


def _rd() -> dict[str, Any]:
    return {"x": torch.zeros(3), "y": torch.zeros(2)}


def test_a_numpy_write_checked_inside_an_allowed_block_is_allowed_under_raise() -> None:
    rd = _rd()
    with kvguard.guard(rd, name="rd", action="raise") as g:
        with kvguard.allow("numpy fill"):
            rd["x"].numpy()[0] = 1
            assert g.check() == []
    assert g.report.ok and g.report.events == []
    assert g.report.allowed == {REASON: 1}
    assert rd["x"].tolist() == [1.0, 0.0, 0.0]


def test_a_numpy_write_inside_an_allowed_block_found_only_at_exit_is_allowed() -> None:
    rd = _rd()
    with kvguard.guard(rd, name="rd", action="raise") as g:
        with kvguard.allow("numpy fill"):
            rd["x"].numpy()[0] = 1
        rd["y"].mul(2)  # later code that writes nothing protected
    assert g.report.ok and g.report.allowed == {REASON: 1}


def test_a_change_before_the_block_is_not_the_blocks_under_raise() -> None:
    rd = _rd()
    with pytest.raises(kvguard.MutationError, match=r"rd\['x'\] changed during the guard") as raised:
        with kvguard.guard(rd, name="rd", action="raise") as g:
            rd["x"].numpy()[0] = 1  # a bug, made before the block
            with kvguard.allow("numpy fill"):
                rd["y"].numpy()[0] = 1
    assert raised.value.args[1].path == "rd['x']"
    assert g.report.allowed == {}  # the block was never entered


def test_a_change_before_or_after_the_block_is_reported_under_record() -> None:
    rd = {"x": torch.zeros(3), "y": torch.zeros(2), "z": torch.zeros(1)}
    with kvguard.guard(rd, name="rd", action="record") as g:
        rd["x"].numpy()[0] = 1
        with kvguard.allow("numpy fill"):
            rd["y"].numpy()[0] = 1
        rd["z"].numpy()[0] = 1
    assert [(e.path, e.kind) for e in g.report.events] == [("rd['x']", "unobserved"), ("rd['z']", "unobserved")]
    assert g.report.allowed == {REASON: 1}


def test_op_writes_and_numpy_writes_in_one_block_are_each_allowed_once() -> None:
    rd = _rd()
    with kvguard.guard(rd, name="rd", action="raise") as g:
        with kvguard.allow("numpy fill"):
            rd["x"].add_(1)  # reported by the op: allowed at once
            rd["y"].numpy()[:] = 7  # found as the block ends
            g.check()  # nothing new
        g.check()
    assert g.report.ok and g.report.allowed == {REASON: 2}
    assert rd["x"].tolist() == [1.0, 1.0, 1.0] and rd["y"].tolist() == [7.0, 7.0]


def test_nested_blocks_count_under_the_inner_reason() -> None:
    rd = _rd()
    with kvguard.guard(rd, name="rd", action="raise") as g:
        with kvguard.allow("outer"):
            with kvguard.allow("numpy fill"):
                rd["x"].numpy()[0] = 1
            rd["y"].numpy()[0] = 1
    assert g.report.allowed == {REASON: 1, "kvguard.allow('outer')": 1}


def test_an_exception_leaving_the_block_is_unchanged_and_the_change_still_allowed() -> None:
    rd = _rd()
    with kvguard.guard(rd, name="rd", action="raise") as g:
        with pytest.raises(KeyError, match="boom"):
            with kvguard.allow("numpy fill"):
                rd["x"].numpy()[0] = 1
                raise KeyError("boom")
    assert g.report.ok and g.report.allowed == {REASON: 1}


def test_a_guard_entered_inside_an_allowed_block_allows_its_exit_findings() -> None:
    rd = _rd()
    with kvguard.allow("numpy fill"):
        with kvguard.guard(rd, name="rd", action="raise") as g:
            rd["x"].numpy()[0] = 1
    assert g.report.ok and g.report.allowed == {REASON: 1}


def test_nested_guards_both_allow_a_change_made_in_the_block() -> None:
    x = torch.zeros(4)
    with kvguard.guard({"x": x}, name="outer", action="raise") as outer:
        with kvguard.guard({"part": x[2:]}, name="inner", action="record") as inner:
            with kvguard.allow("numpy fill"):
                x.numpy()[3] = 1
    assert outer.report.ok and inner.report.ok
    assert outer.report.allowed == inner.report.allowed == {REASON: 1}


def test_a_block_on_another_thread_does_not_check_this_threads_guard() -> None:
    rd = _rd()
    with kvguard.guard(rd, name="rd", action="record") as g:
        rd["x"].numpy()[0] = 1  # this thread's change, not the other thread's block's

        def other() -> None:
            with kvguard.allow("numpy fill"):
                pass

        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
    assert [e.path for e in g.report.events] == ["rd['x']"] and g.report.allowed == {}


def test_a_block_outside_any_guard_does_nothing_and_a_closed_guard_is_not_checked() -> None:
    rd = _rd()
    with kvguard.guard(rd, name="rd", action="raise") as g:
        pass
    rd["x"].numpy()[0] = 1
    with kvguard.allow("numpy fill"):
        rd["x"].add_(1)
    assert g.report.ok and g.report.allowed == {}


def test_warn_prints_nothing_for_an_allowed_boundary_finding(capsys: pytest.CaptureFixture[str]) -> None:
    rd = _rd()
    with kvguard.guard(rd, name="rd", action="warn") as g:
        with kvguard.allow("numpy fill"):
            rd["x"].numpy()[0] = 1
    assert g.report.ok and g.report.allowed == {REASON: 1}
    assert "rd['x']" not in capsys.readouterr().err


@pytest.mark.parametrize("action", ["raise", "warn", "record"])
def test_an_allow_pattern_covers_boundary_findings(action: str, capsys: pytest.CaptureFixture[str]) -> None:
    rd = {"kl": [torch.zeros(2), torch.zeros(2)], "adv": torch.zeros(2)}
    with kvguard.guard(rd, name="rd", action=action, allow=["rd['kl'][*]"]) as g:
        rd["kl"][1].numpy()[0] = 1
        assert g.check() == []
        rd["kl"][0].numpy()[0] = 1  # found at the exit check
    assert g.report.ok and g.report.allowed == {"allow=rd['kl'][*]": 2}
    assert "rd['kl']" not in capsys.readouterr().err


def test_an_allow_pattern_still_reports_the_paths_it_does_not_cover() -> None:
    rd = {"kl": [torch.zeros(2)], "adv": torch.zeros(2)}
    with pytest.raises(kvguard.MutationError, match=r"rd\['adv'\] changed during the guard"):
        with kvguard.guard(rd, name="rd", action="raise", allow=["rd['kl'][*]"]) as g:
            rd["kl"][0].numpy()[0] = 1
            rd["adv"].numpy()[0] = 1
    assert g.report.allowed == {"allow=rd['kl'][*]": 1}
    assert [e.path for e in g.report.events] == ["rd['adv']"]


def test_light_level_allows_a_change_made_in_the_block() -> None:
    rd = _rd()
    with kvguard.guard(rd, name="rd", action="raise", level="light") as g:
        with kvguard.allow("fill"):
            rd["x"].add_(1)  # no op is watched: found as the block ends
        g.check()
    assert g.report.ok and g.report.allowed == {"kvguard.allow('fill')": 1}


def test_a_finding_raised_by_check_is_not_returned_again() -> None:
    rd = _rd()
    with kvguard.guard(rd, name="rd", action="raise") as g:
        rd["x"].numpy()[0] = 1
        with pytest.raises(kvguard.MutationError):
            g.check()
        assert g.check() == []
        with kvguard.allow("numpy fill"):
            rd["y"].numpy()[0] = 1
        assert g.check() == []
    assert [e.path for e in g.report.events] == ["rd['x']"] and g.report.allowed == {REASON: 1}

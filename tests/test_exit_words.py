"""The words a user reads for what kvguard found without an op, and for what it did not look at.

A change the weights guard finds before an optimizer step (or when a module's `_apply`
returns) says so, in the user's words, not "boundary check". What `guard_autograd` left
unprotected ends the process's summary line, which then never says clean alone; the
report files carry it and `kvguard report` calls such a run unproven.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import kvguard
from kvguard._report.process import PROCESS
from kvguard._report.read import describe, load
from kvguard._report.render import run_report
from kvguard._kinds import AUTOGRAD
from kvguard._report.tally import Tally

UNPROTECTED = ("1 unprotected under other saved-tensor hooks (stretches of hooks torch.compile inlines, torch.func "
               "transforms, which refuse saved-tensor hooks, or saved tensors kvguard could not hold): what they "
               "saved was not looked at")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("level", ["full", "light"])
def test_a_change_found_before_a_step_says_which_step_found_it(level: str) -> None:
    model, opt = _model()
    with kvguard.guard_module(model, optimizer=opt, action="record", level=level) as g:
        _step(model, opt)
        _step(model, opt)
        model[0].weight.detach().numpy()[0, 0] = 42.0  # no op shows this write
        _step(model, opt)
    (event,) = g.report.events
    assert event.kind == "unobserved" and event.found == "at optimizer step 3, before it ran"
    assert event.headline() == ("model.0.weight changed, but no dispatched op wrote it (found at optimizer step 3, "
                                f"before it ran, {event.site})")
    assert "boundary check" not in g.report.format()


def test_a_change_found_at_the_boundary_still_says_boundary_check() -> None:
    model, opt = _model()
    with kvguard.guard_module(model, optimizer=opt, action="record") as g:
        _step(model, opt)
        model[0].bias.detach().numpy()[0] = 42.0
    (event,) = g.report.events
    assert event.found == "" and "found by a boundary check, at guard exit or g.check()" in event.headline()


def test_a_change_found_when_apply_returns_says_so() -> None:
    model, opt = _model()
    with kvguard.guard_module(model, optimizer=opt, action="record", level="light") as g:  # (full: at `.data =`)
        model._apply(lambda t: torch.zeros_like(t))  # keeps dtype and device: not a conversion
    assert len(g.report.events) == 2 and {e.found for e in g.report.events} == {
        "when Sequential._apply returned (to_empty, or a function keeping dtype and device)"}


def test_the_summary_line_ends_with_what_autograd_left_unprotected() -> None:
    tally = Tally()
    tally.begin_call(AUTOGRAD.word)
    stats = tally.target(AUTOGRAD.word)
    stats.protected, stats.moments = 12, 2
    assert tally.lines() == ["kvguard: autograd: 12 saved tensors protected in 2 forward passes, no in-place writes"]
    stats.unprotected = 1
    assert tally.lines() == ["kvguard: autograd: 12 saved tensors protected in 2 forward passes, no in-place writes "
                             f"to them; {UNPROTECTED}"]
    assert tally.as_record()["unprotected"] == 1 and tally.as_record()["targets"]["autograd"]["unprotected"] == 1


def test_a_guard_counts_what_it_left_unprotected_in_the_tally(tmp_path: Path) -> None:
    class Pack(torch.nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return t * 1

    gm = torch.fx.symbolic_trace(Pack())  # hooks torch.compile would inline: left alone, counted
    x = torch.randn(3, requires_grad=True)
    with pytest.warns(kvguard.GuardWarning, match="1 unprotected"):
        with kvguard.guard_autograd(action="raise", report_dir=tmp_path) as g:
            with torch.autograd.graph.saved_tensors_hooks(gm, gm):
                y = x.exp()
            y.sum().backward()
            x.sin().sum().backward()
    assert g.unprotected == 1 and g.report.ok
    PROCESS.writers[str(tmp_path.resolve())].finish([])  # what the writer does at exit
    (run,), _ = load(str(tmp_path))
    described = describe(run)
    assert described["status"] == "unproven"
    assert any(UNPROTECTED in note for note in described["notes"])
    assert "no in-place writes to them; 1 unprotected under other saved-tensor hooks: not looked at" in run_report(
        described)


@pytest.mark.slow  # a process
def test_the_env_switchs_last_summary_line_is_never_clean_alone(tmp_path: Path) -> None:
    from processes import run_python

    script = tmp_path / "job.py"
    script.write_text(
        "import torch\n"
        "class Pack(torch.nn.Module):\n"
        "    def forward(self, t):\n"
        "        return t * 1\n"
        "gm = torch.fx.symbolic_trace(Pack())\n"
        "x = torch.randn(3, requires_grad=True)\n"
        "with torch.autograd.graph.saved_tensors_hooks(gm, gm):\n"
        "    y = x.exp()\n"
        "y.sum().backward()\n"
        "x.sin().sum().backward()\n")
    result = run_python(script, cwd=tmp_path, KVGUARD="raise", KVGUARD_TARGETS="autograd",
                        KVGUARD_REPORT_DIR=str(tmp_path / "reports"))
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"kvguard: autograd: 1 saved tensor protected in 1 forward pass, no in-place writes to them; {UNPROTECTED}")
    record: dict[str, Any] = [json.loads(line) for path in (tmp_path / "reports").iterdir()
                              for line in path.read_text().splitlines()][-1]
    assert record["unprotected"] == 1

"""A newcomer's mistakes, each answered where they look: the last lines, the error, the hint.

Messages a user reads are checked word by word. Env activation runs in a real subprocess,
activated by `KVGUARD*` variables through the `kvguard.pth` this environment's install ships.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch

import kvguard
from kvguard import _config
from kvguard._errors import ConfigError
from kvguard._presets import PRESETS

PRESET_NAMES = ", ".join(PRESETS)


def run_job(tmp_path: Path, files: dict[str, str], **env: str) -> subprocess.CompletedProcess[str]:
    """`python job.py` in `tmp_path`, with `files` written there and only `env`'s KVGUARD settings."""
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("KVGUARD", "PYTHON")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "job.py"], env={**base, "PYTHONPATH": str(tmp_path), **env},
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)


# 1. A target that guarded nothing: its last lines say which and why, with the name meant.

def test_a_misspelt_function_or_argument_is_named_in_the_last_lines(tmp_path: Path) -> None:
    loss = """
        def compute_kl_and_advantages(args, rollout_data):
            return rollout_data

        class Trainer:
            def step(self, rollout_data):
                return rollout_data
    """
    job = "import myloss\nmyloss.compute_kl_and_advantages(None, {})\nprint('job done')\n"
    targets = ("myloss:compute_kl_and_advantage(rollout_data),myloss:compute_kl_and_advantages(rolout_data),"
               "myloss:Trainr.step(rollout_data),myloss:nothing_like_it(rollout_data)")
    result = run_job(tmp_path, {"myloss.py": loss, "job.py": job}, KVGUARD="warn", KVGUARD_TARGETS=targets)
    assert result.returncode == 0 and result.stdout == "job done\n", result.stderr
    why = ["myloss has no attribute 'compute_kl_and_advantage'; did you mean compute_kl_and_advantages?",
           "compute_kl_and_advantages() has no parameter 'rolout_data'; its parameters are args, rollout_data; "
           "did you mean rollout_data?",
           "myloss has no attribute 'Trainr.step'; did you mean Trainer?",
           "myloss has no attribute 'nothing_like_it'"]
    spelled = targets.split(",")
    assert result.stderr.splitlines() == [
        *(f"kvguard: cannot guard {target}: {reason}" for target, reason in zip(spelled, why)),  # at import
        "kvguard: 0 guarded calls, so no write was checked",
        *(f"kvguard: target {target} was not guarded: {reason}" for target, reason in zip(spelled, why)),
    ]


def test_guarded_names_the_parameter_meant() -> None:
    def step(args: object, rollout_data: object) -> None:
        pass

    with pytest.raises(TypeError) as caught:
        kvguard.guarded("rolout_data")(step)
    assert str(caught.value).endswith("step() has no parameter 'rolout_data'; its parameters are args, "
                                      "rollout_data; did you mean rollout_data?")


# 2. A near-miss word in KVGUARD_TARGETS: the closest preset or special target.

@pytest.mark.parametrize(("typed", "meant"), [("autograde", "autograd"), ("weight", "weights"),
                                              ("Slim", "slime"), ("openrlfh", "openrlhf")])
def test_a_near_miss_word_suggests_the_closest_preset_or_special_target(typed: str, meant: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _config.from_env({"KVGUARD": "raise", "KVGUARD_TARGETS": f"myrl.loss:f(rd),{typed}"})
    assert str(caught.value) == (
        f"invalid target {typed!r} in the KVGUARD_TARGETS environment variable; without a colon it names a preset "
        f"or one of autograd, weights, data, all, and none is called that; did you mean {meant}? (known presets: "
        f"{PRESET_NAMES}); a function is module:qualname(argname), "
        "e.g. myrl.loss:compute_advantages_and_returns(rollout_data)")


def test_a_word_close_to_nothing_suggests_nothing() -> None:
    with pytest.raises(ConfigError) as caught:
        _config.parse_targets("gradients")
    assert "did you mean" not in str(caught.value) and f"(known presets: {PRESET_NAMES})" in str(caught.value)


# 3. kvguard.guard(model): the guard for a model's weights is guard_module.

def test_guarding_a_module_points_to_guard_module() -> None:
    with pytest.raises(TypeError) as caught:
        kvguard.guard(torch.nn.Linear(2, 2))
    assert str(caught.value) == (
        "kvguard.guard() protects tensors held in dicts (and any Mapping), lists, tuples, namedtuples, "
        "dataclass instances, SimpleNamespaces or torch pytree nodes (nested at any depth), or a tensor; "
        "got torch.nn.modules.linear.Linear; for a model's parameters and buffers use kvguard.guard_module(model)")


# 4. The hint: per guard kind, per op, per line.

def _stopped(guard: object, write: Callable[[], object]) -> str:
    """The `hint` line of the MutationError `write` raises under `guard` (action raise)."""
    with pytest.raises(kvguard.MutationError) as caught:
        with guard:  # type: ignore[attr-defined]
            write()
    (line,) = [line for line in str(caught.value).splitlines() if line.startswith("  hint ")]
    return line.removeprefix("  hint     ")


def _scale(rd: dict[str, Any]) -> None:
    k = rd["kl"]
    k *= -0.5  # the bug: k is rd["kl"]


NEW = "write to a new tensor"


@pytest.mark.parametrize(("write", "start"), [
    (_scale, f"{NEW} (k = k * -0.5)"),
    (lambda rd: rd["kl"].masked_fill_(rd["kl"] > 0, 0.0), f"{NEW} (k = k.masked_fill(...))"),
    (lambda rd: rd["kl"].sub_(1), f"{NEW} (k = k.sub(...))"),
    (lambda rd: torch.nn.functional.relu_(rd["kl"]), f"{NEW} (k = k.relu())"),
    (lambda rd: torch.add(rd["kl"], 1, out=rd["kl"]), f"{NEW} (k = torch.add(...) without out=)"),
    (lambda rd: rd["kl"].zero_(), NEW),
], ids=["augmented", "masked_fill_", "sub_", "relu_", "out", "zero_"])
def test_the_hint_names_the_out_of_place_form_of_the_write(write: Callable[[Any], object], start: str) -> None:
    rd = {"kl": torch.ones(4)}
    hint = _stopped(kvguard.guard(rd, action="raise", name="rd"), lambda: write(rd))
    assert hint == f"{start} or clone first (k = k.clone())"


def test_the_hint_for_weights_is_the_optimizer_in_its_step_and_allow_outside() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2)).sum().backward()
    assert _stopped(kvguard.guard_module(model, action="raise"), opt.step) == (
        "this write is an optimizer's step(): pass the optimizer, kvguard.guard_module(model, optimizer=opt), "
        "and its steps are the writes meant")
    assert _stopped(kvguard.guard_module(model, optimizer=opt, action="raise"),
                    lambda: model.weight.data.mul_(2)) == (
        "the weights change outside an optimizer's step() here; if that is meant (a weight sync, an EMA, "
        "a re-initialisation), say so with kvguard.allow('why') around it")


# 5. An allow= pattern under another name than the guard's matches nothing: said once.

def _allow_said(allow: list[str], target: Optional[str] = None) -> list[str]:
    """The GuardWarnings of a guard (of env target `target`) around an allowed write and two stopped ones."""
    from kvguard._errors import GuardWarning
    from kvguard._guard.guard import Guard

    rd = {"kl": [torch.ones(2)], "adv": torch.ones(2)}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(2):
            with pytest.raises(kvguard.MutationError):
                with Guard(rd, name="rd", action="raise", allow=allow, target=target):
                    rd["adv"].add_(1)  # allowed: no word
                    try:
                        rd["kl"][0].mul_(2)
                    except kvguard.MutationError:
                        pass
                    rd["kl"][0].mul_(2)
    return [str(w.message) for w in said if w.category is GuardWarning]


def test_an_allow_pattern_under_another_name_is_said_once_with_the_path_written() -> None:
    allow = ["rollout_data['kl'][*]", "rd['adv']", "batch['returns']"]
    once = [
        "kvguard.guard(rd): allow pattern rollout_data['kl'][*] matches no path: paths here start with rd, as "
        "rd['kl'][0] just written does; did you mean rd['kl'][*]?; allow pattern batch['returns'] matches no "
        "path: paths here start with rd, as rd['kl'][0] just written does"]
    assert _allow_said(allow) == once * 2  # once per guard made in code
    assert _allow_said(allow, target=f"newcomer:f{id(allow)}(rd)") == once  # once per target, not per call
    assert _allow_said(["rd['adv']"]) == []


# 6. A process guard has one call: its exit lines speak of forward passes and optimizer steps.

def test_autograd_and_weights_exit_lines_name_the_forward_pass_and_the_optimizer_step(tmp_path: Path) -> None:
    job = """
        import torch

        torch.manual_seed(0)
        model = torch.nn.Linear(3, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            y = torch.sigmoid(model(torch.randn(2, 3)))
            if step == 1:
                y.mul_(2)  # a tensor sigmoid saved: backward would fail
                continue
            y.sum().backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            model.weight.mul_(0.5)  # the weights, after the second step
        print("job done")
    """
    result = run_job(tmp_path, {"job.py": job}, KVGUARD="warn", KVGUARD_TARGETS="autograd,weights")
    assert result.returncode == 0 and result.stdout == "job done\n", result.stderr
    assert result.stderr.splitlines()[-4:] == [
        "kvguard: autograd: 6 saved tensors protected in 2 forward passes, 1 write at 1 site",
        "  job.py:10 aten.mul_.Tensor: 1 write to <saved by SigmoidBackward0: result> in 1 forward pass "
        "(first: <saved by SigmoidBackward0: result>, forward pass 2)",
        "kvguard: weights: 2 parameters and buffers watched over 2 optimizer steps, 1 write at 1 site",
        "  job.py:16 aten.mul_.Tensor: 1 write to model.weight (first: model.weight, after optimizer step 2)"]


def test_a_process_guards_site_line_without_a_moment_names_only_the_first_path() -> None:
    from kvguard._report.events import MutationEvent
    from kvguard._report.tally import Tally

    event = MutationEvent("model.weight", "aten.mul_.Tensor", "write", False, "/x/job.py", 3, "w.mul_(2)", "f",
                          None, "f32[2] cpu", "", "", "")
    tally = Tally()
    for label, moment in [("weights", 0), ("autograd", None), ("rd", None)]:
        tally.add(event, 1, label, moment)
    assert [line for line in tally.lines() if line.startswith("  ")] == [
        "  job.py:3 aten.mul_.Tensor: 1 write to model.weight (first: model.weight, before the first optimizer step)",
        "  job.py:3 aten.mul_.Tensor: 1 write to model.weight (first: model.weight)",
        "  job.py:3 aten.mul_.Tensor: 1 write to model.weight in 1 call (first: model.weight, call 1)"]


# 7. `kvguard report` in a pipe or a CI log: the table as wide as what it holds.

def test_the_report_table_in_a_pipe_is_as_wide_as_its_contents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from kvguard.__main__ import main

    key = "per_token_kl_between_the_policy_and_the_reference_model_after_shaping"
    rd = {key: [torch.ones(3)]}
    with kvguard.guard(rd, action="record", name="rollout_data", report_dir=tmp_path / "reports"):
        k = rd[key][0]
        k *= 0.5
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["report", str(tmp_path / "reports")]) == 1
    table = [line for line in capsys.readouterr().out.splitlines() if line[0] in "┏┃┡│└"]
    assert len({len(line) for line in table}) == 1 and len(table[0]) > 150  # one width, wider than a terminal's guess
    assert f"rollout_data['{key}'][*]" in table[3] and f"rollout_data['{key}'][0]" in table[3]  # whole, one line
    assert re.search(r"call \d+: 3/3 elements changed, max \|Δ\| 0.5, 0 sign flips +│$", table[4])  # the whole diff
    assert main(["report", str(tmp_path / "reports"), "--width", "100"]) == 1
    assert {len(line) for line in capsys.readouterr().out.splitlines() if line[0] in "┏┃┡│└"} == {100}

"""Pipeline awareness: a guarded call that did nothing on a stage that is not the last is
"not run here", never a clean call.

A stand-in `megatron.core.parallel_state` (only the getters the integration reads) keeps
these tests free of the seconds-long Megatron import; `test_rl_advantages.py` runs the
same path on the real `parallel_state` with two pipeline stages.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import kvguard
import kvguard_megatron
from kvguard import _ranks
from kvguard._report.process import PROCESS
from kvguard._report.tally import Tally

ROOT = Path(__file__).resolve().parents[2]
STAGE0 = "not the last pipeline stage: pp=0 of 2"


def fake_parallel_state(stage: int = 0, stages: int = 2, initialized: bool = True) -> types.ModuleType:
    state = types.ModuleType("megatron.core.parallel_state")
    getters: dict[str, Any] = {
        "model_parallel_is_initialized": lambda: initialized,
        "is_pipeline_last_stage": lambda ignore_virtual=True, vp_stage=None: stage == stages - 1,
        "get_pipeline_model_parallel_rank": lambda: stage,
        "get_pipeline_model_parallel_world_size": lambda: stages,
        "get_tensor_model_parallel_rank": lambda: 0,
        "get_data_parallel_rank": lambda with_context_parallel=False: 0,
        "get_context_parallel_rank": lambda: 0,
    }
    for name, getter in getters.items():
        setattr(state, name, getter)
    return state


@pytest.fixture
def stage(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Set the stand-in's pipeline stage: `stage(0, 2)`; removed after the test."""
    def put(number: int, of: int = 2, initialized: bool = True) -> types.ModuleType:
        state = fake_parallel_state(number, of, initialized)
        monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", state)
        return state
    yield put


def rollout() -> dict[str, Any]:
    return {"kl": [torch.ones(4), torch.ones(3)], "rewards": [1.0, 0.0]}


# --- the integration's check -------------------------------------------------------------

def test_not_run_here_names_the_stage_only_on_a_stage_that_is_not_the_last(stage: Any) -> None:
    stage(0, 2)
    assert kvguard_megatron.not_run_here() == STAGE0
    stage(2, 4)
    assert kvguard_megatron.not_run_here() == "not the last pipeline stage: pp=2 of 4"
    stage(1, 2)
    assert kvguard_megatron.not_run_here() is None
    stage(0, 1)
    assert kvguard_megatron.not_run_here() is None


def test_not_run_here_says_nothing_without_initialised_megatron(stage: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "megatron.core.parallel_state", raising=False)
    assert kvguard_megatron.not_run_here() is None
    stage(0, 2, initialized=False)
    assert kvguard_megatron.not_run_here() is None
    state = stage(0, 2)

    def broken(ignore_virtual: bool = True, vp_stage: Any = None) -> bool:
        raise AssertionError("pipeline model parallel group is not initialized")
    state.is_pipeline_last_stage = broken  # type: ignore[attr-defined]
    assert kvguard_megatron.not_run_here() is None


def test_the_check_is_registered_with_kvguard_on_import() -> None:
    assert kvguard_megatron.not_run_here in _ranks._not_run_checks


# --- guards: when a call counts as not run ------------------------------------------------

def _target_stats(label: str) -> Any:
    return PROCESS.tally.targets[label]


def test_a_guarded_call_that_did_nothing_on_stage_0_is_not_run_not_clean(stage: Any) -> None:
    stage(0, 2)
    rd = rollout()
    calls = PROCESS.tally.calls
    with kvguard.guard(rd, name="rd_stage0", action="record") as g:
        pass  # `if not mpu.is_pipeline_last_stage(): return`
    assert g.not_run == STAGE0
    stats = _target_stats("rd_stage0")
    assert (stats.calls, stats.not_run, stats.protected) == (0, {STAGE0: 1}, 0)
    assert PROCESS.tally.calls == calls, "not counted as a guarded call"


@pytest.mark.parametrize("body", ["read", "write", "raise"])
def test_a_call_that_ran_is_a_guarded_call_even_on_stage_0(stage: Any, body: str) -> None:
    stage(0, 2)
    rd = rollout()
    name = f"rd_ran_{body}"
    with pytest.raises(ValueError) if body == "raise" else contextlib.nullcontext():
        with kvguard.guard(rd, name=name, action="record") as g:
            if body == "read":
                float(rd["kl"][0].sum())  # tensor work, no write: it ran here
            elif body == "write":
                rd["kl"][0].mul_(2)
            else:
                raise ValueError("the guarded code failed")
    if body == "read" and g.engine != "mode":
        # A write hook sees writes only: a call that merely read is the integration's word.
        assert g.not_run == STAGE0
        return
    assert g.not_run is None
    assert _target_stats(name).calls == 1 and not _target_stats(name).not_run


def test_the_last_stage_counts_its_calls_as_guarded(stage: Any) -> None:
    stage(1, 2)
    with kvguard.guard(rollout(), name="rd_last", action="record") as g:
        pass
    assert g.not_run is None and _target_stats("rd_last").calls == 1


def test_level_light_takes_the_stage_s_word_unless_a_change_is_found(stage: Any) -> None:
    stage(0, 2)
    rd = rollout()
    with kvguard.guard(rd, name="rd_light", action="record", level="light") as g:
        float(rd["kl"][0].sum())  # unseen at this level: the stage decides
    assert g.not_run == STAGE0
    with kvguard.guard(rd, name="rd_light_write", action="record", level="light") as g:
        rd["kl"][1].numpy()[0] = 5.0  # found by the fingerprint at exit: it ran
    assert g.not_run is None and len(g.report.events) == 1


def test_a_failing_check_counts_the_call_as_guarded(stage: Any) -> None:
    def broken() -> str:
        raise RuntimeError("no answer")
    undo = _ranks.register_not_run_check(broken)
    try:
        with kvguard.guard(rollout(), name="rd_broken_check", action="record") as g:
            pass
    finally:
        undo()
    assert g.not_run is None


def test_the_exit_line_and_summary_record_count_not_run_calls_apart() -> None:
    tally = Tally()
    for _ in range(3):
        tally.begin_call("t")
        tally.not_run_call("t", STAGE0)
    assert tally.lines("rank 0/2 pp=0") == [
        f"kvguard [rank 0/2 pp=0]: kvguard.guard(t): 0 guarded calls, 3 calls not run here ({STAGE0}), "
        "no in-place writes"]
    record = tally.as_record()
    assert record["calls"] == 0 and record["not_run"] == {STAGE0: 3}
    assert record["targets"]["t"]["not_run_calls"] == 3
    tally.begin_call("t")
    tally.begin_call("u")
    tally.not_run_call("u", "elsewhere")
    assert tally.lines() == [  # per guard name, each with its own counts
        f"kvguard: kvguard.guard(t): 1 guarded call, 3 calls not run here ({STAGE0}), 0 tensors protected, "
        "no in-place writes",
        "kvguard: kvguard.guard(u): 0 guarded calls, 1 call not run here (elsewhere), no in-place writes"]


# --- env activation, in a fresh interpreter -----------------------------------------------

TRAINER = textwrap.dedent("""
    import sys, types

    state = types.ModuleType("megatron.core.parallel_state")  # stage 0 of 2, as Megatron says it
    state.model_parallel_is_initialized = lambda: True
    state.is_pipeline_last_stage = lambda ignore_virtual=True, vp_stage=None: False
    state.get_pipeline_model_parallel_rank = lambda: 0
    state.get_pipeline_model_parallel_world_size = lambda: 2
    state.get_tensor_model_parallel_rank = state.get_context_parallel_rank = lambda: 0
    state.get_data_parallel_rank = lambda with_context_parallel=False: 0
    sys.modules["megatron.core.parallel_state"] = mpu = state


    def compute_advantages_and_returns(args, rollout_data):
        if not mpu.is_pipeline_last_stage():
            return
        rollout_data["kl"][0] *= 2
""")


def test_env_activation_says_not_run_here_in_the_exit_line_and_the_report(tmp_path: Path) -> None:
    (tmp_path / "stage_loss.py").write_text(TRAINER)
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch, stage_loss
        for _ in range(3):
            stage_loss.compute_advantages_and_returns(None, {"kl": [torch.ones(4)], "rewards": [1.0]})
    """))
    reports = tmp_path / "reports"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD", "RANK", "WORLD_SIZE"))}
    env.update(KVGUARD="warn", KVGUARD_TARGETS="stage_loss:compute_advantages_and_returns(rollout_data)",
               KVGUARD_LEVEL="light", KVGUARD_REPORT_DIR=str(reports), RANK="0", WORLD_SIZE="2",
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    result = subprocess.run([sys.executable, "-m", "kvguard", "run", "--", sys.executable, "train.py"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert ("kvguard [rank 0/2 tp=0 pp=0 dp=0 cp=0]: stage_loss:compute_advantages_and_returns(rollout_data): "
            f"0 guarded calls, 3 calls not run here ({STAGE0}), no in-place writes") in result.stderr
    assert ("kvguard: target stage_loss:compute_advantages_and_returns(rollout_data) did not run here: "
            f"3 calls ({STAGE0}), counted as not run, not as clean") in result.stderr
    assert "was never called" not in result.stderr

    records = [json.loads(line) for line in (reports / "kvguard-rank0.jsonl").read_text().splitlines()]
    summary = records[-1]
    assert summary["record"] == "summary" and summary["calls"] == 0 and summary["not_run"] == {STAGE0: 3}
    assert summary["targets"]["stage_loss:compute_advantages_and_returns(rollout_data)"]["not_run_calls"] == 3
    # A report holding only stages that never ran the code proves nothing: not "clean".
    report = subprocess.run([sys.executable, "-m", "kvguard", "report", str(reports)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert report.returncode == 2, report.stdout + report.stderr
    assert "did not run here" in report.stdout

"""`KVGUARD_TARGETS=trl` on real trl (not a replica): each trainer's own loop on a tiny Llama.

The jobs (`tests/fake_frameworks/jobs/trl_grpo.py`, `trl_dpo.py`) build the model from a config,
the tokenizer in memory and the dataset in memory, and run offline on CPU in tens of seconds, so
the tests on real trl are slow-tier and skip where trl is not installed. Read and tested with
trl 1.16.0 (transformers 5.25.0, accelerate 1.16.0, datasets 5.2.0). The first test needs no trl.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvguard.__main__ import main
from kvguard._config import parse_targets
from kvguard._presets import PRESETS
from tests.processes import run_python

JOBS = Path(__file__).resolve().parent / "fake_frameworks" / "jobs"
GUARDED = {
    "grpo": "trl.trainer.grpo_trainer:GRPOTrainer.compute_loss(inputs)",
    "rloo": "trl.trainer.rloo_trainer:RLOOTrainer.compute_loss(inputs)",
    "dpo": "trl.trainer.dpo_trainer:DPOTrainer.compute_loss(inputs)",
}


def test_the_trl_preset_parses_and_says_what_it_guards_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert [str(t) for t in parse_targets("TRL")] == list(GUARDED.values())
    assert main(["presets", "trl"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trl: https://github.com/huggingface/trl at tag v1.16.0 (2026-10-15)\n")
    for function in PRESETS["trl"].functions:
        assert f"\n  {function.target}\n    source {function.file} @ v1.16.0" in out
    assert "    source trl/trainer/rloo_trainer.py @ v1.16.0 (since v0.22.0)\n" in out
    assert "with num_iterations > 1 _prepare_inputs serves the same buffered" in " ".join(out.split())


# ── real trl ─────────────────────────────────────────────────────────────────────────────────

@pytest.fixture(scope="module")
def trl_installed() -> None:
    if os.environ.get("CI") and importlib.util.find_spec("trl") is None:
        pytest.fail("trl is not installed under CI (the ci extra installs trl==1.16.0)")
    pytest.importorskip("trl", reason="trl is not installed (pip install trl==1.16.0)")


def kvguard_run(job: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_python("-W", "ignore", "-m", "kvguard", "run", "--", sys.executable, "-W", "ignore", JOBS / job, *args,
                      KVGUARD="raise", KVGUARD_TARGETS="trl,autograd,weights", HF_HUB_OFFLINE="1", timeout=600)


def exit_lines(stderr: str) -> list[str]:
    """The exit lines that count guarded calls, per target and switch."""
    return [line for line in stderr.splitlines()
            if line.startswith("kvguard: ") and ("guarded call" in line or "protected in" in line or "watched" in line)]


def line_of(path: Path, text: str) -> int:
    (number,) = [i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line]
    return number


@pytest.mark.slow
def test_the_preset_names_functions_and_arguments_that_trl_has(trl_installed: None) -> None:
    code = ("import importlib; from kvguard._config import parse_targets; from kvguard import _presets\n"
            "for t in parse_targets('trl'):\n"
            "    print(t, _presets.missing_reason(t, importlib.import_module(t.module)))\n")
    done = run_python("-W", "ignore", "-c", code, HF_HUB_OFFLINE="1", timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{target} None" for target in GUARDED.values()]


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_a_trainers_own_loop_is_clean_under_raise(trl_installed: None, trainer: str) -> None:
    """GRPO with a KL term: the batch holds ref_per_token_logps, and trl blends the reference model
    toward the policy in place every step (sync_ref_model), which the weights switch leaves alone."""
    done = kvguard_run("trl_grpo.py", "--trainer", trainer, *(["--beta", "0.04"] if trainer == "grpo" else []))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2 loss " in done.stdout
    lines = exit_lines(done.stderr)
    # GRPO's batch: prompt/completion ids and masks, advantages, num_items_in_batch, old and ref log-probs
    tensors = {"grpo": 16, "rloo": 12}[trainer]
    assert f"kvguard: {GUARDED[trainer]}: 2 guarded calls, {tensors} tensors protected, no in-place writes" in lines, \
        done.stderr[-3000:]
    assert len(lines) == 3 and all(line.endswith(", no in-place writes") for line in lines), lines
    assert lines[0].startswith("kvguard: autograd: ") and lines[2].startswith("kvguard: weights: ")
    assert "cannot guard" not in done.stderr and "preset trl" not in done.stderr


@pytest.mark.slow
# GRPO only: RLOO's clean run shows its compute_loss(inputs) guarded, and what raises is the same guard
@pytest.mark.parametrize("trainer", ["grpo"])
def test_advantages_scaled_in_place_in_a_custom_loss_are_caught_at_the_line(trl_installed: None,
                                                                            trainer: str) -> None:
    """num_iterations=2 trains on each buffered batch twice: the write would scale the advantages twice."""
    bug = line_of(JOBS / "trl_grpo.py", "advantages *= ADVANTAGE_SCALE")
    done = kvguard_run("trl_grpo.py", "--trainer", trainer, "--bug")
    assert done.returncode == 1 and "step 1 loss" not in done.stdout, done.stderr[-3000:]
    assert ("kvguard.MutationError: inputs['advantages'] would be modified in place by aten.mul_.Tensor at "
            f"trl_grpo.py:{bug}\n"
            "  code     advantages *= ADVANTAGE_SCALE  # the bug: the buffered batch's tensor, trained on again next "
            "iteration\n") in done.stderr, done.stderr[-3000:]
    assert "  action   raised before the write; the data is intact\n" in done.stderr, done.stderr[-3000:]
    assert (f"kvguard: {GUARDED[trainer]}: 1 guarded call, ") in done.stderr
    assert (f"  trl_grpo.py:{bug} aten.mul_.Tensor: 1 write blocked to inputs['advantages'] in 1 call") in done.stderr


@pytest.mark.slow
def test_dpo_with_precomputed_reference_log_probs_is_clean_under_raise(trl_installed: None) -> None:
    done = kvguard_run("trl_dpo.py", "--precompute")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2 loss " in done.stdout
    lines = exit_lines(done.stderr)
    # 5 tensors a batch: input_ids, attention_mask, completion_mask, ref_chosen_logps, ref_rejected_logps
    assert f"kvguard: {GUARDED['dpo']}: 2 guarded calls, 10 tensors protected, no in-place writes" in lines, lines
    assert len(lines) == 3 and all(line.endswith(", no in-place writes") for line in lines), lines

"""`KVGUARD_TARGETS=weights` on unchanged scripts, in real subprocesses."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from processes import free_port, run_python

TRAIN = textwrap.dedent("""
    import torch

    class Trainer:
        def __init__(self):
            torch.manual_seed(0)
            self.actor = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
            self.opt = torch.optim.AdamW(self.actor.parameters(), lr=1e-3)
            self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1)

        def step(self, data, bug):
            self.actor(data).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(self.actor.parameters(), 1.0)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            if bug:
                self.actor[2].weight.data.mul_(2)   # the stray write

    trainer = Trainer()
    data = torch.randn(16, 4)
    for step in range(3):
        trainer.step(data, bug=step == BUG_STEP)
    print("done")
""")


def _run(tmp_path: Path, bug_step: int, targets: str = "weights") -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN.replace("BUG_STEP", str(bug_step)))
    return run_python(script, cwd=tmp_path, KVGUARD="raise", KVGUARD_TARGETS=targets)


def test_a_stray_write_between_steps_is_stopped_on_the_env_var_alone(tmp_path: Path) -> None:
    result = _run(tmp_path, bug_step=1)
    assert result.returncode == 1 and "done" not in result.stdout
    err = result.stderr
    assert "kvguard.MutationError: self.actor.2.weight would be modified in place by aten.mul_.Tensor at " \
           "train.py:18" in err
    assert "kvguard/_engine" not in err  # the traceback ends at the user's line
    assert "kvguard: weights: 9 parameters and buffers watched over 2 optimizer steps, 1 write at 1 site" in err


def test_the_clean_loop_is_silent_but_for_what_it_watched(tmp_path: Path) -> None:
    result = _run(tmp_path, bug_step=99)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ("kvguard: weights: 9 parameters and buffers watched over 3 optimizer steps, "
                                     "no in-place writes")


def test_weights_and_autograd_together(tmp_path: Path) -> None:
    result = _run(tmp_path, bug_step=99, targets="weights,autograd")
    assert result.returncode == 0, result.stderr
    lines = set(result.stderr.strip().splitlines())
    assert "kvguard: weights: 9 parameters and buffers watched over 3 optimizer steps, no in-place writes" in lines
    assert any(line.startswith("kvguard: autograd: ") and line.endswith("no in-place writes") for line in lines)


SHAPES = Path(__file__).parent / "integrations" / "weights_inference_side.py"


def _shape(shape: str) -> subprocess.CompletedProcess[str]:
    return run_python(SHAPES, shape, KVGUARD="raise", KVGUARD_TARGETS="weights", KVGUARD_ALLOW="__main__:sync_weights")


def test_verl_6688_lora_views_of_a_reused_ipc_buffer_no_optimizer() -> None:
    result = _shape("lora_ipc_buffer")
    assert result.returncode == 1
    assert ("kvguard.MutationError: rollout_model.lora_A would be modified in place by aten.copy_.default at "
            "weights_inference_side.py:25") in result.stderr
    assert "buffer[: bucket.numel()].copy_(bucket)" in result.stderr


def test_prime_rl_2482_aliased_buffer_over_reloaded_weights_no_optimizer() -> None:
    result = _shape("aliased_buffer")
    assert result.returncode == 1
    assert ("rollout_model.lora_A (the same memory as rollout_model.packed_A) would be modified in place by "
            "aten.copy_.default at weights_inference_side.py:44") in result.stderr


def test_a_named_weight_sync_is_intended_and_a_write_between_syncs_is_not() -> None:
    result = _shape("sync_scope")
    assert result.returncode == 1
    assert "rollout_model.lora_B would be modified in place by aten.mul_.Tensor at weights_inference_side.py:49" \
        in result.stderr
    assert "kvguard: weights: 3 parameters and buffers watched (no optimizer step), 1 write at 1 site, 3 allowed" \
        in result.stderr
    clean = _shape("clean")
    assert clean.returncode == 0, clean.stderr
    assert clean.stderr.strip().splitlines() == [
        "kvguard: weights: 3 parameters and buffers watched (no optimizer step), no in-place writes, 3 allowed",
        "  allowed: 3 writes by allow=__main__:sync_weights"]


@pytest.mark.slow  # two gloo processes: CI runs it (-m slow)
def test_verl_7139_weights_left_as_views_of_a_receive_buffer_on_two_gloo_processes() -> None:
    result = run_python(SHAPES.parent / "weights_nccl_receive.py", free_port(), timeout=300, KVGUARD="warn",
                        KVGUARD_TARGETS="weights", PYTHONWARNINGS="ignore", COLUMNS="200")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rollout_model.weight was modified in place by c10d.broadcast_.default" in result.stderr
    assert "kvguard: weights: 2 parameters and buffers watched (no optimizer step), 2 writes at 1 site" in result.stderr


def test_a_process_that_made_no_optimizer_says_so(tmp_path: Path) -> None:
    settings = {"KVGUARD": "raise", "KVGUARD_TARGETS": "weights,autograd"}
    result = run_python("-c", "import torch", **settings)
    assert result.stderr.strip().splitlines() == [
        "kvguard: autograd: no forward pass saved a tensor for backward here, so no write was checked",
        "kvguard: weights: no optimizer was made and no module loaded a state dict here, so no weight was watched"]
    quiet = run_python("-c", "pass", **settings)
    assert quiet.stderr == ""  # no torch here (a launcher's helper): nothing to say
    agent = run_python("-c", "import torch.distributed.elastic.agent.server", **settings)
    assert agent.returncode == 0 and agent.stderr == ""  # torchrun's agent: the ranks say their own lines


def test_an_optimizers_weights_are_let_go_when_it_is_freed_and_a_loaded_copy_is_watched(tmp_path: Path) -> None:
    script = tmp_path / "after.py"
    script.write_text(textwrap.dedent("""
        import gc, torch
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        del opt
        gc.collect()
        with torch.no_grad():
            model.weight.mul_(2)   # training is over: the optimizer is gone
        eval_model = torch.nn.Linear(4, 2)
        eval_model.load_state_dict(model.state_dict())
        with torch.no_grad():
            eval_model.weight.mul_(2)   # a loaded copy: watched
    """))
    result = run_python(script, KVGUARD="record", KVGUARD_TARGETS="weights", KVGUARD_REPORT_DIR=str(tmp_path / "r"))
    assert "kvguard: weights: 4 parameters and buffers watched over 1 optimizer step, 1 write at 1 site" \
        in result.stderr, result.stderr
    assert "after.py:14 aten.mul_.Tensor: 1 write to eval_model.weight" in result.stderr


def test_the_docs_example_stops_at_the_stray_write() -> None:
    """docs/weights.md's example, run as it says: each line the page shows is printed."""
    root = Path(__file__).parent.parent
    page = (root / "docs" / "weights.md").read_text()
    shown = page.split("```text\n", 1)[1].split("```", 1)[0].strip("\n").splitlines()
    result = run_python("examples/stray_weight_write.py", cwd=root, KVGUARD="raise", KVGUARD_TARGETS="weights")
    assert result.returncode == 1 and "trained" not in result.stdout
    printed = [line.replace(str(root) + os.sep, "") for line in result.stderr.splitlines()]
    for line in shown:
        assert line in printed, f"{line!r} not in:\n{result.stderr}"


@pytest.mark.slow  # two gloo processes: CI runs it (-m slow)
def test_a_two_process_ddp_job_with_broadcast_buffers_is_clean_on_the_env_var_alone() -> None:
    result = run_python(SHAPES.parent / "weights_ddp_broadcast.py", free_port(), "env", timeout=300, KVGUARD="raise",
                        KVGUARD_TARGETS="weights", PYTHONWARNINGS="ignore")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("steps done") == 2
    lines = [line for line in result.stderr.splitlines() if "weights:" in line and "watched over" in line]
    assert len(lines) == 2 and all("9 parameters and buffers watched over 3 optimizer steps, no in-place writes"
                                   in line for line in lines), result.stderr


def test_weights_mixes_with_presets() -> None:
    from kvguard import _config

    settings = _config.from_env({"KVGUARD": "warn", "KVGUARD_TARGETS": "weights,slime,autograd"})
    assert "weights" in settings.kinds and "autograd" in settings.kinds and settings.targets


def test_converting_the_model_at_the_end_of_training_is_not_a_finding(tmp_path: Path) -> None:
    script = tmp_path / "convert.py"
    script.write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        model.half()   # saved in half precision, as many jobs do at the end
    """))
    result = run_python(script, KVGUARD="raise", KVGUARD_TARGETS="weights")
    assert result.returncode == 0
    assert result.stderr.strip() == ("kvguard: weights: 2 parameters and buffers watched over 1 optimizer step, "
                                     "no in-place writes")


def test_a_realistic_fine_tuning_loop_is_clean_under_autograd_and_weights() -> None:
    result = run_python(SHAPES.parent / "realistic_finetune.py", timeout=300, KVGUARD="raise",
                        KVGUARD_TARGETS="autograd,weights")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines == ["kvguard: autograd: 544 saved tensors protected in 8 forward passes, no in-place writes",
                     "kvguard: weights: 29 parameters and buffers watched over 4 optimizer steps, no in-place writes"]

"""`KVGUARD_TARGETS=weights` on unchanged scripts, in real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
    env = {**os.environ, "KVGUARD": "raise", "KVGUARD_TARGETS": targets}
    return subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


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

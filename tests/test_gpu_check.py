"""`benchmarks/gpu_check.py` runs its CPU-applicable checks (a smoke run: the GPU run is by hand)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_smoke_run_on_cpu() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                             "--rounds", "1", "--skip-train"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout
    for engine in ("compiled", "kernels", "mode"):
        assert f"ok     {engine}: the bug is reported on cpu at its line" in result.stdout


def test_gpu_check_says_it_needs_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        return
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and "no CUDA device" in result.stdout


@pytest.mark.slow
def test_gpu_check_training_part_on_cpu() -> None:
    """The `KVGUARD_TARGETS=autograd,weights` part in fresh processes: a clean job bitwise, the three bugs
    (a saved activation, the same inside a checkpointed block, a stray weight write) stopped at their lines.

    One clean job of the two (the GPU run has both): the one with checkpointing; a fused
    AdamW's step under the weights switch is tests/test_weights_steps.py's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    env["KVGUARD_CACHE_DIR"] = os.environ.get("KVGUARD_CACHE_DIR", "")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                             "--rounds", "0", "--train-rounds", "0", "--models", "",
                             "--clean-jobs", "foreach"], capture_output=True, text=True,
                            timeout=600, env={k: v for k, v in env.items() if v})
    assert result.returncode == 0 and "FAILED" not in result.stdout, result.stdout + result.stderr
    assert "clean job, AdamW fused" not in result.stdout
    for check in ("clean job, AdamW foreach, bf16, checkpointing",
                  "an in-place write to a saved activation: stopped at gpu_train.py:",
                  "an in-place write to a saved activation (inside a checkpointed block): stopped at gpu_train.py:",
                  "a stray weight write: stopped at gpu_train.py:"):
        assert f"ok     {check}" in result.stdout, check

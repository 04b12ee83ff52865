"""The README's demo, run as a user runs it: a subprocess, its output and exit status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "ppo_kl_bug.py"


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    env = {k: v for k, v in env.items() if not k.startswith("KVGUARD")}
    return subprocess.run([sys.executable, str(DEMO), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


def _line_of(text: str) -> int:
    return next(i for i, line in enumerate(DEMO.read_text().splitlines(), 1) if text in line)


def test_demo_catches_the_kl_bug_with_placement_op_line_and_diff() -> None:
    result = run_demo()
    assert result.returncode == 1, result.stderr
    mul_line, placed_line = _line_of("k *= -args.kl_coef"), _line_of('rollout_data["kl"] = kl')
    err = result.stderr
    assert f"rollout_data['kl'][0] was modified in place by aten.mul_.Tensor at ppo_kl_bug.py:{mul_line}" in err
    assert f"placed   ppo_kl_bug.py:{placed_line}" in err
    assert "16/16 elements changed" in err and "sign flips" in err
    assert "\x1b[" not in err, "no colour codes when stderr is not a terminal"
    assert "kvguard caught 8 in-place writes to rollout_data." in result.stdout
    if os.environ.get("CI"):  # CI has a compiler: the demo runs at full speed on every torch CI tests
        assert "engine is not available" not in err, err


def test_fixed_variant_is_clean() -> None:
    result = run_demo("--fixed")
    assert result.returncode == 0, result.stderr
    assert "no in-place writes" in result.stdout and result.stderr == ""


def test_raise_variant_stops_at_the_first_write() -> None:
    result = run_demo("--action", "raise")
    assert result.returncode == 1
    assert result.stderr.startswith("kvguard.MutationError: rollout_data['kl'][0] would be modified in place")
    assert "raised before the write; the data is intact" in result.stderr

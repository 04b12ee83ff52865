"""The real-model benchmark of record (`benchmarks/bench_real_models.py`) runs, CI-sized, and prints its table.

Timings are not checked (this box and CI runners are shared and noisy); the figures are in
`benchmarks/README.md`. One configuration (transformers GPT-2), one round, two timed steps:
plain and both targets under raise and under warn (the others, autograd or weights alone, are
their subsets), each in its own process switched on from the environment, as a user's job is.
Slow tier: each process imports torch and transformers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_real_models.py"
CONTENDERS = ["raise", "warn"]
RATIO = re.compile(r"^\d+\.\d\d$")

pytestmark = pytest.mark.slow


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, check=False)


def _table(out: str) -> tuple[list[str], dict[str, list[str]]]:
    lines = out.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("|---")]
    header = [c.strip() for c in lines[at - 1].strip("|").split("|")]
    rows = {}
    for line in lines[at + 1:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells
    return header, rows


def test_it_runs_one_configuration_and_prints_every_contenders_ratio() -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers==5.25.0)")
    proc = _run("--configs", "gpt2", "--rounds", "1", "--steps", "2", "--contenders", ",".join(CONTENDERS))
    assert proc.returncode == 0, proc.stderr[-4000:]
    header, rows = _table(proc.stdout)
    assert header[:4] == ["configuration", "params", "saved/step", "plain ms/step"]
    assert header[4:6] == CONTENDERS and not {"autograd", "weights"} & set(header)
    row = rows["transformers GPT-2, AdamW"]
    for cell in row[4:6]:
        assert RATIO.match(cell), row
    assert int(row[1]) > 0 and int(row[2]) > 0  # parameter tensors, tensors autograd saved per step
    assert row[-1] == "yes"  # every guarded process's losses bitwise equal to plain's
    assert "reported writes" not in proc.stdout  # a clean model's training raises nothing, warns nothing


def test_the_profile_names_kvguards_functions() -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers==5.25.0)")
    proc = _run("--profile", "gpt2", "--targets", "autograd", "--steps", "2", "--top", "5")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "of it in kvguard's own Python functions" in proc.stdout
    assert re.search(r"^\s*\d+\.\d{4}\s+\d+\.\d{4}\s+\d+\s+kvguard/", proc.stdout, re.MULTILINE), proc.stdout

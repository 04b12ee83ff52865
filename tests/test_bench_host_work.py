"""The host-work benchmark (`benchmarks/bench_host_work.py`) runs, smoke-sized, and prints its table.

Timings are not checked (the box is shared and noisy; the figures are in `benchmarks/README.md`):
that every event has a row per contender, each a number. Slow tier: every contender of every
round runs in a forked child, and the first one builds a tiny C extension.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_host_work.py"

pytestmark = pytest.mark.slow


def test_it_prints_every_event_for_every_contender() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--rounds", "1", "--impls", "adamw,fused"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| event")]
    seen = {(row[0], row[1]) for row in rows}
    for contender in ("off", "idle", "autograd", "weights", "data", "all"):
        assert ("in-place op, unprotected tensor", contender) in seen, seen
    for contender in ("off", "idle", "py hooks", "autograd", "all"):
        assert ("saved tensor (sin chain + backward)", contender) in seen, seen
    for impl in ("adamw", "fused"):
        for contender in ("off", "idle", "weights", "all"):
            assert (f"optimizer parameter, {impl} step", contender) in seen, seen
    for row in rows:
        float(row[2])  # µs per event
        assert row[3] == "—" or float(row[3]) == float(row[3]), row  # µs added

"""The overhead benchmark runs, and the guard stays in a (loose) budget on the hot path.

The real budget is guard/empty <= 1.15 (`benchmarks/bench_overhead.py --check`, figures in
`benchmarks/README.md`). CI asserts a looser bound, see `CI_BOUND`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_overhead.py"

# Deliberately looser than the 1.15 budget: CI runners and this 2-core shared box are
# noisy (other processes, frequency changes, few repetitions to keep the suite fast), and
# a quick run has smaller workloads, so the fixed cost of entering a guard weighs more.
# A quick run of the write-heavy `micro` loop measured 1.2-1.55 on this box. The bound
# catches a hot-path regression (a stack capture or an O(tensors) scan per op costs 3x and
# more), not a few percent; the 1.15 figure is the full benchmark's (benchmarks/README.md).
CI_BOUND = 2.0


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_overhead", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_smoke_prints_the_table():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--rounds", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "guard/empty" in out and "empty/none" in out and "<= 1.15" in out, out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["micro"], ["gae"])]
    assert [r[0] for r in rows] == ["micro", "gae"], out
    for row in rows:
        assert row[-1] in ("PASS", "FAIL"), row
        float(row[6])  # guard/empty is a number


def test_guard_overhead_within_loose_ci_bound():
    bench = _load_bench()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = bench.run(rounds=9, quick=True)
    finally:
        torch.set_num_threads(threads)
    table = bench.format_table(results)
    for res in results:
        assert res["guard_over_empty"] < CI_BOUND, (
            f"{res['workload']}: guard/empty {res['guard_over_empty']:.3f} >= {CI_BOUND} "
            f"(loose CI bound; the real budget is {bench.BUDGET})\n{table}"
        )


def test_check_flag_fails_only_over_budget(monkeypatch, capsys):
    bench = _load_bench()
    threads = torch.get_num_threads()
    try:
        monkeypatch.setattr(bench, "BUDGET", 0.5)  # no mode can be 2x faster than an empty one
        assert bench.main(["--quick", "--rounds", "1"]) == 0
        assert bench.main(["--quick", "--rounds", "1", "--check"]) == 1
    finally:
        torch.set_num_threads(threads)
    assert "FAIL" in capsys.readouterr().out

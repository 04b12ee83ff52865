"""The peer benchmark suite runs at CI size and prints every row and column.

Timings are not checked here (this box and CI runners are shared and noisy); the
realistic-size figures are in `benchmarks/README.md`. The suite runs in a subprocess: it
enters dispatch modes and guards by the hundred, and imports `benchmarks/` as a script.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_suite.py"

RATIO_ROWS = ["adv_ppo_gae", "adv_grpo", "adv_grpo_deep", "adv_reinforce_pp", "adv_wide", "train_adamw_foreach",
              "train_adamw_fused", "micro_reads", "micro_inplace_20", "micro_inplace_100"]
ENTRY_EXIT_ROWS = ["entry_exit_1MB", "entry_exit_100MB", "entry_exit_49t", "entry_exit_1500t"]
CONTENDERS = ["unguarded", "kvguard installed, no guard", "empty mode", "kvguard compiled", "kvguard kernels",
              "kvguard mode", "kvguard compiled, fp off", "kvguard light", "clone + compare", "SchemaCheckMode",
              "DebugMode"]
# a cell: "a" or "a / b" (one figure per repeat), "skip [n]" (cannot run: footnote n), "~x [n]" (one run)
CELL = re.compile(r"^(\d[\d,]*\.?\d*( / \d[\d,]*\.?\d*)*|skip \[\d+\]|~\d[\d,]*\.?\d* \[\d+\])$")


def _run(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def _tables(out: str) -> list[tuple[list[str], dict[str, list[str]]]]:
    """Every Markdown table in `out`: (header cells, {first cell: row cells})."""
    tables: list[tuple[list[str], dict[str, list[str]]]] = []
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|---") and i > 0:
            header = [c.strip() for c in lines[i - 1].strip("|").split("|")]
            rows = {}
            for row in lines[i + 1:]:
                if not row.startswith("|"):
                    break
                cells = [c.strip() for c in row.strip("|").split("|")]
                assert len(cells) == len(header), row
                rows[cells[0]] = cells
            tables.append((header, rows))
    return tables


@pytest.mark.slow
def test_ci_size_prints_every_row_and_column() -> None:
    out = _run("--size", "ci", "--rounds", "1", "--repeats", "1")  # two repeats' cells: the test below
    tables = _tables(out)
    assert len(tables) == 3, out
    (h1, t1), (h2, t2), (h3, t3) = tables
    assert h1[:5] == ["workload", "what", "protected", "ops (writes)", "unguarded ms"], h1
    assert h1[5:] == CONTENDERS[1:], h1
    assert list(t1) == RATIO_ROWS, out
    assert h2[3:] == CONTENDERS and list(t2) == ENTRY_EXIT_ROWS, out
    assert h3[1:] == [c for c in CONTENDERS if c != "clone + compare"] and list(t3) == ENTRY_EXIT_ROWS, out
    for header, rows in tables:
        first = header.index("unguarded ms") if "unguarded ms" in header else (3 if "unit" in header else 1)
        for name, cells in rows.items():
            for col, cell in zip(header[first:], cells[first:]):
                assert CELL.match(cell), f"{name} / {col}: {cell!r}\n{out}"
    # kvguard, the baselines and DebugMode run every workload (SchemaCheckMode cannot run
    # an optimizer step: its footnote says so)
    must_run = ["kvguard installed, no guard", "empty mode", "kvguard compiled", "kvguard kernels", "kvguard mode",
                "kvguard compiled, fp off", "kvguard light", "DebugMode"]
    for header, rows in tables:
        for name, cells in rows.items():
            for col in must_run + ["unguarded ms", "unguarded", "clone + compare"]:
                if col in header:
                    assert "skip" not in cells[header.index(col)], (name, col, out)
    # a skipped cell's footnote says why
    for ref in re.findall(r"skip \[(\d+)\]", out):
        assert re.search(rf"^\[{ref}\] \S+ on \S+: .+", out, re.M), out
    assert "Note: CI size leaves out entry_exit_1GB" in out, out
    assert "1 timed rounds × 1 repeats" in out, out
    assert "`python benchmarks/bench_suite.py --size ci --rounds 1 --repeats 1`" in out, out


@pytest.mark.slow
def test_only_selects_workloads_by_name_or_prefix() -> None:
    out = _run("--size", "ci", "--rounds", "1", "--repeats", "2", "--only", "micro_reads,entry_exit_49")
    tables = _tables(out)
    assert [list(rows) for _, rows in tables] == [["micro_reads"], ["entry_exit_49t"], ["entry_exit_49t"]], out
    cell = tables[0][1]["micro_reads"][tables[0][0].index("kvguard compiled")]
    assert re.match(r"^\d+\.\d+ / \d+\.\d+$", cell), cell  # two repeats: a figure each


def test_size_lists_and_workload_sets() -> None:
    spec = importlib.util.spec_from_file_location("bench_suite", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_suite"] = bench  # dataclasses look their module up there
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules["bench_suite"]
    ci, _ = bench.workloads("ci")
    assert [w.name for w in ci] == RATIO_ROWS + ENTRY_EXIT_ROWS
    realistic, _ = bench.workloads("realistic")  # built lazily: nothing allocated here
    names = [w.name for w in realistic]
    assert names[:len(RATIO_ROWS)] == RATIO_ROWS
    assert {"entry_exit_15000t", "entry_exit_100000t"} <= set(names)
    wide = next(w for w in realistic if w.name == "adv_wide")
    assert wide.tensors == 6 * 512 + 1
    assert [h for _, h, _ in bench.CONTENDERS] == CONTENDERS


def test_the_scaling_benchmark_runs_and_prints_a_row_per_size() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_scaling.py"), "--sizes", "49,600",
                           "--rounds", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "compiled" in proc.stderr and not os.environ.get("CI"):
        import pytest

        pytest.skip("the compiled engine is not available here")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert [r[0] for r in rows] == ["49", "600"]
    for _, per_write, per_placement, first_write, later_write, entry_exit, heap, resident in rows:
        float(per_write.replace(",", "")), float(per_placement.replace(",", "")), float(resident.replace(",", ""))
        assert all(float(cell.replace(",", "")) > 0 for cell in (first_write, later_write, entry_exit, heap))


def test_the_depth_benchmark_runs_and_prints_its_row() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_depth.py"), "--tensors", "20",
                           "--rounds", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (row,) = [line.split(" | ") for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert row[0] == "60" and all(float(cell) > 0 for cell in row[1:])


def test_the_autograd_benchmark_runs_and_prints_its_figures() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_autograd.py"), "--quick"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for fragment in ("guard_autograd / empty hooks:", "us per saved tensor", "inside an open guard_autograd",
                     "entering and leaving guard_autograd"):
        assert fragment in proc.stdout, proc.stdout
    assert "saved tensors per step" in proc.stdout and "0 saved tensors per step" not in proc.stdout


def test_the_weights_benchmark_runs_and_prints_its_rows() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_weights.py"), "--quick"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("unguarded", "guard_module"))]
    assert [r[0] for r in rows] == ["unguarded", "guard_module", "guard_module,"] and float(rows[0][-1]) == 1.0

"""`examples/rl_advantages.py` under a real 2-process torchrun on megatron-core's `parallel_state`
(gloo, CPU), kvguard switched on by the environment only: the Megatron section of docs/jobs/torchrun.md.

Each run costs two Megatron imports (seconds each): three runs in all.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

# Found, not imported: importing megatron-core costs each collecting worker 5 CPU-seconds,
# and the tests import it only in their subprocesses.
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is in the ci extra (pip install -e .[ci])", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rl_advantages.py"
TARGET = "rl_pipeline.loss:compute_advantages_and_returns(rollout_data)"
MUL = (EXAMPLE.parent / "rl_pipeline" / "loss.py", "aten.mul_.Tensor")  # k *= -args.kl_coef
ADD = (EXAMPLE.parent / "rl_pipeline" / "loss.py", "aten.add_.Tensor")  # k[-1] += reward


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _line(text: str) -> int:
    source = (EXAMPLE.parent / "rl_pipeline" / "loss.py").read_text().splitlines()
    return next(i for i, line in enumerate(source, 1) if text in line)


def torchrun(reports: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`KVGUARD=warn KVGUARD_TARGETS=... KVGUARD_REPORT_DIR=... torchrun --nproc-per-node 2 rl_advantages.py ARGS`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVGUARD", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC"))}
    env.update(KVGUARD="warn", KVGUARD_TARGETS=TARGET, KVGUARD_REPORT_DIR=str(reports), OMP_NUM_THREADS="1",
               COLUMNS="120")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), str(EXAMPLE), *args]
    if not (Path(sysconfig.get_paths()["purelib"]) / "kvguard.pth").exists():
        command = [sys.executable, "-m", "kvguard", "run", "--", *command]  # a source checkout: no .pth
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def report(reports: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvguard", "report", str(reports), *args],
                          capture_output=True, text=True, timeout=600)


def summaries(reports: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for file in reports.glob("kvguard-rank*.jsonl"):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            if record["record"] == "summary":
                out[record["rank"]] = record
    return out


def sites(summary: dict[str, Any]) -> dict[tuple[Path, str], int]:
    return {(Path(s["filename"]), s["op"]): s["writes"] for s in summary["sites"]}


@pytest.mark.slow
def test_cp2_bug_is_caught_on_both_ranks_with_their_tags(tmp_path: Path) -> None:
    reports = tmp_path / "r"
    result = torchrun(reports, "--cp", "2", "--bug")
    assert "logged KL differs from the policy KL in 4 of 12 steps" in result.stdout  # the bug is real
    for cp in (0, 1):
        assert f"in-place write  rank {cp}/2 tp=0 pp=0 dp=0 cp={cp}" in result.stderr  # each rank's panel

    [run] = json.loads(report(reports, "--json").stdout)["runs"]
    assert run["status"] == "events" and run["ranks"] == [0, 1] and run["calls"] == 24
    rows = {(Path(r["filename"]), r["op"]): r for r in run["rows"]}
    assert rows.keys() == {MUL, ADD}
    assert rows[MUL]["lineno"] == _line("k *= -args.kl_coef") and rows[MUL]["ranks"] == [0, 1]
    assert rows[ADD]["lineno"] == _line("k[-1] += reward") and rows[ADD]["ranks"] == [0]  # cp rank 0 only
    assert rows[MUL]["paths"] == rows[ADD]["paths"] == ["rollout_data['kl'][*]"]
    placed = _line('rollout_data["kl"] = kl')
    assert rows[MUL]["first"]["placed_at"] == f"loss.py:{placed}"
    assert report(reports).returncode == 1

    by_rank = summaries(reports)
    assert {rank: s["tags"] for rank, s in by_rank.items()} == {
        0: {"tp": 0, "pp": 0, "dp": 0, "cp": 0}, 1: {"tp": 0, "pp": 0, "dp": 0, "cp": 1}}
    assert sites(by_rank[0]) == {MUL: 32, ADD: 32}  # 4 PPO steps x 8 samples, both halves of each
    assert sites(by_rank[1]) == {MUL: 32}  # its slice never holds a last token: no reward added
    assert [s["calls"] for s in by_rank.values()] == [12, 12]


@pytest.mark.slow
def test_cp2_fixed_run_is_clean(tmp_path: Path) -> None:
    reports = tmp_path / "r"
    result = torchrun(reports, "--cp", "2")
    assert "logged KL matches the policy KL in all 12 steps" in result.stdout
    for cp in (0, 1):
        assert (f"kvguard [rank {cp}/2 tp=0 pp=0 dp=0 cp={cp}]: rl_pipeline.loss:compute_advantages_and_returns"
                "(rollout_data): 12 guarded calls, 768 tensors protected, no in-place writes") in result.stderr
    table = report(reports)
    assert table.returncode == 0, table.stdout + table.stderr
    assert "(2 ranks): 24 guarded calls, 1,536 tensors protected, clean" in table.stdout
    # The same numbers as one process, unguarded: slicing and gathering keep the math.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD", "RANK", "WORLD_SIZE", "MASTER_"))}
    one = subprocess.run([sys.executable, str(EXAMPLE)], env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=600)
    assert one.returncode == 0 and one.stderr == "", one.stderr
    steps = [line for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(steps) == 12 and steps == [line for line in one.stdout.splitlines() if line.startswith("step")]


@pytest.mark.slow
def test_pp2_first_stage_did_not_run_the_code_and_says_so(tmp_path: Path) -> None:
    reports = tmp_path / "r"
    result = torchrun(reports, "--pp", "2", "--bug")
    stage0 = "not the last pipeline stage: pp=0 of 2"
    target = "rl_pipeline.loss:compute_advantages_and_returns(rollout_data)"
    assert f"kvguard [rank 0/2 tp=0 pp=0 dp=0 cp=0]: {target}: 0 guarded calls, 12 calls not run here ({stage0})" \
        in result.stderr
    assert (f"kvguard [rank 1/2 tp=0 pp=1 dp=0 cp=0]: {target}: 12 guarded calls, 768 tensors protected, "
            "64 writes at 2 sites") in result.stderr
    by_rank = summaries(reports)
    assert (by_rank[0]["calls"], by_rank[0]["not_run"], by_rank[0]["sites"]) == (0, {stage0: 12}, [])
    assert by_rank[0]["targets"][TARGET]["not_run_calls"] == 12
    assert (by_rank[1]["calls"], by_rank[1]["not_run"], sites(by_rank[1])) == (12, {}, {MUL: 32, ADD: 32})
    [run] = json.loads(report(reports, "--json").stdout)["runs"]
    assert run["calls"] == 12 and run["ranks"] == [0, 1]
    assert any("did not run here" in note and stage0 in note for note in run["notes"])


def test_the_readme_runs_these_commands() -> None:
    readme = (ROOT / "docs" / "jobs" / "torchrun.md").read_text()  # the docs page the README links to
    section = readme[readme.index("## Megatron-core"):]
    assert f'export KVGUARD_TARGETS="{TARGET}"' in section
    assert "KVGUARD=warn KVGUARD_REPORT_DIR=r torchrun --nproc-per-node 2 examples/rl_advantages.py --cp 2 --bug" \
        in section
    assert "torchrun --nproc-per-node 2 examples/rl_advantages.py --pp 2 --bug" in section

"""Env-var activation, end to end: a wheel of kvguard in a fresh venv, real subprocesses.

The wheel is built once per session and pip-installed (without dependencies) into a
new virtual environment; torch, wrapt and rich come from the test environment through
a path file, so no multi-GB download is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from processes import free_port, source_copy

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "unchanged_job"
TARGET = "trainer_loss:compute_advantages_and_returns(rollout_data)"


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = source_copy(tmp_path_factory.mktemp("source") / "kvguard")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(source), "-w", str(out)],
                   check=True, capture_output=True)
    (whl,) = out.glob("kvguard-*.whl")
    return whl


@pytest.fixture(scope="session")
def venv_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--ignore-installed", str(wheel)], check=True, capture_output=True)
    # Dependencies from this environment, added after the install (pip must not see the
    # kvguard this environment may hold); sorts before kvguard.pth, so it is on the path first.
    (site / "00-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    assert (site / "kvguard.pth").exists() and (site / "kvguard" / "__init__.py").exists()
    return python


def run(python: Path, *args: str, env: dict[str, str] | None = None, cwd: Path = DATA,
        check_rc: int | None = 0) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    base.pop("PYTHONPATH", None)
    base["PYTHONPATH"] = str(DATA)
    base["COLUMNS"] = "120"
    result = subprocess.run([str(python), *args], env={**base, **(env or {})}, cwd=cwd,
                            capture_output=True, text=True, timeout=180)
    if check_rc is not None:
        assert result.returncode == check_rc, result.stdout + result.stderr
    return result


def test_wheel_ships_pth_and_start_files(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvguard.pth" in names and "kvguard.start" in names
    text = zipfile.ZipFile(wheel).read("kvguard.pth").decode()
    assert text.count("\n") == 1 and text.startswith("import os")


def test_unset_is_inert_and_imports_nothing(venv_python: Path) -> None:
    result = run(venv_python, "train.py")
    assert "preloaded: \n" in result.stdout  # neither torch, wrapt nor kvguard
    assert "kl intact: False" in result.stdout  # the bug, unnoticed
    assert result.stderr == ""


def test_zero_is_off(venv_python: Path) -> None:
    result = run(venv_python, "train.py", env={"KVGUARD": "0", "KVGUARD_TARGETS": TARGET})
    assert "kl intact: False" in result.stdout and result.stderr == ""


def test_warn_guards_every_call_and_prints_summary(venv_python: Path) -> None:
    result = run(venv_python, "train.py", env={"KVGUARD": "warn", "KVGUARD_TARGETS": TARGET})
    assert result.stdout.splitlines()[0] == "preloaded: wrapt,kvguard"  # activation does not import torch
    assert "kl intact: False" in result.stdout and "train done" in result.stdout
    assert "rollout_data['kl'][0] was modified in place by aten.mul_.Tensor at trainer_loss.py:10" in result.stderr
    assert "placed   trainer_loss.py:8" in result.stderr
    assert result.stderr.count("in-place write") == 1  # one panel per site, the rest counted
    assert "MutationWarning" not in result.stderr  # the panel is the one report: no default warning display
    assert result.stderr.endswith(
        f"kvguard: {TARGET}: 2 guarded calls, 12 tensors protected, 4 writes at 1 site\n"
        "  trainer_loss.py:10 aten.mul_.Tensor: 4 writes to rollout_data['kl'][*] in 2 calls "
        "(first: rollout_data['kl'][0], call 1)\n")


def test_raise_stops_the_job_with_data_intact(venv_python: Path) -> None:
    result = run(venv_python, "train.py", env={"KVGUARD": "raise", "KVGUARD_TARGETS": TARGET},
                 check_rc=1)
    assert "kvguard.MutationError: rollout_data['kl'][0] would be modified in place" in result.stderr
    assert "kl intact" not in result.stdout


def test_method_target(venv_python: Path) -> None:
    result = run(venv_python, "train.py", "--method",
                 env={"KVGUARD": "record", "KVGUARD_TARGETS": "trainer_loss:Trainer.step(rollout_data)"})
    assert ("kvguard: trainer_loss:Trainer.step(rollout_data): 1 guarded call, 4 tensors protected, "
            "1 write at 1 site\n") in result.stderr


@pytest.mark.parametrize("env, message", [
    ({"KVGUARD": "rase"}, "invalid action 'rase' from the KVGUARD environment variable"),
    ({"KVGUARD": "warn", "KVGUARD_TARGETS": "trainer_loss.compute"},
     "invalid target 'trainer_loss.compute' in the KVGUARD_TARGETS environment variable"),
])
def test_bad_values_give_one_line_and_the_job_runs(venv_python: Path, env: dict[str, str], message: str) -> None:
    result = run(venv_python, "train.py", env=env)
    assert "train done" in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith("kvguard")]
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_hook_failure_never_breaks_the_import(venv_python: Path) -> None:
    result = run(venv_python, "train.py",
                 env={"KVGUARD": "warn", "KVGUARD_TARGETS": "trainer_loss:no_such_fn(rollout_data),"
                      "trainer_loss:compute_advantages_and_returns(nope)"})
    assert "train done" in result.stdout
    assert "kvguard: cannot guard trainer_loss:no_such_fn(rollout_data)" in result.stderr
    assert "has no parameter 'nope'" in result.stderr


def test_report_dir_and_report_command(venv_python: Path, tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    run(venv_python, "train.py",
        env={"KVGUARD": "record", "KVGUARD_TARGETS": TARGET, "KVGUARD_REPORT_DIR": str(reports)})
    records = [json.loads(line) for line in (reports / "kvguard-rank0.jsonl").read_text().splitlines()]
    assert [r["record"] for r in records] == ["header", "event", "event", "event", "event", "summary"]
    record = records[1]
    assert record["path"] == "rollout_data['kl'][0]" and record["op"] == "aten.mul_.Tensor"
    assert record["target"] == TARGET and record["lineno"] == 10 and record["code"] == "k *= 0.1"
    assert {"schema", "run", "rank", "pid", "host", "time", "call", "placed_at", "before", "after", "diff"} <= set(record)
    assert records[-1]["writes"] == 4 and records[-1]["calls"] == 2
    table = run(venv_python, "-m", "kvguard", "report", str(reports), check_rc=1)
    assert "rollout_data['kl'][*]" in table.stdout and "trainer_loss.py:10" in table.stdout
    clean = tmp_path / "clean"
    clean.mkdir()
    nothing = run(venv_python, "-m", "kvguard", "report", str(clean), check_rc=2)
    assert nothing.stderr == f"kvguard: no kvguard report records in {clean}\n"
    missing = run(venv_python, "-m", "kvguard", "report", str(tmp_path / "nope"), check_rc=2)
    assert "no kvguard report file or directory" in missing.stderr


def test_torchrun_two_ranks_write_per_rank_files(venv_python: Path, tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    result = run(venv_python, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-port", str(free_port()), "train_dist.py",
                 env={"KVGUARD": "warn", "KVGUARD_TARGETS": TARGET, "KVGUARD_REPORT_DIR": str(reports),
                      "OMP_NUM_THREADS": "1"})
    runs = set()
    for rank in (0, 1):
        records = [json.loads(line) for line in (reports / f"kvguard-rank{rank}.jsonl").read_text().splitlines()]
        assert [r["record"] for r in records] == ["header", "event", "event", "summary"]
        assert {r["rank"] for r in records} == {rank}
        assert records[0]["world_size"] == records[-1]["world_size"] == 2
        runs |= {r["run"] for r in records}
        assert (f"kvguard [rank {rank}/2]: {TARGET}: 1 guarded call, 6 tensors protected, 2 writes at 1 site"
                in result.stderr)
        assert f"in-place write  rank {rank}/2" in result.stderr
    assert len(runs) == 1  # one launch, one run id on every rank
    table = run(venv_python, "-m", "kvguard", "report", str(reports), check_rc=1)
    assert table.stdout.startswith(f"kvguard: run {runs.pop()} (2 ranks): 2 guarded calls, 12 tensors protected, "
                                   f"4 writes at 1 site\n  {TARGET}: 2 guarded calls, 12 tensors protected, 4 writes\n")
    assert "0-1" in table.stdout  # the ranks column


def test_run_command_works_from_a_source_checkout(tmp_path: Path) -> None:
    """`python -m kvguard run` needs no .pth: the editable / source-checkout route."""
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{DATA}", "KVGUARD_TARGETS": TARGET}
    result = run(Path(sys.executable), "-m", "kvguard", "run", "--action", "record", "--",
                 sys.executable, "train.py", env=env)
    assert "kl intact: False" in result.stdout
    assert f"kvguard: {TARGET}: 2 guarded calls, 12 tensors protected, 4 writes at 1 site\n" in result.stderr


def test_readme_says_at_the_top_of_the_env_section_that_a_checkout_is_silent() -> None:
    readme = (ROOT / "docs" / "jobs" / "activation.md").read_text()  # the docs page the README links to
    section = readme[readme.index("# Switching it on in a job"):]
    first = section.split("\n\n")[1]  # the first paragraph under the heading: before any example or table
    assert "source checkout on `PYTHONPATH`" in first and "silent by nature" in first
    assert "python -m kvguard run" in first and "python -m kvguard install-pth" in first  # the fix, right there


def test_a_checkout_without_a_pth_is_silent_and_kvguard_run_is_the_fix(tmp_path: Path) -> None:
    """What the README's warning says: with no kvguard.pth nothing of kvguard runs, nor says so."""
    home = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # torch and the rest as a plain path: the .pth files next to them are not processed.
    (Path(purelib) / "00-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD", "PYTHON"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(DATA)]), KVGUARD="raise", KVGUARD_TARGETS=TARGET)
    code = ("import trainer_loss; trainer_loss.compute_advantages_and_returns(None, trainer_loss.make_rollout()); "
            "print('ran')")
    silent = subprocess.run([str(python), "-c", code], cwd=DATA, env=env, capture_output=True, text=True, timeout=300)
    assert (silent.returncode, silent.stdout, silent.stderr) == (0, "ran\n", "")  # the write went unguarded
    fixed = subprocess.run([str(python), "-m", "kvguard", "run", "--", str(python), "-c", code], cwd=DATA, env=env,
                           capture_output=True, text=True, timeout=300)
    assert fixed.returncode == 1 and "kvguard.MutationError: rollout_data['kl'][0] would be modified" in fixed.stderr


# ── the names older installs call ──────────────────────────────────────────────────────────

OLD_PTH_LINE = (  # what kvguard 0.2's `install-pth` wrote into site-packages, where it stays
    "import os, sys; exec('try:\\n import kvguard._startup as m; m.activate()\\n"
    "except Exception as e: sys.stderr.write(\"kvguard: not activated: %r\\\\n\" % (e,))')"
    " if os.environ.get('KVGUARD', '').strip() not in ('', '0') else None\n"
)


def test_an_older_pth_line_still_activates(tmp_path: Path) -> None:
    (tmp_path / "old.pth").write_text(OLD_PTH_LINE)
    code = ("import site, sys; site.addsitedir(sys.argv[1]); import kvguard._state as s; "
            "print(s.STATE.started, s.STATE.settings.action)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env={**env, "KVGUARD": "warn"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "warn"], result.stderr
    assert "not activated" not in result.stderr

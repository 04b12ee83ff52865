"""Settings mean the same everywhere: every `KVGUARD_*` guard setting is the default of every guard.

`guard()`, `guarded`, env targets, the pytest plugin's guards and `guard_schedule` take
each option they were not given from its variable, else their built-in default; an
argument given in code wins. A bad value is a `ConfigError` naming the variable for
guards made in code, and one "not activated" line for env activation. Env activation
runs in real subprocesses; the rest in this process, with `monkeypatch` for the variables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import kvguard
from kvguard import _config
from kvguard._config import GUARD_VARIABLES

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an environment without guard settings (the engine fixture's aside)."""
    for name in GUARD_VARIABLES:
        if name != "KVGUARD_ENGINE":
            monkeypatch.delenv(name, raising=False)


def rollout() -> dict[str, Any]:
    return {"kl": torch.ones(3), "log_probs": torch.ones(3)}


def write_both(rd: dict[str, Any], **options: Any) -> kvguard.Guard:
    with kvguard.guard(rd, name="rd", action="record", **options) as g:
        rd["kl"].mul_(2)
        rd["log_probs"].add_(1)
    return g


def paths(g: kvguard.Guard) -> list[str]:
    return [e.path for e in g.report.events]


# -- each variable is the default of guard(), and an argument wins ---------------------------

def test_keys_and_ignore_apply_to_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGUARD_KEYS", "kl")
    assert paths(write_both(rollout())) == ["rd['kl']"]
    assert paths(write_both(rollout(), keys=["log_probs"])) == ["rd['log_probs']"]  # the argument wins
    monkeypatch.delenv("KVGUARD_KEYS")
    monkeypatch.setenv("KVGUARD_IGNORE", "kl")
    assert paths(write_both(rollout())) == ["rd['log_probs']"]
    assert paths(write_both(rollout(), ignore=())) == ["rd['kl']", "rd['log_probs']"]  # explicitly nothing


def test_allow_applies_to_guard_and_an_empty_argument_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGUARD_ALLOW", "rd['kl']")
    rd = rollout()
    with kvguard.guard(rd, name="rd", action="raise") as g:
        rd["kl"].mul_(2)  # allowed by the variable: happens, even under raise
    assert g.report.allowed == {"allow=rd['kl']": 1} and rd["kl"].tolist() == [2.0] * 3
    with pytest.raises(kvguard.MutationError):
        with kvguard.guard(rd, name="rd", action="raise", allow=()):
            rd["kl"].mul_(2)


def test_level_applies_to_guard_and_the_argument_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGUARD_LEVEL", " Light ")
    g = kvguard.guard(rollout(), name="rd")
    assert g.level == "light"
    assert kvguard.guard(rollout(), name="rd", level="full").level == "full"
    rd = rollout()
    with pytest.raises(kvguard.MutationError, match="level='light'"):  # found at exit, not at the op
        with kvguard.guard(rd, name="rd"):
            rd["kl"].mul_(2)


def test_fingerprint_applies_to_guard_and_the_argument_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGUARD_FINGERPRINT", "OFF")
    assert kvguard.guard(rollout(), name="rd").fingerprint is False
    assert kvguard.guard(rollout(), name="rd", fingerprint=True).fingerprint is True
    monkeypatch.setenv("KVGUARD_FINGERPRINT", "yes")
    assert kvguard.guard(rollout(), name="rd").fingerprint is True


def test_light_with_fingerprints_off_names_where_each_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGUARD_LEVEL", "light")
    with pytest.raises(kvguard.ConfigError, match=r"cannot run with fingerprint=False \(level='light' from "
                                                  r"KVGUARD_LEVEL\)"):
        kvguard.guard(rollout(), name="rd", fingerprint=False)
    assert kvguard.guard(rollout(), name="rd", level="full", fingerprint=False).fingerprint is False


def test_max_events_and_report_dir_apply_to_guard(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVGUARD_MAX_EVENTS", "1")
    monkeypatch.setenv("KVGUARD_REPORT_DIR", str(tmp_path / "env"))
    g = write_both(rollout())
    assert (len(g.report.events), g.report.cut) == (1, 1)
    assert g.report_dir == str(tmp_path / "env")
    assert write_both(rollout(), report_dir=tmp_path / "arg").report_dir == str(tmp_path / "arg")


def test_engine_applies_to_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGUARD_ENGINE", "Mode")
    rd = rollout()
    with kvguard.guard(rd, name="rd", action="record") as g:
        rd["kl"].mul_(2)
    assert g.engine == "mode" and paths(g) == ["rd['kl']"]


def test_keys_from_the_variable_that_never_appear_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGUARD_KEYS", "kll")
    with pytest.warns(kvguard.GuardWarning, match=r"kvguard.guard\(rd, KVGUARD_KEYS\): 'kll' never appeared"):
        write_both(rollout())


def test_a_changed_variable_is_read_by_the_next_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kvguard.guard(rollout(), name="rd").level == "full"
    monkeypatch.setenv("KVGUARD_LEVEL", "light")
    assert kvguard.guard(rollout(), name="rd").level == "light"
    monkeypatch.setenv("KVGUARD_LEVEL", "full")
    assert kvguard.guard(rollout(), name="rd").level == "full"


# -- a bad value is a ConfigError naming the variable -----------------------------------------

@pytest.mark.parametrize("name, value, message", [
    ("KVGUARD_LEVEL", "fast", "invalid level 'fast' from the KVGUARD_LEVEL environment variable"),
    ("KVGUARD_FINGERPRINT", "maybe", "invalid value 'maybe' in the KVGUARD_FINGERPRINT environment variable"),
    ("KVGUARD_ENGINE", "turbo", "invalid engine 'turbo' in the KVGUARD_ENGINE environment variable"),
    ("KVGUARD_MAX_EVENTS", "-1", "invalid event cap '-1' in the KVGUARD_MAX_EVENTS environment variable"),
    ("KVGUARD_CALLS", "first", "invalid call selection 'first' in the KVGUARD_CALLS environment variable"),
    ("KVGUARD_ALLOW", "rd['kl'", "invalid allow pattern \"rd['kl'\" in the KVGUARD_ALLOW environment variable"),
])
def test_a_bad_variable_is_a_config_error_naming_it(monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                                                    message: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(kvguard.ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        kvguard.guard(rollout(), name="rd")
    with pytest.raises(kvguard.ConfigError, match=name):  # an argument for some other option changes nothing
        kvguard.guard(rollout(), name="rd", level="full", fingerprint=True, allow=(), keys=["kl"], ignore=())


def test_light_level_and_fingerprints_off_in_the_environment_is_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGUARD_LEVEL", "light")
    monkeypatch.setenv("KVGUARD_FINGERPRINT", "0")
    with pytest.raises(kvguard.ConfigError, match="KVGUARD_LEVEL=light .* KVGUARD_FINGERPRINT=0"):
        kvguard.guard(rollout(), name="rd")


# -- guarded and guard_schedule ------------------------------------------------------------

def test_guarded_takes_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    @kvguard.guarded("rd", action="raise")
    def shape(rd: dict[str, Any]) -> None:
        rd["kl"].mul_(2)

    monkeypatch.setenv("KVGUARD_ALLOW", "rd['kl']")
    shape(rollout())
    assert shape.last_report.allowed == {"allow=rd['kl']": 1}  # type: ignore[attr-defined]
    monkeypatch.delenv("KVGUARD_ALLOW")
    with pytest.raises(kvguard.MutationError):
        shape(rollout())


def test_guarded_follows_kvguard_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvguard._report.process import PROCESS

    monkeypatch.setenv("KVGUARD_CALLS", "every:2")

    @kvguard.guarded("rd", name="calls_rd", action="record")
    def shape(rd: dict[str, Any]) -> None:
        rd["kl"].mul_(2)

    seen = []
    for _ in range(4):
        shape(rollout())
        seen.append(len(shape.last_report.events) if shape.last_report else 0)  # type: ignore[attr-defined]
    stats = PROCESS.tally.targets["calls_rd"]
    assert (stats.calls, stats.unguarded_calls) == (2, 2)


def test_guard_schedule_takes_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvguard_megatron import guard_schedule

    def schedule() -> list[dict[str, torch.Tensor]]:
        return [{"lm loss": torch.ones(2)}]

    assert guard_schedule(schedule).level == "light"  # its own default
    monkeypatch.setenv("KVGUARD_LEVEL", "full")
    assert guard_schedule(schedule).level == "full"  # the setting
    assert guard_schedule(schedule, level="light").level == "light"  # the argument
    monkeypatch.setenv("KVGUARD_ALLOW", "losses_reduced[*]['lm loss']")
    fn = guard_schedule(schedule, action="raise")
    losses = fn()
    losses[0]["lm loss"].mul_(2)  # allowed by the variable
    (report,) = fn.release()
    assert report.ok and report.allowed == {"allow=losses_reduced[*]['lm loss']": 1}


# -- the pytest plugin's guards ------------------------------------------------------------

def test_pytest_plugin_guards_take_the_settings(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_it=textwrap.dedent("""
        import pytest, torch

        def test_fixture(mutation_guard):
            rd = {"kl": torch.ones(2), "log_probs": torch.ones(2)}
            g = mutation_guard.protect(rd, name="rd")
            rd["kl"].mul_(2)                 # ignored by KVGUARD_IGNORE
            rd["log_probs"].add_(1)          # allowed by KVGUARD_ALLOW
            assert g.level == "full" and g.report.allowed == {"allow=rd['log_probs']": 1}

        @pytest.mark.kvguard(arg="rd")
        def test_marker(rd):
            rd["kl"].mul_(2)
            rd["log_probs"].add_(1)

        @pytest.fixture
        def rd():
            return {"kl": torch.ones(2), "log_probs": torch.ones(2)}
    """))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--kvguard=raise")
    assert result.ret != 0  # without the settings both tests fail at the first write
    env = {"KVGUARD_IGNORE": "kl", "KVGUARD_ALLOW": "rd['log_probs']"}
    for name, value in env.items():
        pytester._monkeypatch.setenv(name, value)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--kvguard=raise")
    result.assert_outcomes(passed=2)


# -- env activation: the settings apply to guards made in code too; bad values ---------------

def run_job(tmp_path: Path, code: str, *, through_run: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    """The job under `python -m kvguard run`, or (`through_run=False`) activated by this venv's kvguard.pth."""
    (tmp_path / "rlloss.py").write_text("def shape(rollout_data):\n    rollout_data['kl'].mul_(2)\n")
    (tmp_path / "job.py").write_text(textwrap.dedent(code))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD", "PYTHON"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path)])
    launcher = [sys.executable, "-m", "kvguard", "run", "--"] if through_run else []
    return subprocess.run([*launcher, sys.executable, "job.py"], env={**base, **env}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_env_settings_apply_to_targets_and_to_guards_in_code_alike(tmp_path: Path) -> None:
    result = run_job(tmp_path, """
        import torch, kvguard, rlloss
        rd = {"kl": torch.ones(2), "log_probs": torch.ones(2)}
        rlloss.shape(rd)                                   # an env target
        with kvguard.guard(rd, name="rollout_data") as g:  # a guard in code, action raise
            rd["kl"].mul_(2)
        print("level", g.level, "allowed", g.report.allowed)
    """, KVGUARD="raise", KVGUARD_TARGETS="rlloss:shape(rollout_data)", KVGUARD_LEVEL="full",
        KVGUARD_ALLOW="rollout_data['kl']")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "level full allowed {\"allow=rollout_data['kl']\": 1}\n"
    assert "rlloss:shape(rollout_data): 1 guarded call, 2 tensors protected, no in-place writes, 1 allowed" \
        in result.stderr


@pytest.mark.parametrize("name, value", [("KVGUARD_ENGINE", "turbo"), ("KVGUARD_FINGERPRINT", "maybe"),
                                         ("KVGUARD_LEVEL", "fast"), ("KVGUARD_MAX_EVENTS", "many")])
def test_a_bad_variable_is_one_not_activated_line_and_the_job_runs(tmp_path: Path, name: str, value: str) -> None:
    code = """
        import torch, rlloss
        rlloss.shape({"kl": torch.ones(2)})
        print("done")
    """
    env = {"KVGUARD": "raise", "KVGUARD_TARGETS": "rlloss:shape(rollout_data)", name: value}
    activated = run_job(tmp_path, code, through_run=False, **env)  # the .pth route: the job runs, unguarded
    assert activated.returncode == 0 and activated.stdout == "done\n", activated.stderr
    (line,) = activated.stderr.splitlines()
    assert line.startswith("kvguard: not activated: invalid ") and name in line
    launched = run_job(tmp_path, code, **env)  # `kvguard run` refuses before the job starts, in one line
    assert (launched.returncode, launched.stdout) == (2, "")
    assert launched.stderr == line.replace("not activated: ", "") + "\n"


def test_kvguard_commands_are_not_the_job(tmp_path: Path) -> None:
    """With KVGUARD exported, `python -m kvguard report` prints no exit summary of its own."""
    result = run_job(tmp_path, "", through_run=False, KVGUARD="warn", KVGUARD_TARGETS="rlloss:shape(rollout_data)")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD", "PYTHON"))}
    for command in (["-m", "kvguard", "report", str(tmp_path)], ["-W", "error", "-m", "kvguard", "--version"]):
        result = subprocess.run([sys.executable, *command], env={**base, "KVGUARD": "warn", "PYTHONPATH": str(ROOT),
                                "KVGUARD_TARGETS": "rlloss:shape(rollout_data)"}, capture_output=True, text=True,
                                timeout=120)
        assert "guarded call" not in result.stderr and "never imported" not in result.stderr, result.stderr


def test_a_target_keeps_the_settings_it_started_with(tmp_path: Path) -> None:
    """A variable changed by the job after start-up cannot fail the guarded call deep inside it."""
    result = run_job(tmp_path, """
        import os, torch, rlloss
        os.environ["KVGUARD_LEVEL"] = "bogus"
        try:
            rlloss.shape({"kl": torch.ones(2)})
        except Exception as exc:
            print(type(exc).__name__)
    """, KVGUARD="raise", KVGUARD_TARGETS="rlloss:shape(rollout_data)")
    assert result.stdout == "MutationError\n", result.stderr


def test_header_records_the_settings(tmp_path: Path) -> None:
    result = run_job(tmp_path, """
        import torch, rlloss
        rlloss.shape({"kl": torch.ones(2), "x": torch.ones(1)})
    """, KVGUARD="record", KVGUARD_TARGETS="rlloss:shape(rollout_data)", KVGUARD_REPORT_DIR=str(tmp_path / "r"),
        KVGUARD_IGNORE="x", KVGUARD_LEVEL="FULL")
    assert result.returncode == 0, result.stderr
    header = json.loads((tmp_path / "r" / "kvguard-rank0.jsonl").read_text().splitlines()[0])
    assert header["settings"]["ignore"] == ["x"] and header["settings"]["level"] == "full"


def test_guard_defaults_reads_each_variable_once_per_change(monkeypatch: pytest.MonkeyPatch) -> None:
    first = _config.guard_defaults()
    assert _config.guard_defaults() is first
    monkeypatch.setenv("KVGUARD_KEYS", " kl , log_probs ,")
    assert _config.guard_defaults().keys == ("kl", "log_probs")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _config.guard_defaults(environ={}).keys is None  # an environment given is read as given

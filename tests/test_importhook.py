"""Late activation: targets already imported, names other modules imported, and undo.

Each case runs in a fresh interpreter: import hooks are process-global.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvguard import _config
from kvguard._errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "examples" / "unchanged_job"


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    full_env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{JOB}", COLUMNS="120", **env)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_already_imported_target_and_its_aliases_are_guarded_then_restored() -> None:
    result = run_python("""
        import trainer_actor, trainer_loss
        from trainer_loss import compute_advantages_and_returns as alias
        kept = [trainer_loss.compute_advantages_and_returns]  # not a module global: never rebound
        from kvguard import _config, _importhook
        from kvguard._state import STATE
        _importhook.install(_config.parse_targets("trainer_loss:compute_advantages_and_returns(rollout_data)"),
                            "record")
        assert trainer_loss.compute_advantages_and_returns is not kept[0]
        assert trainer_actor.compute_advantages_and_returns is trainer_loss.compute_advantages_and_returns
        assert alias is trainer_loss.compute_advantages_and_returns, "module-level aliases are rebound"
        trainer_actor.compute_advantages_and_returns(None, trainer_loss.make_rollout())
        print("events", STATE.tally.writes, "calls", STATE.tally.calls)
        STATE.uninstall()
        assert trainer_loss.compute_advantages_and_returns is kept[0]
        assert trainer_actor.compute_advantages_and_returns is kept[0] and alias is kept[0]
        print("restored")
    """)
    assert "events 2 calls 1" in result.stdout and "restored" in result.stdout


def test_keys_and_ignore_from_the_environment() -> None:
    code = """
        import kvguard._startup; kvguard._startup.activate()
        import torch, trainer_loss
        from kvguard._state import STATE
        rd = trainer_loss.make_rollout()
        trainer_loss.compute_advantages_and_returns(None, rd)
        print("events", STATE.tally.writes)
    """
    target = "trainer_loss:compute_advantages_and_returns(rollout_data)"
    assert "events 2" in run_python(code, KVGUARD="record", KVGUARD_TARGETS=target).stdout
    assert "events 0" in run_python(code, KVGUARD="record", KVGUARD_TARGETS=target, KVGUARD_IGNORE="kl").stdout
    assert "events 0" in run_python(code, KVGUARD="record", KVGUARD_TARGETS=target,
                                    KVGUARD_KEYS="log_probs, ref_log_probs").stdout


def test_startup_is_idempotent() -> None:
    result = run_python("""
        import kvguard._startup as s
        s.activate(); s.activate()
        from kvguard._state import STATE
        import trainer_loss
        trainer_loss.compute_advantages_and_returns(None, trainer_loss.make_rollout())
        print("calls", STATE.tally.calls)
    """, KVGUARD="record", KVGUARD_TARGETS="trainer_loss:compute_advantages_and_returns(rollout_data)")
    assert "calls 1" in result.stdout
    assert result.stderr.count("guarded call") == 1


@pytest.mark.parametrize("value, expected", [
    ("", "off"), ("0", "off"), ("1", "warn"), ("warn", "warn"), ("RAISE", "raise"), ("record", "record"),
])
def test_action_spellings(value: str, expected: str) -> None:
    assert _config.parse_action(value, "KVGUARD") == expected


def test_targets_syntax() -> None:
    (t,) = _config.parse_targets("myrl.loss:Trainer.step(rollout_data)")
    assert (t.module, t.qualname, t.argname) == ("myrl.loss", "Trainer.step", "rollout_data")
    assert len(_config.parse_targets("a:f(x), b.c:g(y),")) == 2
    with pytest.raises(ConfigError, match="invalid target 'a.f' in the KVGUARD_TARGETS environment variable"):
        _config.parse_targets("a.f")


def test_install_pth_writes_the_same_line_the_wheel_ships(tmp_path: Path) -> None:
    from kvguard import _pth

    path = _pth.install(str(tmp_path))
    assert Path(path).read_text() == _pth.PTH_LINE
    assert _pth.uninstall(str(tmp_path)) == path and not Path(path).exists()
    assert _pth.uninstall(str(tmp_path)) is None


def test_pth_line_is_inert_without_kvguard_and_one_line_on_failure() -> None:
    from kvguard import _pth

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    off = subprocess.run([sys.executable, "-S", "-c", _pth.PTH_LINE], env=env, capture_output=True, text=True)
    assert off.returncode == 0 and off.stderr == ""
    # kvguard not importable: one line on stderr, the interpreter goes on
    broken = subprocess.run([sys.executable, "-S", "-I", "-c", _pth.PTH_LINE + "print('went on')"],
                            env={**env, "KVGUARD": "warn"}, capture_output=True, text=True)
    assert broken.stdout == "went on\n"
    assert broken.stderr.startswith("kvguard: not activated: ModuleNotFoundError") and broken.stderr.count("\n") == 1

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
        from kvguard import _config
        from kvguard._activate import importhook as _importhook
        from kvguard._state import STATE
        from kvguard._report.process import PROCESS
        _importhook.install(_config.parse_targets("trainer_loss:compute_advantages_and_returns(rollout_data)"),
                            "record")
        assert trainer_loss.compute_advantages_and_returns is not kept[0]
        assert trainer_actor.compute_advantages_and_returns is trainer_loss.compute_advantages_and_returns
        assert alias is trainer_loss.compute_advantages_and_returns, "module-level aliases are rebound"
        trainer_actor.compute_advantages_and_returns(None, trainer_loss.make_rollout())
        print("events", PROCESS.tally.writes, "calls", PROCESS.tally.calls)
        STATE.uninstall()
        assert trainer_loss.compute_advantages_and_returns is kept[0]
        assert trainer_actor.compute_advantages_and_returns is kept[0] and alias is kept[0]
        print("restored")
    """)
    assert "events 2 calls 1" in result.stdout and "restored" in result.stdout


def test_keys_and_ignore_from_the_environment() -> None:
    code = """
        import kvguard._activate.startup; kvguard._activate.startup.activate()
        import torch, trainer_loss
        from kvguard._state import STATE
        from kvguard._report.process import PROCESS
        rd = trainer_loss.make_rollout()
        trainer_loss.compute_advantages_and_returns(None, rd)
        print("events", PROCESS.tally.writes)
    """
    target = "trainer_loss:compute_advantages_and_returns(rollout_data)"
    assert "events 2" in run_python(code, KVGUARD="record", KVGUARD_TARGETS=target).stdout
    assert "events 0" in run_python(code, KVGUARD="record", KVGUARD_TARGETS=target, KVGUARD_IGNORE="kl").stdout
    assert "events 0" in run_python(code, KVGUARD="record", KVGUARD_TARGETS=target,
                                    KVGUARD_KEYS="log_probs, ref_log_probs").stdout


def test_startup_is_idempotent() -> None:
    result = run_python("""
        import kvguard._activate.startup as s
        s.activate(); s.activate()
        from kvguard._state import STATE
        from kvguard._report.process import PROCESS
        import trainer_loss
        trainer_loss.compute_advantages_and_returns(None, trainer_loss.make_rollout())
        print("calls", PROCESS.tally.calls)
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
    from kvguard._activate import pth as _pth

    path = _pth.install(str(tmp_path))
    assert Path(path).read_text() == _pth.PTH_LINE
    assert _pth.uninstall(str(tmp_path)) == path and not Path(path).exists()
    assert _pth.uninstall(str(tmp_path)) is None


def test_pth_line_is_inert_without_kvguard_and_one_line_on_failure() -> None:
    from kvguard._activate import pth as _pth

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    off = subprocess.run([sys.executable, "-S", "-c", _pth.PTH_LINE], env=env, capture_output=True, text=True)
    assert off.returncode == 0 and off.stderr == ""
    # kvguard not importable: one line on stderr, the interpreter goes on
    broken = subprocess.run([sys.executable, "-S", "-I", "-c", _pth.PTH_LINE + "print('went on')"],
                            env={**env, "KVGUARD": "warn"}, capture_output=True, text=True)
    assert broken.stdout == "went on\n"
    assert broken.stderr.startswith("kvguard: not activated: ModuleNotFoundError") and broken.stderr.count("\n") == 1


# -- mistakes said early --------------------------------------------------------------------

def _write(tmp: Path, name: str, text: str) -> None:
    (tmp / name).write_text(textwrap.dedent(text))


def run_script(tmp: Path, script: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python script` in `tmp`, activated as the `.pth` line would activate it."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    full_env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{tmp}", COLUMNS="120", **env)
    code = f"import kvguard._activate.startup as s; s.activate(); import runpy; runpy.run_path({script!r}, run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code], cwd=tmp, env=full_env, capture_output=True, text=True,
                          timeout=120)


def test_an_argument_that_holds_no_tensor_is_said_at_the_first_call(tmp_path: Path) -> None:
    _write(tmp_path, "argjob.py", """
        import sys
        def step(args, rollout_data, scale=2.0):
            rollout_data["kl"].mul_(scale)
    """)
    _write(tmp_path, "main.py", """
        import argparse, sys, torch, argjob
        ns = argparse.Namespace(lr=1.0)
        argjob.step(ns, {"kl": torch.ones(2)})
        print("after the first call", file=sys.stderr, flush=True)
        argjob.step(ns, {"kl": torch.ones(2)})
        argjob.step(ns, rollout_data={"kl": torch.ones(2)})
    """)
    result = run_script(tmp_path, "main.py", KVGUARD="record", KVGUARD_TARGETS="argjob:step(args)")
    lines = result.stderr.splitlines()
    early = ("kvguard: target argjob:step(args): args holds argparse.Namespace, whose contents kvguard does not "
             "walk (it walks mappings, sequences, dataclasses, SimpleNamespaces and pytree nodes), so its calls "
             "run unguarded; did you mean rollout_data? (the first call's parameter that holds tensors)")
    assert result.returncode == 0 and lines[:2] == [early, "after the first call"], result.stderr
    assert lines.count(early) == 1, "said once, at the first call"
    assert ("kvguard: target argjob:step(args): args was never guarded in 3 calls: it held argparse.Namespace, "
            "whose contents kvguard does not walk (it walks mappings, sequences, dataclasses, SimpleNamespaces "
            "and pytree nodes); did you mean rollout_data? (the first call's parameter that holds tensors)") in lines


def test_some_calls_unguardable_and_others_guarded_are_both_said(tmp_path: Path) -> None:
    _write(tmp_path, "mixjob.py", """
        def step(batch):
            return batch
    """)
    _write(tmp_path, "main.py", """
        import torch, mixjob
        mixjob.step({"kl": torch.ones(2)})
        mixjob.step(object())
    """)
    result = run_script(tmp_path, "main.py", KVGUARD="record", KVGUARD_TARGETS="mixjob:step(batch)")
    assert result.returncode == 0, result.stderr
    assert ("kvguard: target mixjob:step(batch): batch holds object, whose contents kvguard does not walk "
            "(it walks mappings, sequences, dataclasses, SimpleNamespaces and pytree nodes), so its calls run "
            "unguarded; no parameter of the first call held a tensor") in result.stderr
    assert "batch was never guarded in 1 of its 2 calls: it held object" in result.stderr


def test_a_main_script_target_says_why_and_what_to_do(tmp_path: Path) -> None:
    _write(tmp_path, "job.py", """
        import torch
        def fn(rd):
            rd["kl"].add_(1)
        fn({"kl": torch.zeros(2)})
        print("job done")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    env.update(PYTHONPATH=str(ROOT), KVGUARD="raise", KVGUARD_TARGETS="__main__:fn(rd)")
    result = subprocess.run([sys.executable, "-c", "import kvguard._activate.startup as s; s.activate(); import runpy; "
                             "runpy.run_path('job.py', run_name='__main__')"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "job done\n", result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == ("kvguard: cannot guard __main__:fn(rd): the main script defines fn only as it runs, "
                        "after kvguard starts, and a script is not imported, so no hook sees it; move it into "
                        "a module the script imports and name that module (module:fn(rd)), or decorate it "
                        "with @kvguard.guarded('rd')")
    assert ("kvguard: target __main__:fn(rd) was not guarded: a function of the main script (see the line at "
            "start-up)") in lines
    assert not [line for line in lines if "__main__:fn" in line and "no in-place writes" in line]
    assert "has no attribute" not in result.stderr


def test_a_main_target_defined_before_late_activation_is_guarded() -> None:
    result = run_python("""
        import torch
        def fn(rd):
            rd["kl"].add_(1)
        from kvguard import _config
        from kvguard._activate import importhook as _importhook
        from kvguard._state import STATE
        from kvguard._report.process import PROCESS
        _importhook.install(_config.parse_targets("__main__:fn(rd)"), "record")
        fn({"kl": torch.zeros(2)})
        print("writes", PROCESS.tally.writes)
    """)
    assert "writes 1" in result.stdout and "cannot guard" not in result.stderr


def test_one_wrapper_and_one_message_for_a_missing_parameter(tmp_path: Path) -> None:
    import kvguard

    def step(args: object, rollout_data: object) -> None:
        pass

    with pytest.raises(TypeError) as decorated:
        kvguard.guarded("rolout_data")(step)
    _write(tmp_path, "paramjob.py", "def step(args, rollout_data):\n    pass\n")
    _write(tmp_path, "main.py", "import paramjob\n")
    result = run_script(tmp_path, "main.py", KVGUARD="record", KVGUARD_TARGETS="paramjob:step(rolout_data)")
    said = [line for line in result.stderr.splitlines() if "has no parameter" in line]
    tail = "step() has no parameter 'rolout_data'; its parameters are args, rollout_data; did you mean rollout_data?"
    assert str(decorated.value).startswith("kvguard.guarded('rolout_data'): ") and str(decorated.value).endswith(tail)
    assert said == [f"kvguard: cannot guard paramjob:step(rolout_data): {tail}",  # once as it loads, once at exit
                    f"kvguard: target paramjob:step(rolout_data) was not guarded: {tail}"]

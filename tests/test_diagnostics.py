"""kvguard is never silently off: each way env activation guards less than it says is a line at exit.

Real subprocesses of this environment's Python, activated only by `KVGUARD*` variables
through the `kvguard.pth` that every install of kvguard ships (editable ones included),
and their whole stderr checked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

import kvguard

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "examples" / "unchanged_job"
TARGET = "trainer_loss:compute_advantages_and_returns(rollout_data)"


def run(*args: str, env: dict[str, str], cwd: Path = JOB) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("KVGUARD", "PYTHON")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base["PYTHONPATH"] = str(cwd)
    return subprocess.run([sys.executable, *args], env={**base, **env}, cwd=cwd, capture_output=True,
                          text=True, timeout=180)


def test_this_install_ships_the_pth_file() -> None:
    """The README's editable install activates from the environment like a wheel."""
    pth = Path(sysconfig.get_paths()["purelib"]) / "kvguard.pth"
    assert pth.exists(), "reinstall kvguard (pip install -e .): this environment has no kvguard.pth"
    result = run("train.py", env={"KVGUARD": "warn", "KVGUARD_TARGETS": TARGET})
    assert "rollout_data['kl'][0] was modified in place by aten.mul_.Tensor" in result.stderr
    assert result.stderr.endswith(f"kvguard: {TARGET}: 2 guarded calls, 12 tensors protected, 4 writes at 1 site\n"
                                  "  trainer_loss.py:10 aten.mul_.Tensor: 4 writes to rollout_data['kl'][*] in 2 calls "
                                  "(first: rollout_data['kl'][0], call 1)\n")


def test_every_way_of_being_off_is_named(tmp_path: Path) -> None:
    (tmp_path / "argjob.py").write_text(textwrap.dedent("""
        def takes_namespace(args):
            return args

        def takes_tensors(rollout_data):
            rollout_data["kl"].mul_(2)

        def never_called(rollout_data):
            pass
    """))
    (tmp_path / "main.py").write_text(textwrap.dedent("""
        import argparse, torch
        from argjob import takes_namespace, takes_tensors

        takes_namespace(argparse.Namespace(lr=1.0))
        takes_namespace(argparse.Namespace(lr=2.0))
        takes_tensors({"kl": torch.ones(2), "log_probs": torch.ones(2)})
        print("job done")
    """))
    (tmp_path / "unusedpkg").mkdir()
    (tmp_path / "unusedpkg" / "__init__.py").write_text("")
    targets = ",".join([
        "fakerl.los:compute_advantages_and_returns(rollout_data)",  # no such package
        "unusedpkg.mod:f(x)",  # a package this job never imports
        "argjob:takes_namespace(args)",
        "argjob:never_called(rollout_data)",
        "argjob:takes_tensors(rollout_data)",
    ])
    result = run("main.py", cwd=tmp_path, env={"KVGUARD": "record", "KVGUARD_TARGETS": targets,
                                                 "KVGUARD_KEYS": "kll,kl"})
    assert result.returncode == 0 and result.stdout == "job done\n"
    assert result.stderr.splitlines() == [
        "kvguard: target argjob:takes_namespace(args): args holds argparse.Namespace, whose contents kvguard "
        "does not walk (it walks mappings, sequences, dataclasses, SimpleNamespaces and pytree nodes), so its "
        "calls run unguarded; no parameter of the first call held a tensor",  # said at the first call
        "kvguard: argjob:takes_tensors(rollout_data): 1 guarded call, 1 tensor protected, 1 write at 1 site",
        "  argjob.py:6 aten.mul_.Tensor: 1 write to rollout_data['kl'] in 1 call (first: rollout_data['kl'], call 1)",
        "kvguard: target fakerl.los:compute_advantages_and_returns was never imported "
        "(no module named 'fakerl')",
        "kvguard: target unusedpkg.mod:f was never imported (it exists, but this process never imported it)",
        "kvguard: target argjob:takes_namespace(args): args was never guarded in 2 calls: it held "
        "argparse.Namespace, whose contents kvguard does not walk (it walks mappings, sequences, "
        "dataclasses, SimpleNamespaces and pytree nodes); no parameter of the first call held a tensor",
        "kvguard: target argjob:never_called(rollout_data) was never called",
        "kvguard: KVGUARD_KEYS names 'kll', which no guarded argument ever held (they held kl, log_probs)",
        "kvguard: KVGUARD=record kept 1 event in memory only; set KVGUARD_REPORT_DIR=DIR to write them "
        "to files, or use KVGUARD=warn to print them",
    ]


def test_a_misspelled_submodule_is_named(tmp_path: Path) -> None:
    (tmp_path / "fakerl").mkdir()
    (tmp_path / "fakerl" / "__init__.py").write_text("")
    (tmp_path / "fakerl" / "loss.py").write_text("def compute(rollout_data):\n    pass\n")
    (tmp_path / "job.py").write_text("import fakerl.loss\nfakerl.loss.compute({})\n")
    result = run("job.py", cwd=tmp_path, env={"KVGUARD": "warn", "KVGUARD_TARGETS": "fakerl.los:compute(rollout_data)"})
    assert result.stderr == ("kvguard: 0 guarded calls, so no write was checked\n"
                             "kvguard: target fakerl.los:compute was never imported (no module named 'fakerl.los')\n")


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_an_unusable_report_dir_is_one_line_at_start_and_the_job_runs_on(tmp_path: Path, where: str) -> None:
    blocker = tmp_path / "reports"
    blocker.write_text("not a directory")
    report_dir = blocker if where == "file" else blocker / "sub"
    reason = "it is a file, not a directory" if where == "file" else "Not a directory"
    result = run("train.py", env={"KVGUARD": "record", "KVGUARD_TARGETS": TARGET,
                                  "KVGUARD_REPORT_DIR": str(report_dir)})
    assert result.returncode == 0 and "train done" in result.stdout
    assert result.stderr == (f"kvguard: KVGUARD_REPORT_DIR={str(report_dir)!r} cannot be used ({reason}); "
                             "the job runs on without report files\n"
                             f"kvguard: {TARGET}: 2 guarded calls, 12 tensors protected, 4 writes at 1 site\n"
                             "  trainer_loss.py:10 aten.mul_.Tensor: 4 writes to rollout_data['kl'][*] in 2 calls "
                             "(first: rollout_data['kl'][0], call 1)\n"
                             "kvguard: KVGUARD=record kept 4 events in memory only; set KVGUARD_REPORT_DIR=DIR "
                             "to write them to files, or use KVGUARD=warn to print them\n")


def test_a_report_dir_that_breaks_mid_job_never_replaces_the_mutation_error(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    (tmp_path / "job.py").write_text(textwrap.dedent(f"""
        import os, shutil, torch
        import trainer_loss
        shutil.rmtree({str(reports)!r})
        open({str(reports)!r}, "w").close()  # the directory became a file after start-up
        try:
            trainer_loss.compute_advantages_and_returns(None, trainer_loss.make_rollout())
        except Exception as exc:
            print(type(exc).__name__)
    """))
    result = run(str(tmp_path / "job.py"), env={"KVGUARD": "raise", "KVGUARD_TARGETS": TARGET,
                                                "KVGUARD_REPORT_DIR": str(reports)})
    assert result.stdout == "MutationError\n"
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"kvguard: writing report files to {str(reports)!r} failed (")
    assert lines[0].endswith("); it gets no further events")
    assert lines[1:] == [f"kvguard: {TARGET}: 1 guarded call, 6 tensors protected, 1 write at 1 site",
                         "  trainer_loss.py:10 aten.mul_.Tensor: 1 write blocked to rollout_data['kl'][*] in 1 call "
                         "(first: rollout_data['kl'][0], call 1)"]


def test_warn_under_w_error_runs_the_job_to_the_end() -> None:
    for flags in (["-W", "error"], []):
        env = {"KVGUARD": "warn", "KVGUARD_TARGETS": TARGET}
        if not flags:
            env["PYTHONWARNINGS"] = "error"
        result = run(*flags, "train.py", env=env)
        assert result.returncode == 0, result.stderr
        assert "train done" in result.stdout
        assert "rollout_data['kl'][0] was modified in place by aten.mul_.Tensor" in result.stderr
        assert "Traceback" not in result.stderr


def test_pytest_says_when_activation_did_not_run(tmp_path: Path) -> None:
    """A source checkout on PYTHONPATH with `python -S`: no .pth ran, the plugin says how to fix it."""
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    site = sysconfig.get_paths()["purelib"]
    result = subprocess.run(
        [sys.executable, "-S", "-m", "pytest", "-q", "test_x.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env={**{k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD", "PYTHON"))},
             "PYTHONPATH": os.pathsep.join([str(ROOT), site]), "KVGUARD": "warn", "KVGUARD_TARGETS": TARGET})
    assert "1 passed" in result.stdout, result.stdout + result.stderr
    assert ("kvguard: KVGUARD is set but kvguard was not activated in this interpreter (no kvguard.pth ran), "
            "so KVGUARD_TARGETS is not guarded; run 'python -m kvguard install-pth' once in this environment, "
            "or launch with 'python -m kvguard run -- ...'") in result.stderr


def test_a_target_in_the_main_script_says_so(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("def compute(rollout_data):\n    pass\n\ncompute({})\n")
    result = run("job.py", cwd=tmp_path, env={"KVGUARD": "warn", "KVGUARD_TARGETS": "job:compute(rollout_data)"})
    assert result.stderr == (
        "kvguard: 0 guarded calls, so no write was checked\n"
        "kvguard: target job:compute was never imported (job.py ran as the main script, __main__, and "
        "kvguard guards modules as they are imported: import it from a small launcher script)\n")


def test_static_and_class_method_targets(tmp_path: Path) -> None:
    (tmp_path / "methods.py").write_text(textwrap.dedent("""
        import torch

        class Loss:
            @staticmethod
            def shape(rollout_data):
                rollout_data["kl"].mul_(2)

            @classmethod
            def shape_cls(cls, rollout_data):
                rollout_data["kl"].add_(1)

    """))
    (tmp_path / "main.py").write_text(textwrap.dedent("""
        import torch
        from methods import Loss

        Loss.shape({"kl": torch.ones(2)})
        Loss().shape({"kl": torch.ones(2)})
        Loss.shape_cls({"kl": torch.ones(2)})
    """))
    result = run("main.py", cwd=tmp_path, env={
        "KVGUARD": "record", "KVGUARD_REPORT_DIR": str(tmp_path / "r"),
        "KVGUARD_TARGETS": "methods:Loss.shape(rollout_data),methods:Loss.shape_cls(rollout_data)"})
    assert result.stderr == (
        "kvguard: methods:Loss.shape(rollout_data): 2 guarded calls, 2 tensors protected, 2 writes at 1 site\n"
        "  methods.py:7 aten.mul_.Tensor: 2 writes to rollout_data['kl'] in 2 calls (first: rollout_data['kl'], call 1)\n"
        "kvguard: methods:Loss.shape_cls(rollout_data): 1 guarded call, 1 tensor protected, 1 write at 1 site\n"
        "  methods.py:11 aten.add_.Tensor: 1 write to rollout_data['kl'] in 1 call (first: rollout_data['kl'], call 3)\n")


def test_kvguard_exports_guard_warning() -> None:
    assert issubclass(kvguard.GuardWarning, UserWarning) and kvguard.GuardWarning.__module__ == "kvguard"


def test_light_level_from_the_environment(tmp_path: Path) -> None:
    """Light level checks at the boundaries: the tensor there at the call's start is caught at its exit
    (the KL tensors the loss places and then writes are placed inside the call: only the full level sees them)."""
    result = run("train.py", "--method", env={
        "KVGUARD": "record", "KVGUARD_TARGETS": "trainer_loss:Trainer.step(rollout_data)", "KVGUARD_LEVEL": "light",
        "KVGUARD_REPORT_DIR": str(tmp_path)})
    assert "train done" in result.stdout
    records = [line for f in tmp_path.glob("*.jsonl") for line in f.read_text().splitlines()]
    assert any('"kind": "unobserved"' in r and "rollout_data['log_probs'][0]" in r for r in records), records
    bad = run("train.py", env={"KVGUARD": "warn", "KVGUARD_TARGETS": TARGET, "KVGUARD_LEVEL": "featherweight"})
    assert ("invalid level 'featherweight' from the KVGUARD_LEVEL environment variable; expected full or light"
            in bad.stderr) and "train done" in bad.stdout


# -- under warn, one report per site on stderr; the warning still reaches whoever listens -----

WARN_JOB = """
import logging, sys, warnings, torch, kvguard
rd = {"kl": torch.ones(2)}
with kvguard.guard(rd, name="rd", action="warn"):
    for _ in range(3):
        rd["kl"].mul_(2)           # one site: shown once, the other writes counted
print("done")
"""


def _warn_job(tmp_path: Path, *flags: str, code: str = WARN_JOB) -> subprocess.CompletedProcess[str]:
    (tmp_path / "warnjob.py").write_text(code)
    return run(*flags, "warnjob.py", cwd=tmp_path, env={})


@pytest.mark.parametrize("flags", [[], ["-W", "always"], ["-W", "default::kvguard.MutationWarning"]])
def test_warn_prints_the_panel_and_no_default_warning_display(tmp_path: Path, flags: list[str]) -> None:
    result = _warn_job(tmp_path, *flags)
    assert result.returncode == 0 and result.stdout == "done\n", result.stderr
    assert result.stderr.count("rd['kl'] was modified in place by aten.mul_.Tensor") == 1, result.stderr
    assert "MutationWarning" not in result.stderr and "UserWarning" not in result.stderr


def test_warn_under_w_error_is_no_exception_and_one_panel(tmp_path: Path) -> None:
    result = _warn_job(tmp_path, "-W", "error")
    assert result.returncode == 0 and result.stdout == "done\n", result.stderr
    assert result.stderr.count("was modified in place") == 1 and "Traceback" not in result.stderr


def test_the_warning_still_reaches_catch_warnings_and_logging(tmp_path: Path) -> None:
    code = """
import logging, sys, warnings, torch, kvguard
rd = {"kl": torch.ones(2), "x": torch.ones(2)}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with kvguard.guard(rd, name="rd", action="warn"):
        rd["kl"].mul_(2)
print("recorded:", [(w.category.__name__, str(w.message)) for w in caught])
logging.basicConfig(stream=sys.stdout, format="logged %(message)s")
logging.captureWarnings(True)      # a custom showwarning: a listener of its own
with kvguard.guard(rd, name="rd", action="warn"):
    rd["x"].add_(1)
logging.captureWarnings(False)
warnings.warn("unrelated")         # other warnings keep Python's display
"""
    result = _warn_job(tmp_path, code=code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("recorded: [('MutationWarning', \"rd['kl'] was modified in place by aten.mul_.Tensor at "
                        "warnjob.py:7\")]")
    assert lines[1].startswith("logged ") and "MutationWarning: rd['x'] was modified in place" in lines[1]
    assert result.stderr.count("kvguard: in-place write") == 2
    assert "UserWarning: unrelated" in result.stderr and "MutationWarning" not in result.stderr


def test_a_guard_warning_keeps_its_default_display(tmp_path: Path) -> None:
    """Only a MutationWarning has a panel: a GuardWarning is shown by Python as any warning."""
    result = _warn_job(tmp_path, code="import kvguard\nwith kvguard.guard({}, name='rd', action='warn'):\n    pass\n")
    assert "GuardWarning: kvguard.guard(rd) protected no tensor" in result.stderr


def test_in_pytest_the_warning_is_in_the_warnings_summary_and_error_never_breaks_the_op(tmp_path: Path) -> None:
    (tmp_path / "test_w.py").write_text(textwrap.dedent("""
        import torch, kvguard

        def test_explicit_guard():
            rd = {"kl": torch.ones(2)}
            with kvguard.guard(rd, name="rd", action="warn") as g:
                rd["kl"].mul_(2)
            assert rd["kl"].tolist() == [2.0, 2.0] and len(g.report.events) == 1
    """))
    base = [sys.executable, "-m", "pytest", "-q", "-rP", "-p", "no:cacheprovider", "test_w.py"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD", "PYTHON"))}
    for flag in ("default", "error::kvguard.MutationWarning"):
        result = subprocess.run(base + ["-W", flag], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                                env=env)
        assert "1 passed" in result.stdout, result.stdout
        assert result.stdout.count("kvguard: in-place write") == 1  # the captured panel, once (-rP shows it)
        summary = "MutationWarning: rd['kl'] was modified in place by aten.mul_.Tensor at test_w.py:7"
        assert (summary in result.stdout) == (flag == "default"), result.stdout

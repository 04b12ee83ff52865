"""`KVGUARD_TARGETS=autograd` in real subprocesses, and `@pytest.mark.kvguard(autograd=True)`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvguard import _config
from processes import free_port, run_python

pytest_plugins = ["pytester"]
HERE = Path(__file__).parent
TRAIN = textwrap.dedent("""
    import torch
    x = torch.randn(4, 3, requires_grad=True)
    for step in range(3):
        y = torch.sigmoid(x * 2)
        if step == BUG_STEP:
            y.mul_(2)   # the bug
        y.sum().backward()
    print("done")
""")


def _run(tmp_path: Path, action: str, bug_step: int, targets: str = "autograd") -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN.replace("BUG_STEP", str(bug_step)))
    return run_python(script, cwd=tmp_path, KVGUARD=action, KVGUARD_TARGETS=targets)


def test_raise_stops_the_write_at_its_line_on_the_env_var_alone(tmp_path: Path) -> None:
    result = _run(tmp_path, "raise", bug_step=2)
    assert result.returncode == 1 and "done" not in result.stdout
    err = result.stderr
    assert 'File "' + str(tmp_path / "train.py") + '", line 7, in <module>' in err
    assert "kvguard.MutationError: <saved by SigmoidBackward0: result> would be modified in place by " \
           "aten.mul_.Tensor at train.py:7" in err
    assert "saved at train.py:5" in err and "kvguard/_engine" not in err  # the traceback ends at the user's line
    assert "kvguard: autograd: 3 saved tensors protected in 3 forward passes, 1 write at 1 site" in err


def test_a_clean_run_says_what_it_watched(tmp_path: Path) -> None:
    result = _run(tmp_path, "raise", bug_step=99)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "kvguard: autograd: 3 saved tensors protected in 3 forward passes, no in-place writes"


def test_record_lets_backward_fail_as_torch_does_with_the_write_named(tmp_path: Path) -> None:
    result = _run(tmp_path, "record", bug_step=1)
    assert result.returncode == 1
    assert "modified by an inplace operation" in result.stderr
    assert "was written by aten.mul_.Tensor at train.py:7 (y.mul_(2)   # the bug)" in result.stderr


def test_autograd_mixes_with_other_targets() -> None:
    settings = _config.from_env({"KVGUARD": "raise", "KVGUARD_TARGETS": "Autograd, slime"})
    assert "autograd" in settings.kinds and settings.targets and "autograd" in settings.as_record()["targets"]
    assert not _config.from_env({"KVGUARD": "raise", "KVGUARD_TARGETS": "slime"}).kinds


def _megatron_job(script: str, variant: str) -> subprocess.CompletedProcess[str]:
    """One of `integrations/`'s megatron-core jobs (a 1-process gloo group), under KVGUARD_TARGETS=autograd."""
    pytest.importorskip("megatron.core")
    return run_python(HERE / "integrations" / script, variant, free_port(), timeout=300, KVGUARD="raise",
                      KVGUARD_TARGETS="autograd", PYTHONWARNINGS="ignore")


@pytest.mark.slow  # a megatron-core process each: CI runs them (-m slow)
@pytest.mark.parametrize("variant", ["bug", "fixed"])
def test_verl_2484_megatron_vocab_parallel_cross_entropy(variant: str) -> None:
    """Real megatron-core on a 1-process gloo group: its fp32 path writes logits an entropy saved."""
    result = _megatron_job("verl_2484_cross_entropy.py", variant)
    if variant == "bug":
        assert result.returncode != 0
        assert ("kvguard.MutationError: <saved by MulBackward0: other> would be modified in place by "
                "aten.sub_.Tensor at cross_entropy.py:") in result.stderr
        assert "vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert "backward ok" in result.stdout
        assert "autograd: 11 saved tensors protected in 1 forward pass, no in-place writes" in result.stderr


MARKED = textwrap.dedent("""
    import pytest, torch

    @pytest.mark.kvguard(autograd=True)
    def test_bug():
        x = torch.randn(3, requires_grad=True)
        y = x.exp()
        y.add_(1)
        y.sum().backward()

    @pytest.mark.kvguard(autograd=True)
    def test_clean():
        x = torch.randn(3, requires_grad=True)
        x.exp().sum().backward()
""")


def test_the_marker_fails_a_test_at_the_write(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGUARD", raising=False)
    pytester.makepyfile(test_marked=MARKED)
    result = pytester.runpytest("--disable-plugin-autoload", "-p", "kvguard._activate.pytest_plugin")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*MutationError: <saved by ExpBackward0: result> would be modified in place by "
                                 "aten.add_.Tensor at test_marked.py:7*"])
    result = pytester.runpytest("--disable-plugin-autoload", "-p", "kvguard._activate.pytest_plugin",
                                "--kvguard=record")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*modified by an inplace operation*"])


@pytest.mark.slow  # a megatron-core process each: CI runs them (-m slow)
@pytest.mark.parametrize("variant", ["clean", "bug"])
def test_ddp_over_a_megatron_mlp_on_gloo(variant: str) -> None:
    """torch DDP over Megatron-core's MLP (tensor-parallel linears) with AdamW, three steps."""
    result = _megatron_job("ddp_megatron_mlp_steps.py", variant)
    assert "megatron MLP built" in result.stdout
    if variant == "clean":
        assert result.returncode == 0, result.stderr
        assert "autograd: 21 saved tensors protected in 3 forward passes, no in-place writes" in result.stderr
    else:
        assert result.returncode != 0
        assert ("MutationError: <saved by TanhBackward0: result> would be modified in place by aten.zero_.default "
                "at ddp_megatron_mlp_steps.py:") in result.stderr


def test_report_files_and_kvguard_report(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN.replace("BUG_STEP", "1"))
    result = run_python(script, cwd=tmp_path, KVGUARD="warn", KVGUARD_TARGETS="autograd",
                        KVGUARD_REPORT_DIR=str(tmp_path / "r"))
    assert result.returncode == 1 and "modified by an inplace operation" in result.stderr
    report = subprocess.run([sys.executable, "-m", "kvguard", "report", str(tmp_path / "r")], capture_output=True,
                            text=True, timeout=120,
                            env={**{k: v for k, v in os.environ.items() if k != "KVGUARD"}, "COLUMNS": "200"})
    assert report.returncode == 1, report.stdout + report.stderr
    assert "<saved by SigmoidBackward0: result>" in report.stdout and "train.py:7" in report.stdout
    assert "autograd: 2 saved tensors protected in 2 forward passes, 1 write" in report.stdout


def test_torch_func_runs_under_the_env_var(tmp_path: Path) -> None:
    """A job using torch.func.grad keeps working with KVGUARD_TARGETS=autograd (it refuses saved-tensor hooks)."""
    script = tmp_path / "func_job.py"
    script.write_text(textwrap.dedent("""
        import warnings
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch
        x = torch.randn(3)
        g = torch.func.grad(lambda t: torch.sin(t).sum())(x)
        assert torch.allclose(g, torch.cos(x))
        print("ok")
    """))
    result = run_python(script, KVGUARD="raise", KVGUARD_TARGETS="autograd")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    assert ("kvguard: autograd: 0 saved tensors protected in 0 forward passes, no in-place writes to them; 1 "
            "unprotected under other saved-tensor hooks") in result.stderr  # the transform's stretch: not "clean"

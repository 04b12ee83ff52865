"""Presets: `KVGUARD_TARGETS=slime` (verl, openrlhf, nemo-rl, trl) guards a framework's functions.

trl is pip-installable and small enough to run for real: its preset is tested on trl's own
trainers in `test_trl_preset.py`, not against a replica.

Parsing and the `presets` command in process; activation end to end in real subprocesses
of this environment's Python (activated by `kvguard.pth`, like `test_diagnostics.py`)
against the replicas in `tests/fake_frameworks/`, whose module paths and signatures are
checked here against the real sources: the verl and openrlhf wheels from PyPI (skipped
offline) and, for slime and NeMo-RL (no installable package), the signatures read at the
commits the presets cite.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
import types
import zipfile
from pathlib import Path
from typing import Optional

import pytest

from kvguard import _config, _presets
from kvguard.__main__ import main
from kvguard._config import Settings, parse_targets
from kvguard._errors import ConfigError
from kvguard._presets import PRESETS, PresetTarget
from kvguard._report.process import ProcessReport
from kvguard._state import State
from kvguard._presets import Target
from setitem_ops import SLICE_FILL

FAKE = Path(__file__).resolve().parent / "fake_frameworks"
JOBS = FAKE / "jobs"
KNOWN = "slime, verl, openrlhf, nemo-rl, trl"


# ── parsing ──────────────────────────────────────────────────────────────────────────────

def test_a_name_without_a_colon_is_a_preset() -> None:
    assert [str(t) for t in parse_targets("slime")] == [
        "slime.backends.megatron_utils.loss:compute_advantages_and_returns(rollout_data)",
        "slime.observability.train_metric_utils:log_rollout_data(rollout_data)",
        "slime.backends.megatron_utils.data:log_rollout_data(rollout_data)",  # v0.3.1 and earlier
    ]
    targets = parse_targets(" Verl ")
    assert all(isinstance(t, PresetTarget) and t.preset == "verl" for t in targets)
    assert [t.argname for t in targets] == ["data", "batch", "data"]
    assert parse_targets("nemo_rl") == parse_targets("NeMo-RL") == parse_targets("nemo-rl")
    assert [str(t) for t in parse_targets("openrlhf")] == [
        "openrlhf.trainer.ppo_utils.experience_maker:RemoteExperienceMaker.compute_advantages_and_returns(experiences)",
        "openrlhf.trainer.ppo_trainer:BasePPOTrainer._compute_rollout_stats(experiences)",
    ]


def test_presets_and_explicit_targets_mix() -> None:
    targets = parse_targets("myrl.loss:f(rollout_data), nemo-rl ,slime")
    assert type(targets[0]) is Target and str(targets[0]) == "myrl.loss:f(rollout_data)"
    assert [t.preset for t in targets[1:] if isinstance(t, PresetTarget)] == ["nemo-rl"] * 4 + ["slime"] * 3
    assert len(targets) == 8


def test_an_explicit_target_wins_over_the_preset_entry_for_the_same_function() -> None:
    explicit = "slime.backends.megatron_utils.loss:compute_advantages_and_returns(args)"
    for spelled in (f"slime,{explicit}", f"{explicit},slime", "slime,slime"):
        targets = parse_targets(spelled)
        losses = [t for t in targets if t.qualname == "compute_advantages_and_returns"]
        assert len(losses) == 1 and len(targets) == 3
        if explicit in spelled:
            assert type(losses[0]) is Target and losses[0].argname == "args"


def test_an_unknown_preset_is_a_config_error_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        _config.from_env({"KVGUARD": "raise", "KVGUARD_TARGETS": "slime,slim"})
    assert str(caught.value) == (
        "invalid target 'slim' in the KVGUARD_TARGETS environment variable; without a colon it names a preset "
        f"or one of autograd, weights, data, all, and none is called that; did you mean slime? (known presets: {KNOWN}); "
        "a function is module:qualname(argname), "
        "e.g. myrl.loss:compute_advantages_and_returns(rollout_data)")
    with pytest.raises(ConfigError, match=r"^invalid target 'myrl\.loss\.f\(x\)' in --targets; without a colon"):
        parse_targets("myrl.loss.f(x)", "--targets")  # a target that lost its colon is told the form too


def test_every_preset_function_names_its_file_and_why() -> None:
    for preset in PRESETS.values():
        assert (len(preset.commit) == 40 or preset.commit.startswith("v")) and preset.functions  # trl: a tag
        for function in preset.functions:
            (target,) = parse_targets(function.target)
            assert function.file == target.module.replace(".", "/") + ".py"
            assert function.why and preset.package == target.module.partition(".")[0]


# ── python -m kvguard presets ────────────────────────────────────────────────────────────

def test_presets_command_lists_what_each_guards(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for preset in PRESETS.values():
        at = "commit" if len(preset.commit) == 40 else "tag"
        assert f"{preset.name}: https://github.com/{preset.repo} at {at} {preset.commit}" in out
        for function in preset.functions:
            assert f"\n  {function.target}\n    source {function.file} @ {preset.commit[:12]}" in out
    assert "    before slime.backends.megatron_utils.data:log_rollout_data(rollout_data) in v0.3.1" in out
    assert "KVGUARD_ALLOW='experiences[*].rewards'" in out


def test_presets_command_shows_one_preset_or_names_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets", "verl"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("verl: https://github.com/volcengine/verl at commit ") and "slime" not in out
    assert main(["presets", "ppo"]) == 2
    assert capsys.readouterr().err == f"kvguard: no preset is called 'ppo'; known presets: {KNOWN}\n"


# ── the replicas are faithful to the real sources ─────────────────────────────────────────

# Read with `git show <commit>:<file>` at the commits the presets cite (no package on PyPI).
RECORDED = {
    "slime.backends.megatron_utils.loss:compute_advantages_and_returns": ["args", "rollout_data"],
    "slime.backends.megatron_utils.data:log_rollout_data": ["rollout_id", "args", "rollout_data"],  # v0.3.1
    "slime.observability.train_metric_utils:log_rollout_data": ["rollout_id", "args", "rollout_data"],
    "nemo_rl.algorithms.advantage_estimator:GRPOAdvantageEstimator.compute_advantage":
        ["self", "prompt_ids", "rewards", "mask", "**kwargs"],
    "nemo_rl.algorithms.advantage_estimator:ReinforcePlusPlusAdvantageEstimator.compute_advantage":
        ["self", "prompt_ids", "rewards", "mask", "logprobs_policy", "logprobs_reference", "**kwargs"],
    "nemo_rl.algorithms.advantage_estimator:GeneralizedAdvantageEstimator.compute_advantage":
        ["self", "prompt_ids", "rewards", "mask", "values", "reference_logprobs", "logprobs", "**kwargs"],
    "nemo_rl.algorithms.grpo:_apply_message_level_advantage_penalties":
        ["train_data", "message_logs", "invalid_tool_call_advantage", "malformed_thinking_advantage", "log_config"],
}
WHEELS = {"verl": "verl==0.9.1", "openrlhf": "openrlhf==0.11.2"}


def parameters(source: str, qualname: str) -> Optional[list[str]]:
    """The parameters of `qualname` in `source`, read with ast (nothing is imported), or None."""
    node: ast.AST = ast.parse(source)
    for part in qualname.split("."):
        found = [n for n in getattr(node, "body", []) if getattr(n, "name", None) == part
                 and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        if not found:
            return None
        node = found[-1]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    args = node.args
    return ([a.arg for a in args.posonlyargs + args.args] + ([f"*{args.vararg.arg}"] if args.vararg else [])
            + [a.arg for a in args.kwonlyargs] + ([f"**{args.kwarg.arg}"] if args.kwarg else []))


def replica_parameters(target: Target) -> Optional[list[str]]:
    path = FAKE / (target.module.replace(".", "/") + ".py")
    return parameters(path.read_text(), target.qualname) if path.exists() else None


@pytest.mark.parametrize("name", ["slime", "nemo-rl"])
def test_replicas_match_the_signatures_read_at_the_cited_commits(name: str) -> None:
    targets = [t for t in parse_targets(name)]
    for target in targets:
        recorded = RECORDED[f"{target.module}:{target.qualname}"]
        assert target.argname in recorded
        if target.module != "slime.observability.train_metric_utils":  # the replica is v0.3.1: not there yet
            assert replica_parameters(target) == recorded, target


@pytest.fixture(scope="module")
def real_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """verl 0.9.1 and openrlhf 0.11.2 from PyPI, unpacked, never installed or imported."""
    out = tmp_path_factory.mktemp("wheels")
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(out), *WHEELS.values()],
                       check=True, capture_output=True, timeout=300)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"cannot download the framework wheels here: {exc}")
    roots = {}
    for name in WHEELS:
        (wheel,) = out.glob(f"{name}-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(out / name)
        (init,) = [p for p in (out / name).rglob(f"{name}/__init__.py") if p.parent.parent.name != "tests"]
        roots[name] = init.parent.parent
    return roots


@pytest.mark.parametrize("name", sorted(WHEELS))
def test_presets_and_replicas_match_the_real_wheels(name: str, real_wheels: dict[str, Path]) -> None:
    for target in parse_targets(name):
        source = real_wheels[name] / (target.module.replace(".", "/") + ".py")
        real = parameters(source.read_text(), target.qualname)
        assert real is not None and target.argname in real, f"{target} is not in {WHEELS[name]}"
        assert replica_parameters(target) == real, target


# ── missing in the installed version: the reasons, without a subprocess ────────────────────

def test_missing_reason_names_what_is_gone() -> None:
    module = types.ModuleType("openrlhf.trainer.ppo_trainer")
    exec(textwrap.dedent("""
        class BasePPOTrainer:
            def _compute_rollout_stats(self, batch):
                pass
    """), vars(module))
    stats, maker = parse_targets("openrlhf")[1], parse_targets("openrlhf")[0]
    assert _presets.missing_reason(stats, module) == (
        "_compute_rollout_stats() has no parameter 'experiences' (it takes self, batch)")
    del module.BasePPOTrainer._compute_rollout_stats
    assert _presets.missing_reason(stats, module) == (
        "openrlhf.trainer.ppo_trainer has no BasePPOTrainer._compute_rollout_stats")
    assert _presets.missing_reason(maker, None) is None  # not imported: nothing to say yet
    assert _presets.missing_reason(Target(stats.module, stats.qualname, stats.argname), module) is None


def test_a_preset_that_guarded_functions_never_called_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvguard._report.diagnostics import diagnostics

    state, process = State(), ProcessReport()
    state.settings = Settings("warn", parse_targets("openrlhf,myjob:f(x)"))
    monkeypatch.setitem(sys.modules, "openrlhf", types.ModuleType("openrlhf"))
    monkeypatch.setitem(sys.modules, "myjob", types.ModuleType("myjob"))
    for target in state.settings.targets:
        monkeypatch.setitem(sys.modules, target.module, types.ModuleType(target.module))
        state.patched.append(str(target))
        process.target_stats(str(target))
    assert diagnostics(state, process, False) == [
        "kvguard: preset openrlhf: none of its 2 guarded functions was called "
        "(RemoteExperienceMaker.compute_advantages_and_returns, BasePPOTrainer._compute_rollout_stats)",
        "kvguard: target myjob:f(x) was never called",
    ]
    called = process.target_stats(str(state.settings.targets[0]))
    called.calls = called.protected = 1  # one of them called: the other is for another configuration
    assert diagnostics(state, process, False) == ["kvguard: target myjob:f(x) was never called"]


def test_a_moved_function_named_explicitly_satisfies_the_preset(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvguard._report.diagnostics import diagnostics

    state, process = State(), ProcessReport()
    state.settings = Settings("warn", parse_targets("slime,slime.backends.megatron_utils.data:log_rollout_data(rollout_data)"))
    assert [type(t).__name__ for t in state.settings.targets] == ["PresetTarget", "PresetTarget", "Target"]
    monkeypatch.setitem(sys.modules, "slime", types.ModuleType("slime"))  # v0.3.1: no slime.observability
    for target in (state.settings.targets[0], state.settings.targets[2]):
        monkeypatch.setitem(sys.modules, target.module, types.ModuleType(target.module))
        state.patched.append(str(target))
        stats = process.target_stats(str(target))
        stats.calls = stats.protected = 1
    assert diagnostics(state, process, False) == []


# ── end to end: activated by KVGUARD* alone, against the replicas ──────────────────────────

def run(job: str | Path, *args: str, env: dict[str, str], path: Path = FAKE,
        cwd: Optional[Path] = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("KVGUARD", "PYTHON")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base.update(PYTHONPATH=str(path), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, str(job), *args], env={**base, **env}, cwd=cwd or path,
                          capture_output=True, text=True, timeout=180)


def line_of(path: Path, text: str) -> int:
    (number,) = [i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line]
    return number


def variant(tmp_path: Path, name: str, edits: dict[str, tuple[str, str]], remove: tuple[str, ...] = ()) -> Path:
    """A copy of a replica, edited into another version of the framework; returns its PYTHONPATH root."""
    root = tmp_path / "site"
    shutil.copytree(FAKE / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    for file, (old, new) in edits.items():
        path = root / name / file
        text = path.read_text()
        assert old in text, (file, old)
        path.write_text(text.replace(old, new))
    for file in remove:
        (root / name / file).unlink()
    return root


def test_slime_preset_alone_catches_the_v031_kl_bug_under_raise() -> None:
    loss = FAKE / "slime" / "backends" / "megatron_utils" / "loss.py"
    bug, placed = line_of(loss, "k *= kl_coef  # v0.3.1"), line_of(loss, 'rollout_data["kl"] = kl')
    result = run(JOBS / "slime_ppo.py", env={"KVGUARD": "raise", "KVGUARD_TARGETS": "slime"})
    assert result.returncode == 1 and result.stdout == ""
    tail = result.stderr[result.stderr.index("kvguard.MutationError"):].splitlines()
    assert tail[:4] == [
        f"kvguard.MutationError: rollout_data['kl'][0] would be modified in place by aten.mul_.Tensor at loss.py:{bug}",
        '  code     k *= kl_coef  # v0.3.1: k IS rollout_data["kl"][i]',
        "  tensor   f32[4] cpu",
        f"  placed   loss.py:{placed}",
    ]
    assert tail[5:] == [
        "  action   raised before the write; the data is intact",
        "  hint     write to a new tensor (k = k * kl_coef) or clone first (k = k.clone())",
        "kvguard: slime.backends.megatron_utils.loss:compute_advantages_and_returns(rollout_data): 1 guarded call, "
        "10 tensors protected, 1 write at 1 site",
        f"  loss.py:{bug} aten.mul_.Tensor: 1 write blocked to rollout_data['kl'][*] in 1 call "
        "(first: rollout_data['kl'][0], call 1)",
    ]
    assert "cannot guard" not in result.stderr and "preset" not in result.stderr


def test_slime_at_624b824a_moved_log_rollout_data_and_is_clean(tmp_path: Path) -> None:
    """The layout of the cited commit: the fix applied, log_rollout_data in slime.observability."""
    root = variant(tmp_path, "slime", {
        "backends/megatron_utils/loss.py": ("k *= kl_coef  # v0.3.1: k IS rollout_data[\"kl\"][i]",
                                            "k = k * kl_coef  # 045310b2b490: a new tensor"),
        "backends/megatron_utils/actor.py": ("from .data import log_rollout_data",
                                             "from slime.observability.train_metric_utils import log_rollout_data"),
    })
    (root / "slime" / "observability").mkdir()
    (root / "slime" / "observability" / "__init__.py").write_text("")
    data = root / "slime" / "backends" / "megatron_utils" / "data.py"
    (root / "slime" / "observability" / "train_metric_utils.py").write_text(data.read_text())
    data.write_text('"""get_batch and friends stay here at 624b824a; log_rollout_data moved."""\n')
    job = tmp_path / "job.py"
    job.write_text((JOBS / "slime_ppo.py").read_text().replace(
        "from slime.backends.megatron_utils import data", "from slime.observability import train_metric_utils as data"))
    result = run(job, env={"KVGUARD": "warn", "KVGUARD_TARGETS": "slime"}, path=root)
    assert result.returncode == 0 and result.stdout.startswith("logged rollout/kl -0.1214, true KL -0.1214")
    assert result.stderr == (  # a clean run names what it watched, per function of the preset
        "kvguard: slime.observability.train_metric_utils:log_rollout_data(rollout_data): 1 guarded call, "
        "14 tensors protected, no in-place writes\n"
        "kvguard: slime.backends.megatron_utils.loss:compute_advantages_and_returns(rollout_data): 1 guarded call, "
        "14 tensors protected, no in-place writes\n")


def test_verl_preset_walks_dataproto_into_its_tensordict() -> None:
    job = JOBS / "verl_ppo.py"
    bug = line_of(job, "token_level_rewards *= response_mask")
    result = run(job, "--estimator", "scaled", env={"KVGUARD": "warn", "KVGUARD_TARGETS": "verl"})
    assert result.returncode == 0
    assert result.stderr.endswith(
        "kvguard: verl.trainer.ppo.ray_trainer:apply_kl_penalty(data): 1 guarded call, 7 tensors protected, "
        "no in-place writes\n"
        "kvguard: verl.trainer.ppo.ray_trainer:compute_advantage(data): 1 guarded call, 8 tensors protected, "
        "1 write at 1 site\n"
        f"  verl_ppo.py:{bug} aten.mul_.Tensor: 1 write to data.batch['token_level_rewards'] in 1 call "
        "(first: data.batch['token_level_rewards'], call 3)\n"
        "kvguard: verl.trainer.ppo.rollout_corr_helper:compute_rollout_correction_and_add_to_batch(batch): "
        "1 guarded call, 9 tensors protected, no in-place writes\n")


def test_openrlhf_intended_penalty_writes_are_allowed_as_the_preset_says() -> None:
    allow = PRESETS["openrlhf"].functions[0].allow
    result = run(JOBS / "openrlhf_ppo.py", "--overlong", env={"KVGUARD": "raise", "KVGUARD_TARGETS": "openrlhf",
                                                              "KVGUARD_ALLOW": allow})
    assert result.returncode == 0 and result.stdout == "rollout/reward_mean 0.0000\n"
    assert result.stderr == (
        "kvguard: openrlhf.trainer.ppo_trainer:BasePPOTrainer._compute_rollout_stats(experiences): 1 guarded call, "
        "22 tensors protected, no in-place writes\n"
        "kvguard: openrlhf.trainer.ppo_utils.experience_maker:RemoteExperienceMaker.compute_advantages_and_returns"
        "(experiences): 1 guarded call, 25 tensors protected, no in-place writes, 2 allowed\n"
        "  allowed: 2 writes by allow=experiences[*].rewards\n")
    result = run(JOBS / "openrlhf_ppo.py", "--overlong", env={"KVGUARD": "raise", "KVGUARD_TARGETS": "openrlhf"})
    assert result.returncode == 1
    # OpenRLHF keeps the rewards tensor in `info` too: the report names both paths to that memory
    assert ("kvguard.MutationError: experiences[0].rewards (the same memory as experiences[0].info['reward']) "
            "would be modified in place by aten.add_.Tensor") in result.stderr


def test_nemo_rl_span_writes_through_expanded_advantages_are_caught_where_allowed(tmp_path: Path) -> None:
    """NVIDIA-NeMo/RL #2787 (up to 34d32bfa5965): the penalties wrote one-token spans of advantages
    expanded from per-sample values, changing the whole row; `nemo-rl` alone catches it at the line."""
    root = variant(tmp_path, "nemo_rl", {"algorithms/grpo.py": (
        "advantages = advantages.clone()  # 09b63d9bd: the expanded view shares one value per row",
        "pass  # 34d32bfa5965: no clone, the span writes go through the expanded view")})
    bug = line_of(root / "nemo_rl" / "algorithms" / "grpo.py", "= invalid_tool_call_advantage  # the span write")
    result = run(JOBS / "nemo_rl_penalties.py", env={"KVGUARD": "raise", "KVGUARD_TARGETS": "nemo-rl"}, path=root)
    assert result.returncode == 1 and "advantages [" not in result.stdout
    assert ("kvguard.MutationError: train_data['advantages'] would be modified in place through elements that "
            f"share memory by {SLICE_FILL} at grpo.py:{bug}") in result.stderr, result.stderr
    assert ("  shared   a write naming 1 element changes 4: this tensor's elements share memory (a dimension of "
            "stride 0, from expand), so a write to one changes every element sharing it\n") in result.stderr


def test_nemo_rl_span_writes_after_the_fix_are_allowed_with_no_setting() -> None:
    result = run(JOBS / "nemo_rl_penalties.py", env={"KVGUARD": "raise", "KVGUARD_TARGETS": "nemo-rl"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("advantages [[0.5, -5.0, 0.5, 0.5], ")
    assert ("kvguard: nemo_rl.algorithms.grpo:_apply_message_level_advantage_penalties(train_data): 1 guarded call, "
            "4 tensors protected, no in-place writes, 2 allowed\n"
            "  allowed: 2 writes by allow=train_data['advantages']\n") in result.stderr


OLD_VERSIONS_JOB = """
    import torch
    from verl.protocol import DataProto
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage
    from nemo_rl.algorithms.advantage_estimator import GRPOAdvantageEstimator
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    data = DataProto.from_dict({"old_log_probs": torch.zeros(2, 3), "ref_log_prob": torch.zeros(2, 3),
                                "values": torch.zeros(2, 3), "response_mask": torch.ones(2, 3),
                                "token_level_scores": torch.ones(2, 3)})
    data, _ = apply_kl_penalty(data, core_algos.FixedKLController(0.1))
    compute_advantage(data, core_algos.AdvantageEstimator.GAE)
    GRPOAdvantageEstimator({"use_leave_one_out_baseline": True, "normalize_rewards": False}, {}).compute_advantage(
        prompt_ids=torch.tensor([0, 0]), rewards=torch.tensor([1.0, 0.0]), mask=torch.ones(2, 3))
    print("job done")
"""


def test_functions_missing_in_older_versions_are_one_line_each_at_exit(tmp_path: Path) -> None:
    """verl 0.6.0 has no rollout_corr_helper, NeMo-RL 0.6.0 no GAE estimator; an OpenRLHF that renamed a method."""
    root = variant(tmp_path, "verl", {"__init__.py": ('__version__ = "0.9.1"', '__version__ = "0.6.0"')},
                   remove=("trainer/ppo/rollout_corr_helper.py",))
    nemo = variant(tmp_path / "n", "nemo_rl", {
        "__init__.py": ('__version__ = "0.7.0"', '__version__ = "0.6.0"'),
        "algorithms/advantage_estimator.py": ("class GeneralizedAdvantageEstimator:", "class _Removed:")})
    shutil.move(str(nemo / "nemo_rl"), str(root / "nemo_rl"))
    openrlhf = variant(tmp_path / "o", "openrlhf", {
        "trainer/ppo_trainer.py": ("def _compute_rollout_stats(self, experiences)", "def _rollout_stats(self, experiences)")})
    shutil.move(str(openrlhf / "openrlhf"), str(root / "openrlhf"))
    (tmp_path / "job.py").write_text(textwrap.dedent(OLD_VERSIONS_JOB))
    result = run(tmp_path / "job.py", env={"KVGUARD": "warn", "KVGUARD_TARGETS": "verl,nemo-rl,openrlhf"}, path=root)
    assert result.returncode == 0 and result.stdout == "job done\n"
    lines = result.stderr.splitlines()
    heads = [line for line in lines if "guarded call" in line]
    assert heads[0] == "kvguard: verl.trainer.ppo.ray_trainer:apply_kl_penalty(data): 1 guarded call, 6 tensors " \
                       "protected, no in-place writes"
    assert len(heads) == 3 and all(", no in-place writes" in line for line in heads), heads
    assert lines[len(heads):] == [
        "kvguard: preset verl: verl.trainer.ppo.rollout_corr_helper:compute_rollout_correction_and_add_to_batch(batch) "
        "is not in verl 0.6.0 (no module named 'verl.trainer.ppo.rollout_corr_helper'); not guarded",
        "kvguard: preset nemo-rl: nemo_rl.algorithms.advantage_estimator:GeneralizedAdvantageEstimator."
        "compute_advantage(rewards) is not in NeMo-RL 0.6.0 (nemo_rl.algorithms.advantage_estimator has no "
        "GeneralizedAdvantageEstimator.compute_advantage); not guarded",
        "kvguard: preset openrlhf: openrlhf.trainer.ppo_trainer:BasePPOTrainer._compute_rollout_stats(experiences) "
        "is not in this version of OpenRLHF (openrlhf.trainer.ppo_trainer has no "
        "BasePPOTrainer._compute_rollout_stats); not guarded",
        "kvguard: preset openrlhf: its guarded function RemoteExperienceMaker.compute_advantages_and_returns "
        "was never called",
    ]


def test_a_framework_not_imported_or_not_running_here_is_one_line_per_preset(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("import slime\nimport nemo_rl.algorithms\nprint('job done')\n")
    result = run(tmp_path / "job.py", env={"KVGUARD": "warn",
                                           "KVGUARD_TARGETS": "slime,verl,nemo-rl,myrl.loss:f(rollout_data)"})
    assert result.returncode == 0 and result.stdout == "job done\n"
    assert result.stderr.splitlines() == [
        "kvguard: 0 guarded calls, so no write was checked",
        "kvguard: preset slime guarded nothing here: this process imported slime but not "
        "slime.backends.megatron_utils.loss, slime.backends.megatron_utils.data, where its functions are "
        "(they run in another process?)",
        "kvguard: preset verl: this process never imported verl, so none of its 3 functions was guarded here",
        "kvguard: preset nemo-rl guarded nothing here: this process imported nemo_rl but not "
        "nemo_rl.algorithms.advantage_estimator, nemo_rl.algorithms.grpo, where its functions are (they run "
        "in another process?)",
        "kvguard: target myrl.loss:f was never imported (no module named 'myrl')",
    ]

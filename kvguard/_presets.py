"""Targets and presets: `module:qualname(argname)` names one function to guard, and
`KVGUARD_TARGETS=slime` names the functions of an RL framework worth guarding.

An entry of `KVGUARD_TARGETS` without a colon is a preset name (any case; `_` or `-`).
Each preset was found by reading the framework's source at the commit it names; nothing
of that code is copied here, only where the functions are and which argument holds the
rollout data. Stdlib only, and imports only kvguard's leaves: activation expands the names,
the exit diagnostics read the same data.

slime (https://github.com/THUDM/slime, commit 624b824a898ab0ec1fcb4d373004c7f3852bf515,
2026-08-21; release v0.3.1 is commit a6272da0d4f3d0a08520c99a2f3b4f6c887960dc):
    slime/backends/megatron_utils/loss.py  compute_advantages_and_returns(args, rollout_data)
    slime/observability/train_metric_utils.py  log_rollout_data(rollout_id, args, rollout_data),
        in slime/backends/megatron_utils/data.py up to v0.3.1
    v0.3.1's PPO branch scales the stored KL in place (`k *= kl_coef`), fixed by commit
    045310b2b490dc6ca22ddbc60cf29b21fc3b42aa ("preserve raw KL so rollout/kl logging is correct").

verl (https://github.com/volcengine/verl, commit b178a3cd56f58b2d502255daba591e92833930a7,
2026-01-29; the same signatures in the verl 0.9.1 wheel and at tag v0.7.0):
    verl/trainer/ppo/ray_trainer.py  apply_kl_penalty(data, kl_ctrl, kl_penalty)
    verl/trainer/ppo/rollout_corr_helper.py  compute_rollout_correction_and_add_to_batch(batch, ...)
        (since v0.7.0)
    verl/trainer/ppo/ray_trainer.py  compute_advantage(data, adv_estimator, ...)

OpenRLHF (https://github.com/OpenRLHF/OpenRLHF, commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7,
tag v0.11.0; the same signatures in the openrlhf 0.11.2 wheel):
    openrlhf/trainer/ppo_utils/experience_maker.py
        RemoteExperienceMaker.compute_advantages_and_returns(self, experiences)
    openrlhf/trainer/ppo_trainer.py  BasePPOTrainer._compute_rollout_stats(self, experiences)
        (since v0.10.0)

NeMo-RL (https://github.com/NVIDIA-NeMo/RL, commit 7ea279abfbeb698b092856d0dab61e7cf39bc909,
2026-08-22): nemo_rl/algorithms/advantage_estimator.py
    GRPOAdvantageEstimator / ReinforcePlusPlusAdvantageEstimator (both since v0.6.0) /
    GeneralizedAdvantageEstimator (since v0.7.0) .compute_advantage(self, prompt_ids, rewards, mask, ...)
    nemo_rl/algorithms/grpo.py  _apply_message_level_advantage_penalties(train_data, message_logs, ...)
        (since v0.7.0): its span writes to train_data['advantages'] are by design and allowed; up to
        34d32bfa5965 they went through advantages expanded from per-sample values (#2787, fixed by
        09b63d9bd: clone first), which a write through shared elements reports even where allowed.

TRL (https://github.com/huggingface/trl, read in the trl 1.16.0 wheel from PyPI, tag v1.16.0,
built 2026-10-15): the batch each trainer's loss reads, `inputs`:
    trl/trainer/grpo_trainer.py  GRPOTrainer.compute_loss(self, model, inputs, ...) (since v0.14.0)
    trl/trainer/rloo_trainer.py  RLOOTrainer.compute_loss(self, model, inputs, ...) (since v0.22.0, the
        GRPO-style rewrite; the older RLOOTrainer ran its own loop and never calls it)
    trl/trainer/dpo_trainer.py  DPOTrainer.compute_loss(self, model, inputs, ...)
    PPOTrainer is gone from trl 1.16.0 (it lived in trl.experimental.ppo up to v1.9.0); OnlineDPOTrainer
    (trl.experimental) builds its batch inside training_step and passes no dict of tensors to guard.

Version drift is expected: a preset function missing from the installed version (a module
that does not exist, a function or method that is gone, an argument renamed) is one
`kvguard:` line at exit, never an error (`kvguard._report.diagnostics`).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import Any, Iterable, Optional

from kvguard._errors import ConfigError
from kvguard._text import did_you_mean, plural

_TARGET = re.compile(r"^\s*([A-Za-z_][\w.]*):([A-Za-z_][\w.]*)\(\s*([A-Za-z_]\w*)\s*\)\s*$")


@dataclasses.dataclass(frozen=True)
class Target:
    """A function to guard on one argument: `module:qualname(argname)`, the grammar of
    `KVGUARD_TARGETS` entries (read by `_config.parse_targets`) and of every preset's functions."""

    module: str
    qualname: str
    argname: str

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}({self.argname})"


def parse_target(item: str, source: str) -> Target:
    """One explicit `module:qualname(argname)`; a `ConfigError` naming `source` if it is not one."""
    match = _TARGET.match(item)
    if match is None:
        raise ConfigError(
            f"invalid target {item.strip()!r} in {source}; expected module:qualname(argname), "
            "e.g. myrl.loss:compute_advantages_and_returns(rollout_data)"
        )
    return Target(*match.groups())


@dataclasses.dataclass(frozen=True)
class Function:
    """One function a preset guards, where the preset's commit has it."""

    target: str  # module:qualname(argname) at the preset's commit
    file: str  # its file in the repository at that commit
    why: str  # what an in-place write there would corrupt
    since: str = ""  # the first release that has it, when the framework is older than that
    also: tuple[tuple[str, str], ...] = ()  # (target, where) of the same function in older releases
    allow: str = ""  # KVGUARD_ALLOW value for writes the framework makes on purpose
    intended: tuple[str, ...] = ()  # paths it writes by design: allowed in its guard with no setting


@dataclasses.dataclass(frozen=True)
class Preset:
    """A framework's functions worth guarding, read from its source at `commit`."""

    name: str  # what KVGUARD_TARGETS says
    framework: str  # how messages name the framework
    package: str  # its top-level import name
    distribution: str  # its pip name, for the version in messages
    repo: str
    commit: str
    date: str
    argument: str  # what the guarded argument holds
    functions: tuple[Function, ...]


@dataclasses.dataclass(frozen=True)
class PresetTarget(Target):
    """A target that came from a preset: missing in the installed version is one line at exit."""

    preset: str = ""
    slot: str = ""  # the preset function's target at the preset's commit; older locations share it
    intended: tuple[str, ...] = ()  # allow= patterns its guard gets (`Function.intended`)


SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"
OPENRLHF_COMMIT = "3c3be6234e0cb353e76bb8019947db9dfe99fca7"
NEMO_RL_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
TRL_TAG = "v1.16.0"  # read in the PyPI wheel, which names no commit

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(
        "slime", "slime", "slime", "slime", "THUDM/slime", SLIME_COMMIT, "2026-08-21",
        "rollout_data: a dict of per-sample lists (log_probs, ref_log_probs, values, loss_masks, rewards, ...)",
        (
            Function(
                "slime.backends.megatron_utils.loss:compute_advantages_and_returns(rollout_data)",
                "slime/backends/megatron_utils/loss.py",
                "places the per-sample KL list rollout_data['kl'] (logged as rollout/kl) and reads "
                "log_probs, ref_log_probs, values and loss_masks, which the training step reuses; "
                "v0.3.1's PPO branch scaled the stored KL in place (k *= kl_coef), silently "
                "rewriting the logged KL (fixed by commit 045310b2b490)"),
            Function(
                "slime.observability.train_metric_utils:log_rollout_data(rollout_data)",
                "slime/observability/train_metric_utils.py",
                "summarises every per-sample list for logging after the advantages are computed "
                "and before train_actor trains on the same tensors: a write while logging changes "
                "what is trained on",
                also=(("slime.backends.megatron_utils.data:log_rollout_data(rollout_data)",
                       "v0.3.1 (a6272da0d4f3) and earlier"),)),
        )),
    Preset(
        "verl", "verl", "verl", "verl", "volcengine/verl", VERL_COMMIT, "2026-01-29",
        "data / batch: a DataProto whose .batch is a TensorDict (old_log_probs, ref_log_prob, "
        "token_level_scores, values, response_mask, ...)",
        (
            Function(
                "verl.trainer.ppo.ray_trainer:apply_kl_penalty(data)",
                "verl/trainer/ppo/ray_trainer.py",
                "reads old_log_probs and ref_log_prob to turn token_level_scores into "
                "token_level_rewards; old_log_probs is the denominator of the actor's PPO ratio "
                "later, and the scores are logged (critic/score/*)"),
            Function(
                "verl.trainer.ppo.rollout_corr_helper:compute_rollout_correction_and_add_to_batch(batch)",
                "verl/trainer/ppo/rollout_corr_helper.py",
                "derives importance weights and a rejection mask from old_log_probs, "
                "rollout_log_probs and response_mask and places a new response_mask; writing "
                "the old mask or the log-probs in place changes the actor's loss inputs",
                since="v0.7.0"),
            Function(
                "verl.trainer.ppo.ray_trainer:compute_advantage(data)",
                "verl/trainer/ppo/ray_trainer.py",
                "runs the advantage estimator (a registered custom one included) on "
                "token_level_rewards, values and response_mask and places advantages and returns; "
                "values are reused by the critic update and the rewards are logged "
                "(critic/rewards/*)"),
        )),
    Preset(
        "openrlhf", "OpenRLHF", "openrlhf", "openrlhf", "OpenRLHF/OpenRLHF", OPENRLHF_COMMIT,
        "v0.11.0",
        "experiences: a list of Experience dataclasses (rewards, kl, values, action_mask, info, ...)",
        (
            Function(
                "openrlhf.trainer.ppo_utils.experience_maker:RemoteExperienceMaker."
                "compute_advantages_and_returns(experiences)",
                "openrlhf/trainer/ppo_utils/experience_maker.py",
                "shapes rewards with each Experience's kl and computes advantages and returns "
                "from values and action_mask; the experiences then go to the actor and critic "
                "replay buffers (values are the critic's old values) and info['reward'] is logged",
                allow="experiences[*].rewards"),
            Function(
                "openrlhf.trainer.ppo_trainer:BasePPOTrainer._compute_rollout_stats(experiences)",
                "openrlhf/trainer/ppo_trainer.py",
                "logs reward, response length and truncation rate from the experiences right "
                "before they are pushed to the actor and critic for training",
                since="v0.10.0"),
        )),
    Preset(
        "nemo-rl", "NeMo-RL", "nemo_rl", "nemo-rl", "NVIDIA-NeMo/RL", NEMO_RL_COMMIT, "2026-08-22",
        "rewards: the per-sample reward tensor (repeated_batch['total_reward']); train_data: the training "
        "batch (a BatchedDataDict: advantages, token masks, log-probabilities, ...)",
        (*(
            Function(
                f"nemo_rl.algorithms.advantage_estimator:{cls}.compute_advantage(rewards)",
                "nemo_rl/algorithms/advantage_estimator.py",
                f"{what}; grpo.py / ppo.py log the same rewards tensor afterwards as the step's "
                "'reward' metric, so a write in the estimator changes the logged reward",
                since=since)
            for cls, what, since in (
                ("GRPOAdvantageEstimator", "GRPO: baseline and std per prompt from rewards", "v0.6.0"),
                ("ReinforcePlusPlusAdvantageEstimator", "REINFORCE++: rewards minus a baseline, "
                 "KL in reward, global whitening", "v0.6.0"),
                ("GeneralizedAdvantageEstimator", "PPO/GAE: token-level rewards from rewards, KL "
                 "and the critic's values", "v0.7.0"),
            )
        ), Function(
            "nemo_rl.algorithms.grpo:_apply_message_level_advantage_penalties(train_data)",
            "nemo_rl/algorithms/grpo.py",
            "overwrites the advantages of flagged assistant-message spans in place, on purpose; GRPO may "
            "hand it advantages expanded from per-sample values (stride 0 over tokens), so a one-token "
            "span write changed the whole row, the per-sample tensor and, for the raw-reward estimator, "
            "the rewards (NVIDIA-NeMo/RL #2787, fixed by 09b63d9bd: clone first)",
            since="v0.7.0", intended=("train_data['advantages']",)),
        )),
    Preset(
        "trl", "TRL", "trl", "trl", "huggingface/trl", TRL_TAG, "2026-10-15",
        "inputs: the batch dict the trainer's loss reads (GRPO: prompt/completion ids and masks, advantages, "
        "old_per_token_logps, ref_per_token_logps; RLOO: old_logps, advantages; DPO: input_ids, masks, "
        "precomputed ref_chosen_logps / ref_rejected_logps)",
        (
            Function(
                "trl.trainer.grpo_trainer:GRPOTrainer.compute_loss(inputs)",
                "trl/trainer/grpo_trainer.py",
                "reads one buffered slice of _generate_and_score_completions' output: advantages, "
                "old_per_token_logps (the denominator of the clipped ratio), ref_per_token_logps (the KL term) "
                "and the masks; with num_iterations > 1 _prepare_inputs serves the same buffered tensors to the "
                "loss again, so a write in a custom _compute_loss (a subclass's override is guarded through "
                "this one) changes what the next iterations train on",
                since="v0.14.0"),
            Function(
                "trl.trainer.rloo_trainer:RLOOTrainer.compute_loss(inputs)",
                "trl/trainer/rloo_trainer.py",
                "reads the buffered batch's leave-one-out advantages (rewards minus the KL penalty, less "
                "their baseline), old_logps and the masks, reused across num_iterations as in GRPO",
                since="v0.22.0"),
            Function(
                "trl.trainer.dpo_trainer:DPOTrainer.compute_loss(inputs)",
                "trl/trainer/dpo_trainer.py",
                "reads the collated pairs (input_ids, attention_mask, completion_mask) and, with "
                "precompute_ref_log_probs, ref_chosen_logps / ref_rejected_logps; after the loss the same "
                "masks and reference log-probs make the logged rewards/chosen, rewards/margins, entropy and "
                "token counts, so a write changes the loss and the metrics alike"),
        )),
)}

_OTHER_SPELLINGS = {"nemo_rl": "nemo-rl", "nemorl": "nemo-rl"}


def preset_for(name: str) -> Optional[Preset]:
    """The preset called `name` (any case; `nemo_rl` and `nemo-rl` alike), or None."""
    key = name.strip().lower()
    return PRESETS.get(_OTHER_SPELLINGS.get(key, key))


def expand(name: str, source: str, words: tuple[str, ...] = ()) -> tuple[PresetTarget, ...]:
    """The targets of preset `name`, older locations included; a `ConfigError` naming `source` if unknown.

    `words` are the other names a target without a colon may be (`autograd`, `weights`, `data`):
    the error suggests the closest of them and the presets, the word a typo most likely meant.
    """
    preset = preset_for(name)
    if preset is None:
        also = f" or one of {', '.join(words)}" if words else ""
        raise ConfigError(
            f"invalid target {name.strip()!r} in {source}; without a colon it names a preset{also}, and none "
            f"is called that{did_you_mean(name.strip(), (*PRESETS, *words))} (known presets: {', '.join(PRESETS)}); "
            "a function is module:qualname(argname), e.g. myrl.loss:compute_advantages_and_returns(rollout_data)")
    out = []
    for function in preset.functions:
        for spelled in (function.target, *(where for where, _ in function.also)):
            target = parse_target(spelled, f"preset {preset.name}")
            out.append(PresetTarget(target.module, target.qualname, target.argname, preset.name, function.target,
                                    function.intended))
    return tuple(out)


def missing_reason(target: Target, module: Any = None) -> Optional[str]:
    """Why a preset target's function is not in its imported module, or None.

    None for a target that is not a preset's, for a module that is not imported, and when
    the function is there with the named argument. Imports nothing.
    """
    if not isinstance(target, PresetTarget):
        return None
    try:
        return _missing_reason(target, module if module is not None else sys.modules.get(target.module))
    except Exception:  # noqa: BLE001 - called from an import hook: never raise
        return None


def _missing_reason(target: PresetTarget, module: Any) -> Optional[str]:
    if module is None:
        return None
    owner = module
    for part in target.qualname.split("."):
        try:
            owner = vars(owner)[part] if isinstance(owner, type) and part in vars(owner) else getattr(owner, part)
        except Exception:  # noqa: BLE001 - an attribute that raises is as good as missing
            return f"{target.module} has no {target.qualname}"
    function = getattr(owner, "__func__", owner)  # a staticmethod / classmethod read from the class dict
    try:
        import inspect

        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None  # not introspectable: let the patch say what it says
    if target.argname not in parameters:
        name = target.qualname.rpartition(".")[2]
        return f"{name}() has no parameter {target.argname!r} (it takes {', '.join(parameters) or 'none'})"
    return None


def is_preset(target: Target) -> bool:
    return isinstance(target, PresetTarget)


def describe(names: Iterable[str] = (), width: int = 100) -> str:
    """What `python -m kvguard presets` prints: each preset, what it guards, the source and why."""
    import textwrap

    chosen = [preset_for(n) or _unknown(n) for n in names] or list(PRESETS.values())
    blocks = []
    for preset in chosen:
        at = "commit" if len(preset.commit) == 40 else "tag"  # a tag where a wheel was read (trl)
        head = [f"{preset.name}: https://github.com/{preset.repo} at {at} {preset.commit} ({preset.date})",
                *textwrap.wrap(f"argument: {preset.argument}", width, initial_indent="  ",
                               subsequent_indent="    ")]
        for function in preset.functions:
            head.append(f"  {function.target}")
            rows = [("source", f"{function.file} @ {preset.commit[:12]}"
                               + (f" (since {function.since})" if function.since else ""))]
            rows += [("before", f"{where} in {when}") for where, when in function.also]
            rows.append(("why", function.why))
            if function.allow:
                rows.append(("allow", f"writes the framework makes on purpose: KVGUARD_ALLOW={function.allow!r}"))
            if function.intended:
                rows.append(("allowed", "writes it makes by design, allowed with no setting (a write through "
                                        "elements an expand made share is still reported): "
                                        + ", ".join(function.intended)))
            for key, text in rows:
                head.extend(textwrap.wrap(text, width, initial_indent=f"    {key:<7}", subsequent_indent=" " * 11,
                                          break_on_hyphens=False, break_long_words=False))
        blocks.append("\n".join(head))
    return "\n\n".join(blocks)


def _unknown(name: str) -> Preset:
    raise ConfigError(f"no preset is called {name.strip()!r}{did_you_mean(name.strip(), PRESETS)}; "
                      f"known presets: {', '.join(PRESETS)}")

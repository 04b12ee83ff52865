"""Replica of verl/trainer/ppo/ray_trainer.py (b178a3cd56f5; verl 0.9.1): the module-level data steps.

`apply_kl_penalty(data, kl_ctrl, kl_penalty="kl")` and `compute_advantage(data, adv_estimator,
gamma, lam, num_repeat, norm_adv_by_std_in_grpo, config)`, each reading `data.batch` (a
TensorDict) and placing new entries into it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import AdvantageEstimator


def apply_kl_penalty(data: DataProto, kl_ctrl: core_algos.AdaptiveKLController, kl_penalty="kl"):
    response_mask = data.batch["response_mask"]
    scores = data.batch["token_level_scores"]
    kld = core_algos.kl_penalty(data.batch["old_log_probs"], data.batch["ref_log_prob"], kl_penalty=kl_penalty)
    kld = kld * response_mask
    beta = kl_ctrl.value
    data.batch["token_level_rewards"] = scores - beta * kld
    current_kl = ((kld * response_mask).sum(-1) / response_mask.sum(-1)).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=len(data))
    return data, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def compute_response_mask(data: DataProto) -> torch.Tensor:
    length = data.batch["responses"].size(1)
    return data.batch["attention_mask"][:, -length:]


def compute_advantage(
    data: DataProto,
    adv_estimator: AdvantageEstimator,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
) -> DataProto:
    if "response_mask" not in data.batch.keys():
        data.batch["response_mask"] = compute_response_mask(data)
    if adv_estimator == AdvantageEstimator.GAE:
        advantages, returns = core_algos.compute_gae_advantage_return(
            token_level_rewards=data.batch["token_level_rewards"], values=data.batch["values"],
            response_mask=data.batch["response_mask"], gamma=gamma, lam=lam)
    elif adv_estimator == AdvantageEstimator.GRPO:
        advantages, returns = core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=data.batch["token_level_rewards"], response_mask=data.batch["response_mask"],
            index=data.non_tensor_batch["uid"], norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    else:  # a registered estimator, a user's own included
        advantages, returns = core_algos.get_adv_estimator_fn(adv_estimator)(
            token_level_rewards=data.batch["token_level_rewards"], response_mask=data.batch["response_mask"],
            config=config, index=data.non_tensor_batch.get("uid"))
    data.batch["advantages"] = advantages
    data.batch["returns"] = returns
    return data

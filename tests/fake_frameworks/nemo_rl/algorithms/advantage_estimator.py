"""Replica of nemo_rl/algorithms/advantage_estimator.py (7ea279abfbeb).

Each estimator's `compute_advantage(self, prompt_ids, rewards, mask, ...)` takes the
per-sample reward tensor that grpo.py / ppo.py later log as the step's reward.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_rl.algorithms.utils import calculate_baseline_and_std_per_prompt


class GRPOAdvantageEstimator:
    def __init__(self, estimator_config: Any, loss_config: Any) -> None:
        self.use_leave_one_out_baseline = estimator_config["use_leave_one_out_baseline"]
        self.normalize_rewards = estimator_config["normalize_rewards"]

    def compute_advantage(self, prompt_ids, rewards, mask, **kwargs):
        baseline, std = calculate_baseline_and_std_per_prompt(
            prompt_ids, rewards, torch.ones_like(rewards), leave_one_out_baseline=self.use_leave_one_out_baseline)
        advantages = (rewards - baseline).unsqueeze(-1)
        if self.normalize_rewards:
            nonzero = std > 0
            advantages[nonzero] = advantages[nonzero] / (std.unsqueeze(-1)[nonzero] + 1e-6)
        return advantages.expand(mask.shape)


class ReinforcePlusPlusAdvantageEstimator:
    def __init__(self, estimator_config: Any, loss_config: Any) -> None:
        self.minus_baseline = estimator_config.get("minus_baseline", True)

    def compute_advantage(self, prompt_ids, rewards, mask, logprobs_policy=None, logprobs_reference=None, **kwargs):
        if self.minus_baseline:
            mean, _ = calculate_baseline_and_std_per_prompt(prompt_ids, rewards, torch.ones_like(rewards),
                                                            leave_one_out_baseline=False)
            adv = rewards - mean
        else:
            adv = rewards
        adv = adv.unsqueeze(-1).expand(mask.shape)
        mean = (adv * mask).sum() / mask.sum()
        rstd = (((adv - mean) ** 2) * mask).sum().div(mask.sum()).clamp(min=1e-8).rsqrt()
        return (adv - mean) * rstd


class GeneralizedAdvantageEstimator:
    def __init__(self, estimator_config: Any, loss_config: Any) -> None:
        self.gamma = estimator_config.get("gamma", 1.0)
        self.gae_lambda = estimator_config.get("gae_lambda", 0.95)

    def compute_advantage(self, prompt_ids, rewards, mask, values, reference_logprobs=None, logprobs=None, **kwargs):
        last = mask.shape[1] - 1 - mask.fliplr().argmax(dim=1)
        token_rewards = torch.zeros(rewards.shape[0], mask.shape[1], dtype=rewards.dtype)
        token_rewards[torch.arange(rewards.shape[0]), last] += rewards
        running, out = torch.zeros(rewards.shape[0]), []
        for t in reversed(range(mask.shape[1])):
            next_values = values[:, t + 1] if t + 1 < mask.shape[1] else 0.0
            running = token_rewards[:, t] + self.gamma * next_values - values[:, t] + self.gamma * self.gae_lambda * running
            out.append(running)
        advantages = torch.stack(out[::-1], dim=1)
        return advantages * mask, (advantages + values) * mask

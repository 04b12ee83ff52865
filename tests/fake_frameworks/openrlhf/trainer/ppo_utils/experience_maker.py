"""Replica of openrlhf/trainer/ppo_utils/experience_maker.py (v0.11.0): `RemoteExperienceMaker`.

`compute_advantages_and_returns(self, experiences)` as upstream orders it: rewards promoted
to float32, length penalties, group baselines, KL-shaped token rewards, GAE or cumulative
returns, `experience.kl = None`, then whitening. No Ray: the model groups are not modelled.
"""

from __future__ import annotations

from typing import Any, List

import torch

from openrlhf.models.utils import compute_reward
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties


class RemoteExperienceMaker:
    def __init__(self, kl_controller: Any, strategy: Any) -> None:
        self.strategy = strategy
        self.args = strategy.args
        self.advantage_estimator = strategy.args.algo.advantage.estimator
        self.kl_ctl = kl_controller

    @torch.no_grad()
    def compute_advantages_and_returns(self, experiences: List[Experience]) -> List[Experience]:
        args = self.strategy.args
        for experience in experiences:
            experience.rewards = experience.rewards.to(torch.promote_types(experience.rewards.dtype, torch.float32))
        apply_length_penalties(experiences, args)

        n = args.rollout.n_samples_per_prompt
        sizes = [len(e.index) for e in experiences]
        order = torch.tensor([i for e in experiences for i in e.index])
        flat = torch.empty(sum(sizes))
        flat[order] = torch.cat([e.rewards for e in experiences])
        grouped = flat.reshape(-1, n)
        if self.advantage_estimator in ("reinforce_baseline", "dr_grpo"):
            grouped = grouped - grouped.mean(-1, keepdim=True)
        shaped = grouped.reshape(-1)[order].split(sizes)

        for experience, reward in zip(experiences, shaped):
            token_rewards = compute_reward(reward, self.kl_ctl.value, experience.kl, action_mask=experience.action_mask)
            if self.advantage_estimator == "gae":
                experience.advantages, experience.returns = self.get_advantages_and_returns(
                    experience.values, token_rewards, experience.action_mask,
                    args.algo.advantage.gamma, args.algo.advantage.lambd)
            else:
                experience.returns = self.get_cumulative_returns(token_rewards, experience.action_mask,
                                                                 args.algo.advantage.gamma)
                experience.advantages = experience.returns.clone()
            experience.info["return"] = token_rewards.sum(dim=-1)
            experience.kl = None

        if self.advantage_estimator in ("gae", "reinforce", "reinforce_baseline"):
            advantages = torch.cat([e.advantages.flatten() for e in experiences]).float()
            masks = torch.cat([e.action_mask.flatten() for e in experiences])
            mean = (advantages * masks).sum() / masks.sum()
            rstd = (((advantages - mean) ** 2) * masks).sum().div(masks.sum()).clamp(min=1e-8).rsqrt()
            for e in experiences:
                e.advantages = (e.advantages - mean) * rstd
        return experiences

    @torch.no_grad()
    def get_advantages_and_returns(self, values: torch.Tensor, rewards: torch.Tensor, action_mask: torch.Tensor,
                                   gamma: float, lambd: float):
        values, rewards = action_mask * values, action_mask * rewards
        running, out = 0.0, []
        length = rewards.size(1)
        for t in reversed(range(length)):
            next_values = values[:, t + 1] if t + 1 < length else 0.0
            running = rewards[:, t] + gamma * next_values - values[:, t] + gamma * lambd * running
            out.append(running)
        advantages = torch.stack(out[::-1], dim=1)
        return advantages, advantages + values

    @torch.no_grad()
    def get_cumulative_returns(self, rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float):
        rewards = action_mask * rewards
        returns = torch.zeros_like(rewards)
        running = torch.zeros(rewards.size(0))
        for t in reversed(range(rewards.size(1))):
            running = rewards[:, t] + gamma * running
            returns[:, t] = running
        return returns

"""Replica of verl/trainer/ppo/core_algos.py: the pieces ray_trainer's functions call."""

from __future__ import annotations

from collections import defaultdict
from enum import Enum
from typing import Callable

import numpy as np
import torch


class AdvantageEstimator(str, Enum):
    GAE = "gae"
    GRPO = "grpo"


_ESTIMATORS: dict[str, Callable] = {}


def register_adv_est(name: str) -> Callable:
    def register(fn: Callable) -> Callable:
        _ESTIMATORS[name] = fn
        return fn
    return register


def get_adv_estimator_fn(name: str) -> Callable:
    return _ESTIMATORS[name]


class FixedKLController:
    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


AdaptiveKLController = FixedKLController  # replica: the adaptive schedule is not modelled


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    raise NotImplementedError(kl_penalty)


def compute_gae_advantage_return(token_level_rewards: torch.Tensor, values: torch.Tensor,
                                 response_mask: torch.Tensor, gamma: float, lam: float):
    with torch.no_grad():
        running = torch.zeros(token_level_rewards.shape[0])
        reversed_advantages = []
        length = token_level_rewards.shape[-1]
        for t in reversed(range(length)):
            next_values = values[:, t + 1] if t + 1 < length else 0.0
            delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
            running = delta + gamma * lam * running
            reversed_advantages.append(running)
        advantages = torch.stack(reversed_advantages[::-1], dim=1)
        returns = advantages + values
        mean = (advantages * response_mask).sum() / response_mask.sum()
        std = (((advantages - mean) ** 2) * response_mask).sum() / response_mask.sum()
        advantages = (advantages - mean) * torch.rsqrt(std + 1e-8) * response_mask
    return advantages, returns


def compute_grpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                   index: np.ndarray, norm_adv_by_std_in_grpo: bool = True):
    scores = token_level_rewards.sum(dim=-1)
    groups: dict = defaultdict(list)
    for i, uid in enumerate(index):
        groups[uid].append(i)
    out = torch.zeros_like(scores)
    for members in groups.values():
        group = scores[members]
        centred = group - group.mean()
        out[members] = centred / (group.std() + 1e-6) if norm_adv_by_std_in_grpo and len(members) > 1 else centred
    advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages

"""Replica of slime/backends/megatron_utils/loss.py at v0.3.1 (a6272da0d4f3).

`compute_advantages_and_returns(args, rollout_data)` as v0.3.1 calls it: per-sample KL
placed into `rollout_data["kl"]`, then the PPO branch shapes rewards from those very KL
tensors in place (`k *= kl_coef`, `k[-1] += reward`), the bug slime fixed in 045310b2b490.
One pipeline stage and one context-parallel rank stand in for Megatron's `mpu`.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

import torch

RolloutBatch = dict[str, Any]


def _is_pipeline_last_stage() -> bool:
    return True  # replica: one pipeline stage


def _context_parallel_rank() -> int:
    return 0  # replica: no context parallelism


def _approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_loss_type: str) -> torch.Tensor:
    ratio = log_probs.float() - ref_log_probs.float()
    if kl_loss_type == "k3":
        return torch.exp(-ratio) - 1 + ratio
    return ratio


def _gae(values: list[torch.Tensor], rewards: list[torch.Tensor], gamma: float, lambd: float):
    advantages, returns = [], []
    for value, reward in zip(values, rewards):
        running = torch.zeros((), dtype=reward.dtype)
        out = []
        for t in reversed(range(reward.numel())):
            next_value = value[t + 1] if t + 1 < value.numel() else 0.0
            running = reward[t] + gamma * next_value - value[t] + gamma * lambd * running
            out.append(running)
        advantage = torch.stack(out[::-1])
        advantages.append(advantage)
        returns.append(advantage + value)
    return advantages, returns


def compute_advantages_and_returns(args: Namespace, rollout_data: RolloutBatch) -> None:
    log_probs = rollout_data.get("log_probs")
    ref_log_probs = rollout_data.get("ref_log_probs")
    rewards = rollout_data.get("rewards")
    values = rollout_data.get("values")
    if not _is_pipeline_last_stage():
        return

    if args.kl_coef == 0 or not log_probs:
        kl = [torch.zeros_like(x, dtype=torch.float32) for x in (log_probs or values)]
    else:
        kl = [_approx_kl(lp, ref, args.kl_loss_type) for lp, ref in zip(log_probs, ref_log_probs)]
    rollout_data["kl"] = kl

    if args.advantage_estimator == "ppo":
        old_rewards, rewards = rewards, []
        kl_coef = -args.kl_coef
        cp_rank = _context_parallel_rank()
        for reward, k in zip(old_rewards, kl, strict=False):
            k *= kl_coef  # v0.3.1: k IS rollout_data["kl"][i]
            if cp_rank == 0:
                k[-1] += reward
            rewards.append(k)
        advantages, returns = _gae(values, rewards, args.gamma, args.lambd)
    elif args.advantage_estimator == "grpo":
        returns = [torch.full_like(k, float(r)) - args.kl_coef * k for r, k in zip(rewards, kl)]
        advantages = list(returns)
    else:
        raise NotImplementedError(args.advantage_estimator)

    rollout_data["advantages"] = advantages
    rollout_data["returns"] = returns

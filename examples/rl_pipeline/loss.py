"""`compute_advantages_and_returns(args, rollout_data)`: the function a trainer calls once per
rollout, in the shape slime gives it (`slime/backends/megatron_utils/loss.py`).

It fills `rollout_data["kl"]` (logged later as the rollout KL curve), then
`rollout_data["advantages"]` and `rollout_data["returns"]`, one tensor per sample. With
`args.bug` the PPO branch shapes the token-level rewards in place on the KL tensors
themselves, the bug kvguard is here to catch: training gets the right rewards, but the
logged KL becomes `-kl_coef * kl`, plus the reward on each sample's last token on the
context-parallel rank that holds it (cp rank 0).
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

import torch
from megatron.core import mpu

from .ppo_utils import (
    compute_approx_kl,
    distributed_masked_whiten,
    get_advantages_and_returns_batch,
    get_grpo_returns,
    get_reinforce_plus_plus_baseline_advantages,
    local_masks,
)


def compute_advantages_and_returns(args: Namespace, rollout_data: dict[str, Any]) -> None:
    log_probs: list[torch.Tensor] | None = rollout_data.get("log_probs")
    ref_log_probs: list[torch.Tensor] | None = rollout_data.get("ref_log_probs")
    rewards: list[float] = rollout_data["rewards"]
    values: list[torch.Tensor] | None = rollout_data.get("values")
    loss_masks: list[torch.Tensor] = rollout_data["loss_masks"]
    response_lengths: list[int] = rollout_data["response_lengths"]
    total_lengths: list[int] = rollout_data["total_lengths"]

    # Only the last pipeline stage has logits, hence log-probs: the others return at once.
    if not mpu.is_pipeline_last_stage():
        return
    assert log_probs is not None and ref_log_probs is not None

    kl = [compute_approx_kl(lp, ref, args.kl_type) for lp, ref in zip(log_probs, ref_log_probs)]
    rollout_data["kl"] = kl  # logged after the step as the rollout KL

    if args.advantage_estimator == "ppo":
        assert values is not None, "PPO needs the critic's values"
        cp_rank = mpu.get_context_parallel_rank()
        token_level_rewards = []
        for reward, k in zip(rewards, kl):
            if args.bug:
                k *= -args.kl_coef  # BUG: k IS rollout_data["kl"][i]
                if cp_rank == 0:  # the sequence's last token lives on cp rank 0
                    k[-1] += reward
                shaped = k
            else:
                shaped = k * -args.kl_coef  # a new tensor: the logged KL stays intact
                if cp_rank == 0:
                    shaped[-1] += reward
            token_level_rewards.append(shaped)
        advantages, returns = get_advantages_and_returns_batch(
            total_lengths, response_lengths, values, token_level_rewards, args.gamma, args.lambd)

    elif args.advantage_estimator == "grpo":
        returns = get_grpo_returns(torch.tensor(rewards, dtype=torch.float32), kl)
        advantages = list(returns)

    elif args.advantage_estimator == "reinforce_plus_plus_baseline":
        advantages = get_reinforce_plus_plus_baseline_advantages(
            torch.tensor(rewards, dtype=torch.float32), kl, args.kl_coef)
        returns = advantages

    else:
        raise NotImplementedError(f"advantage_estimator {args.advantage_estimator!r}")

    if args.normalize_advantages:
        # Each rank holds only its tokens: the statistics span data *and* context parallel ranks.
        masks = torch.cat(local_masks(loss_masks, total_lengths, response_lengths))
        whitened = distributed_masked_whiten(torch.cat(advantages), masks,
                                             mpu.get_data_parallel_group(with_context_parallel=True))
        advantages = list(torch.split(whitened, [a.numel() for a in advantages]))

    rollout_data["advantages"] = advantages
    rollout_data["returns"] = returns

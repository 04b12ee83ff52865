"""KL estimators, advantage estimators and whitening, on per-sample lists of tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .cp_utils import gather_with_cp, slice_with_cp

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


def compute_approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from sampled tokens (Schulman's k1, k2, k3).

    k1 is the log-ratio (unbiased, high variance), k2 half its square, k3
    `exp(-r) - 1 + r` (unbiased and non-negative); low_var_kl is k3 clamped to [-10, 10].
    """
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return log_ratio.square() / 2
    if kl_type in ("k3", "low_var_kl"):
        kl = torch.expm1(-log_ratio) + log_ratio
        return kl.clamp(-10, 10) if kl_type == "low_var_kl" else kl
    raise ValueError(f"unknown KL estimator {kl_type!r}; expected one of {', '.join(KL_TYPES)}")


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one full response; returns (advantages, returns)."""
    advantages = torch.zeros_like(rewards)
    last = rewards.new_zeros(())
    for t in reversed(range(rewards.numel())):
        next_value = values[t + 1] if t + 1 < values.numel() else values.new_zeros(())
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lambd * last
        advantages[t] = last
    return advantages, advantages + values


def get_advantages_and_returns_batch(total_lengths: list[int], response_lengths: list[int],
                                     values: list[torch.Tensor], rewards: list[torch.Tensor],
                                     gamma: float, lambd: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """PPO's GAE per sample. GAE runs backwards over the whole response, so with context
    parallelism each sample is gathered from every cp rank first, then sliced back."""
    advantages, returns = [], []
    for total, response, value, reward in zip(total_lengths, response_lengths, values, rewards):
        full_adv, full_ret = gae(gather_with_cp(reward, total, response), gather_with_cp(value, total, response),
                                 gamma, lambd)
        advantages.append(slice_with_cp(full_adv, total, response))
        returns.append(slice_with_cp(full_ret, total, response))
    return advantages, returns


def get_grpo_returns(rewards: torch.Tensor, kl: list[torch.Tensor]) -> list[torch.Tensor]:
    """GRPO: each token of sample i gets its group-normalised reward."""
    return [torch.ones_like(kl[i]) * rewards[i] for i in range(len(kl))]


def get_reinforce_plus_plus_baseline_advantages(rewards: torch.Tensor, kl: list[torch.Tensor],
                                                kl_coef: float) -> list[torch.Tensor]:
    """REINFORCE++ with baseline: the baseline-subtracted reward minus the per-token KL penalty."""
    return [torch.ones_like(kl[i]) * rewards[i] - kl_coef * kl[i] for i in range(len(kl))]


def distributed_masked_whiten(values: torch.Tensor, mask: torch.Tensor, group: object,
                              shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Whiten `values` with the masked mean and variance of every rank in `group`.

    The three sums travel in one all-reduce of a new tensor; a rank with no tokens
    contributes zeros (it must still join the collective).
    """
    mask = mask.to(values.dtype)
    stats = torch.stack([(values * mask).sum(), mask.sum(), (values.square() * mask).sum()])
    dist.all_reduce(stats, group=group)  # type: ignore[arg-type]
    total, count, squares = stats.unbind()
    mean = total / count.clamp(min=1)
    variance = (squares / count.clamp(min=1) - mean.square()) * count / (count - 1).clamp(min=1)
    whitened = (values - mean) * torch.rsqrt(variance + eps)
    return whitened if shift_mean else whitened + mean


def local_masks(loss_masks: list[torch.Tensor], total_lengths: list[int],
                response_lengths: list[int]) -> list[torch.Tensor]:
    """Loss masks (kept at full response length) cut to this cp rank's tokens."""
    return [slice_with_cp(m, t, r) for m, t, r in zip(loss_masks, total_lengths, response_lengths)]

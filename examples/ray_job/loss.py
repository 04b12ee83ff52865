"""`compute_advantages_and_returns(args, rollout_data)`, with the in-place KL shaping bug.

`rollout_data["kl"]` is what the trainer logs as the rollout KL after the step; shaping the
token-level rewards on those very tensors (`k *= -kl_coef`) rewrites the logged curve.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

import torch


def compute_advantages_and_returns(args: Namespace, rollout_data: dict[str, Any]) -> None:
    kl = [lp - ref for lp, ref in zip(rollout_data["log_probs"], rollout_data["ref_log_probs"])]
    rollout_data["kl"] = kl  # logged after the step
    returns = []
    for reward, k in zip(rollout_data["rewards"], kl):
        k *= -args.kl_coef  # BUG: k IS rollout_data["kl"][i]
        k[-1] += reward
        returns.append(k.flip(0).cumsum(0).flip(0))
    rollout_data["returns"] = returns
    rollout_data["advantages"] = [r - r.mean() for r in returns]


def make_rollout(n: int = 2, t: int = 6, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"log_probs": [torch.randn(t, generator=gen) for _ in range(n)],
            "ref_log_probs": [torch.randn(t, generator=gen) for _ in range(n)],
            "rewards": [1.0] * n}

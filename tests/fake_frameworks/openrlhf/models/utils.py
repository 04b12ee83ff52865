"""Replica of openrlhf/models/utils.py: `compute_reward`, KL-shaped token rewards (out of place)."""

from __future__ import annotations

from typing import Optional

import torch


def compute_reward(r: torch.Tensor, kl_coef: float, kl: torch.Tensor, action_mask: Optional[torch.Tensor] = None,
                   reward_clip_range: Optional[tuple[float, float]] = None) -> torch.Tensor:
    kl_coef = max(kl_coef, 0.0)
    if reward_clip_range:
        r = r.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    last = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    terminal = torch.zeros_like(kl).scatter_(1, last, r.unsqueeze(1).to(kl.dtype))
    return terminal - kl_coef * kl

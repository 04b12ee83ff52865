"""Replica of openrlhf/trainer/ppo_utils/experience.py: the `Experience` dataclass (a subset of its fields)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Experience:
    sequences: torch.Tensor = None
    action_mask: torch.Tensor = None
    action_log_probs: torch.Tensor = None
    values: torch.Tensor = None
    returns: torch.Tensor = None
    advantages: torch.Tensor = None
    kl: torch.Tensor = None
    rewards: torch.Tensor = None
    response_length: torch.Tensor = None
    truncated: torch.Tensor = None
    index: list = None
    info: dict = field(default_factory=dict)

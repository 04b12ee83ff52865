"""Replica of nemo_rl/algorithms/utils.py: `calculate_baseline_and_std_per_prompt`."""

from __future__ import annotations

import torch


def calculate_baseline_and_std_per_prompt(prompts: torch.Tensor, rewards: torch.Tensor, valid_mask: torch.Tensor,
                                          leave_one_out_baseline: bool = True):
    baseline = torch.zeros_like(rewards)
    std = torch.zeros_like(rewards)
    for prompt in prompts.unique():
        members = (prompts == prompt).nonzero().flatten()
        group = rewards[members]
        if leave_one_out_baseline and len(members) > 1:
            baseline[members] = (group.sum() - group) / (len(members) - 1)
        else:
            baseline[members] = group.mean()
        std[members] = group.std() if len(members) > 1 else 0.0
    return baseline, std

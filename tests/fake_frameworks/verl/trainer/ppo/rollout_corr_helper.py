"""Replica of verl/trainer/ppo/rollout_corr_helper.py (since v0.7.0; b178a3cd56f5; verl 0.9.1)."""

from __future__ import annotations

from typing import Any

import torch

from verl.protocol import DataProto


def compute_rollout_correction_and_add_to_batch(batch: DataProto, rollout_corr_config: Any) -> tuple[DataProto, dict]:
    threshold = rollout_corr_config.get("rollout_is_threshold", 2.0)
    log_ratio = batch.batch["old_log_probs"] - batch.batch["rollout_log_probs"]
    weights = torch.exp(log_ratio).clamp(max=threshold)
    keep = (torch.exp(log_ratio) < rollout_corr_config.get("rollout_rs_threshold", 1e9)).to(batch.batch["response_mask"].dtype)
    batch.batch["response_mask"] = batch.batch["response_mask"] * keep  # a new mask; the old one is left alone
    if rollout_corr_config.get("rollout_is") is not None:
        batch.batch["rollout_is_weights"] = weights * batch.batch["response_mask"]
    return batch, {"rollout_corr/mean_weight": weights.mean().item()}

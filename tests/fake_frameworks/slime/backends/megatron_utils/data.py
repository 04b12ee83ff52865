"""Replica of slime/backends/megatron_utils/data.py at v0.3.1: `log_rollout_data` lives here.

(At 624b824a898a it moved to slime/observability/train_metric_utils.py.)
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

import torch

LOGGED: list[dict[str, float]] = []  # replica: what would go to wandb / tensorboard


def log_rollout_data(rollout_id: int, args: Namespace, rollout_data: dict[str, Any]) -> None:
    log = {}
    for key, value in rollout_data.items():
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            log[f"rollout/{key}"] = torch.cat(value).clone().detach().float().mean().item()
        elif isinstance(value, list) and value and isinstance(value[0], (int, float)):
            log[f"rollout/{key}"] = sum(value) / len(value)
    LOGGED.append(log)

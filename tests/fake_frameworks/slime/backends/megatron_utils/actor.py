"""Replica of slime/backends/megatron_utils/actor.py at v0.3.1: the order train_actor runs things in.

Imports both functions by name, as v0.3.1 does (`from .data import log_rollout_data`).
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from .data import log_rollout_data
from .loss import compute_advantages_and_returns


class MegatronTrainRayActor:
    def __init__(self, args: Namespace) -> None:
        self.args = args

    def train_actor(self, rollout_id: int, rollout_data: dict[str, Any], external_data: Any = None) -> None:
        if self.args.compute_advantages_and_returns:
            compute_advantages_and_returns(self.args, rollout_data)
        log_rollout_data(rollout_id, self.args, rollout_data)
        # replica: the training step would now read rollout_data["advantages"], ["log_probs"], ...

"""Replica of openrlhf/trainer/ppo_trainer.py (v0.11.0): `BasePPOTrainer.train_step`'s data path.

make_experience_batch -> `_compute_rollout_stats(experiences)` (since v0.10.0) -> the
experiences are pushed to the actor and critic replay buffers (here: kept on the trainer).
"""

from __future__ import annotations

from typing import Any, Dict

import torch


class BasePPOTrainer:
    def __init__(self, experience_maker: Any) -> None:
        self.experience_maker = experience_maker
        self.replay_buffer: list = []

    def train_step(self, experiences: list) -> Dict:
        experiences = self.experience_maker.compute_advantages_and_returns(experiences)
        stats = self._compute_rollout_stats(experiences)
        self.replay_buffer.extend(experiences)  # replica: async_run_method_batch("append", ...)
        return stats

    def _compute_rollout_stats(self, experiences) -> Dict:
        rewards = torch.cat([e.info["reward"] for e in experiences if "reward" in e.info])
        lengths = torch.cat([e.response_length for e in experiences if e.response_length is not None])
        truncated = torch.cat([e.truncated for e in experiences if e.truncated is not None])
        return {"rollout/reward_mean": rewards.float().mean().item(),
                "rollout/response_length_mean": lengths.float().mean().item(),
                "rollout/truncated_rate": truncated.float().mean().item()}


class PPOTrainer(BasePPOTrainer):
    pass

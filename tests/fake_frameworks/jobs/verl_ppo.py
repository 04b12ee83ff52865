"""One verl PPO data step on the replica, in RayPPOTrainer.fit's order; prints the logged score mean.

--estimator gae (default) | grpo | scaled: `scaled` registers a user's estimator that scales
token_level_rewards in place (the kind of bug the verl preset is for).
"""

import argparse

import numpy as np
import torch

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

parser = argparse.ArgumentParser()
parser.add_argument("--estimator", default="gae")
opts = parser.parse_args()


@core_algos.register_adv_est("scaled")
def scaled_outcome_advantage(token_level_rewards, response_mask, config=None, index=None):
    token_level_rewards *= response_mask  # BUG: token_level_rewards IS data.batch["token_level_rewards"]
    return token_level_rewards, token_level_rewards


torch.manual_seed(0)
size, length = 4, 5
data = DataProto.from_dict(
    {"old_log_probs": -torch.rand(size, length), "ref_log_prob": -torch.rand(size, length),
     "rollout_log_probs": -torch.rand(size, length), "values": torch.rand(size, length),
     "response_mask": torch.ones(size, length), "token_level_scores": torch.rand(size, length)},
    {"uid": ["a", "a", "b", "b"]})
data, metrics = apply_kl_penalty(data, core_algos.FixedKLController(0.1), kl_penalty="kl")
data, _ = compute_rollout_correction_and_add_to_batch(data, {"rollout_is": "token", "rollout_is_threshold": 2.0})
data = compute_advantage(data, adv_estimator=core_algos.AdvantageEstimator(opts.estimator)
                         if opts.estimator in ("gae", "grpo") else opts.estimator, gamma=1.0, lam=0.95)
print(f"critic/rewards/mean {data.batch['token_level_rewards'].sum(-1).mean().item():.4f}, "
      f"advantages {tuple(data.batch['advantages'].shape)}")

"""The advantage step of NeMo-RL's grpo_train on the replica; prints the logged reward mean."""

import torch

from nemo_rl.algorithms.advantage_estimator import GRPOAdvantageEstimator

rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])  # repeated_batch["total_reward"]
prompt_ids = torch.tensor([0, 0, 1, 1])
mask = torch.ones(4, 3)
estimator = GRPOAdvantageEstimator({"use_leave_one_out_baseline": True, "normalize_rewards": True}, {})
advantages = estimator.compute_advantage(prompt_ids=prompt_ids, rewards=rewards, mask=mask)
print(f"reward {rewards.numpy().mean():.4f}, advantages {tuple(advantages.shape)}")

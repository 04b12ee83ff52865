"""One slime PPO step on the replica, as MegatronTrainRayActor.train_actor runs it; prints the logged KL."""

import argparse

import torch

from slime.backends.megatron_utils import data
from slime.backends.megatron_utils.actor import MegatronTrainRayActor

torch.manual_seed(0)
samples, length = 2, 4
rollout_data = {
    "log_probs": [-torch.rand(length) for _ in range(samples)],
    "ref_log_probs": [-torch.rand(length) for _ in range(samples)],
    "values": [torch.rand(length) for _ in range(samples)],
    "loss_masks": [torch.ones(length) for _ in range(samples)],
    "rewards": [1.0, 0.0],
}
args = argparse.Namespace(kl_coef=0.05, kl_loss_type="k1", advantage_estimator="ppo", gamma=1.0, lambd=0.95,
                          compute_advantages_and_returns=True)
expected_kl = torch.cat([a - b for a, b in zip(rollout_data["log_probs"], rollout_data["ref_log_probs"])]).mean()
MegatronTrainRayActor(args).train_actor(0, rollout_data)
print(f"logged rollout/kl {data.LOGGED[-1]['rollout/kl']:.4f}, true KL {expected_kl.item():.4f}")

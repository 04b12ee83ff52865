"""One OpenRLHF train step's data path on the replica; prints the rollout stats.

--overlong turns on DAPO's overlong penalty, which upstream writes into experience.rewards in place.
"""

import argparse
from types import SimpleNamespace

import torch

from openrlhf.trainer.ppo_trainer import PPOTrainer
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

parser = argparse.ArgumentParser()
parser.add_argument("--overlong", action="store_true")
opts = parser.parse_args()

args = SimpleNamespace(
    algo=SimpleNamespace(advantage=SimpleNamespace(estimator="gae", gamma=1.0, lambd=0.95)),
    rollout=SimpleNamespace(n_samples_per_prompt=2, max_new_tokens=6),
    reward=SimpleNamespace(overlong_buffer_len=2 if opts.overlong else None, overlong_penalty_factor=1.0))
torch.manual_seed(0)
experiences = []
for i in range(2):
    rewards = torch.tensor([1.0, 0.0])
    experiences.append(Experience(
        sequences=torch.randint(0, 100, (2, 8)), action_mask=torch.ones(2, 6), action_log_probs=-torch.rand(2, 6),
        values=torch.rand(2, 6), kl=torch.rand(2, 6) * 0.01, rewards=rewards,
        response_length=torch.tensor([6, 3]), truncated=torch.tensor([1, 0]), index=[2 * i, 2 * i + 1],
        info={"reward": rewards}))
maker = RemoteExperienceMaker(SimpleNamespace(value=0.01), SimpleNamespace(args=args))
stats = PPOTrainer(maker).train_step(experiences)
print(f"rollout/reward_mean {stats['rollout/reward_mean']:.4f}")

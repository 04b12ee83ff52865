"""An RL trainer's loss module with the in-place KL bug. Nothing here knows about kvguard."""

import torch


def compute_advantages_and_returns(args, rollout_data):
    kl = [lp - ref for lp, ref in zip(rollout_data["log_probs"], rollout_data["ref_log_probs"])]
    rollout_data["kl"] = kl
    for k in kl:
        k *= 0.1
    return kl


class Trainer:
    def step(self, rollout_data):
        rollout_data["log_probs"][0].add_(1.0)


def make_rollout(n=2, t=4):
    return {"log_probs": [torch.randn(t) for _ in range(n)],
            "ref_log_probs": [torch.randn(t) for _ in range(n)]}

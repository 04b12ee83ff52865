"""A PPO trainer's advantage computation with the in-place KL bug. Nothing here knows about kvguard.

`rollout_data["kl"]` is logged later; shaping the rewards in place from the same tensors
(`k *= -kl_coef`, then `k[-1] += reward`) silently rewrites it. `args.fixed` is the
one-line fix.
"""

import torch


def compute_advantages_and_returns(args, rollout_data):
    kl = [lp - ref for lp, ref in zip(rollout_data["log_probs"], rollout_data["ref_log_probs"])]
    rollout_data["kl"] = kl  # logged later as the rollout/kl metric
    rewards = []
    for reward, k in zip(rollout_data["rewards"], kl):
        if args.fixed:
            k = k * -args.kl_coef  # a new tensor: the logged KL stays intact
        else:
            k *= -args.kl_coef  # BUG: k IS rollout_data["kl"][i]
        k[-1] += reward
        rewards.append(k)
    rollout_data["returns"] = [r.flip(0).cumsum(0).flip(0) for r in rewards]


def make_rollout(n_samples, seq_len, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "log_probs": [-torch.rand(seq_len, generator=g) for _ in range(n_samples)],
        "ref_log_probs": [-torch.rand(seq_len, generator=g) for _ in range(n_samples)],
        "rewards": torch.randint(0, 2, (n_samples,), generator=g).tolist(),
    }

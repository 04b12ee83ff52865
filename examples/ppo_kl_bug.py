"""The in-place KL-shaping bug from a PPO trainer, caught by kvguard.

`compute_advantages_and_returns` stores the per-token KL in `rollout_data["kl"]` for
logging, then (PPO branch) shapes the token-level rewards *in place* from the same
tensors: `k *= kl_coef; k[-1] += reward`. Training still gets the right rewards, but the
logged KL curve silently becomes `kl_coef * kl` plus the reward on the last token.

    python examples/ppo_kl_bug.py            # the bug: report, exit status 1
    python examples/ppo_kl_bug.py --fixed    # the one-line fix: clean, exit status 0
    python examples/ppo_kl_bug.py --action raise   # stop at the first write instead

Self-contained: CPU only, random data, no trainer needed.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import torch

import kvguard


def compute_approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """The k1 estimator: per-token log-ratio between policy and reference."""
    return log_probs - ref_log_probs


def compute_advantages_and_returns(args: SimpleNamespace, rollout_data: dict) -> None:
    log_probs = rollout_data["log_probs"]
    ref_log_probs = rollout_data["ref_log_probs"]
    kl = [compute_approx_kl(log_probs[i], ref_log_probs[i]) for i in range(len(log_probs))]
    rollout_data["kl"] = kl  # logged later as the rollout/kl metric

    if args.advantage_estimator == "ppo":
        rewards = []
        for reward, k in zip(rollout_data["rewards"], kl):
            if args.fixed:
                k = k * -args.kl_coef  # a new tensor: the logged KL stays intact
            else:
                k *= -args.kl_coef  # BUG: k IS rollout_data["kl"][i]
            k[-1] += reward
            rewards.append(k)
        rollout_data["advantages"] = [_discounted_returns(r, args.gamma) for r in rewards]
    else:  # GRPO-style estimators only read the KL
        rollout_data["advantages"] = [torch.full_like(k, float(r)) for r, k in zip(rollout_data["rewards"], kl)]


def _discounted_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    returns = torch.empty_like(rewards)
    running = torch.zeros(())
    for t in reversed(range(rewards.numel())):
        running = rewards[t] + gamma * running
        returns[t] = running
    return returns


def make_rollout(n_samples: int = 4, seq_len: int = 16, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = [seq_len - i for i in range(n_samples)]
    return {
        "log_probs": [-torch.rand(n, generator=g) for n in lengths],
        "ref_log_probs": [-torch.rand(n, generator=g) for n in lengths],
        "rewards": [float(r) for r in torch.randint(0, 2, (n_samples,), generator=g)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixed", action="store_true", help="run the fixed variant")
    parser.add_argument("--action", choices=("warn", "raise", "record"), default="warn")
    parser.add_argument("--estimator", default="ppo", choices=("ppo", "grpo"))
    opts = parser.parse_args(argv)
    args = SimpleNamespace(advantage_estimator=opts.estimator, kl_coef=0.05, gamma=1.0, fixed=opts.fixed)

    rollout_data = make_rollout()
    try:
        with kvguard.guard(rollout_data, name="rollout_data", action=opts.action) as g:
            compute_advantages_and_returns(args, rollout_data)
    except kvguard.MutationError as err:
        print(f"kvguard.MutationError: {err}", file=sys.stderr)
        return 1

    if g.report.ok:
        print("kvguard: no in-place writes to rollout_data; the logged KL is the raw KL.")
        return 0
    expected = compute_approx_kl(rollout_data["log_probs"][0], rollout_data["ref_log_probs"][0])
    logged = rollout_data["kl"][0]
    print(f"\nkvguard caught {len(g.report.events)} in-place writes to rollout_data.")
    print(f"logged KL[0] last token: {logged[-1].item():+.4f}   raw KL: {expected[-1].item():+.4f}")
    print("fix: build a new tensor (k = k * -kl_coef) instead of k *= -kl_coef")
    return 1


if __name__ == "__main__":
    sys.exit(main())

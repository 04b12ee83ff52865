"""A long RL job: 256 samples x 10 steps through the buggy advantage computation.

Run it unchanged with kvguard on from the environment: two source lines write the
logged KL in place 5,120 times, and kvguard prints one panel per line, then one summary
line per line at exit, and writes a report under 100 KB:

    KVGUARD=warn KVGUARD_TARGETS="ppo_loss:compute_advantages_and_returns(rollout_data)" \\
        python -m kvguard run --report-dir reports -- python train.py
    python -m kvguard report reports      # one row per site; exit status 1

With `--fixed` the run is clean, and its report proves it: exit status 0.
"""

import argparse
from types import SimpleNamespace

import torch

import ppo_loss

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--fixed", action="store_true", help="run the one-line fix")
parser.add_argument("--samples", type=int, default=256)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--seq-len", type=int, default=16)
opts = parser.parse_args()
args = SimpleNamespace(kl_coef=0.05, fixed=opts.fixed)

intact = 0
for step in range(opts.steps):
    rollout = ppo_loss.make_rollout(opts.samples, opts.seq_len, seed=step)
    raw = [lp - ref for lp, ref in zip(rollout["log_probs"], rollout["ref_log_probs"])]
    ppo_loss.compute_advantages_and_returns(args, rollout)
    intact += all(torch.equal(a, b) for a, b in zip(raw, rollout["kl"]))
print(f"logged KL intact in {intact}/{opts.steps} steps")
print("train done")

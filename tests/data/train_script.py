"""An unchanged training script: reports which modules were loaded before it ran."""

import sys

print("preloaded:", ",".join(m for m in ("torch", "wrapt", "kvguard") if m in sys.modules))

import torch  # noqa: E402

import trainer_actor  # noqa: E402
from trainer_loss import Trainer, make_rollout  # noqa: E402

for _ in range(2):
    rollout = make_rollout()
    raw = [lp - ref for lp, ref in zip(rollout["log_probs"], rollout["ref_log_probs"])]
    trainer_actor.compute_advantages_and_returns(None, rollout)
    print("kl intact:", all(torch.equal(a, b) for a, b in zip(raw, rollout["kl"])))
if "--method" in sys.argv:
    Trainer().step(make_rollout())
print("train done")

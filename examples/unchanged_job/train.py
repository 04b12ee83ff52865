"""An unchanged training script. Run it with kvguard switched on from the environment:

    KVGUARD=warn KVGUARD_TARGETS="trainer_loss:compute_advantages_and_returns(rollout_data)" \\
        KVGUARD_REPORT_DIR=kvguard-reports python train.py
    python -m kvguard report kvguard-reports

Its first line shows which of torch, wrapt and kvguard were imported before the script
ran: nothing when KVGUARD is unset.
"""

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

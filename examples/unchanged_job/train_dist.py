"""The same job on several ranks: each rank calls the buggy function once.

    KVGUARD=warn KVGUARD_TARGETS="trainer_loss:compute_advantages_and_returns(rollout_data)" \\
        KVGUARD_REPORT_DIR=kvguard-reports torchrun --nproc-per-node 2 train_dist.py
"""

import torch.distributed as dist

import trainer_actor
from trainer_loss import make_rollout

dist.init_process_group("gloo")
trainer_actor.compute_advantages_and_returns(None, make_rollout())
dist.barrier()
dist.destroy_process_group()

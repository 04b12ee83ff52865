"""Two ranks under torchrun, each calling the mutating target once."""

import torch.distributed as dist

import trainer_actor
from trainer_loss import make_rollout

dist.init_process_group("gloo")
trainer_actor.compute_advantages_and_returns(None, make_rollout())
dist.barrier()
dist.destroy_process_group()

"""`TrainActor`: a trainer the driver runs as a Ray actor (`ray.remote(...)(TrainActor)`)."""

from __future__ import annotations

import os
from argparse import Namespace
from typing import Any, Optional

import torch
import torch.distributed as dist

from ray_job.loss import compute_advantages_and_returns, make_rollout  # bound before any patch


class TrainActor:
    def __init__(self, init_method: Optional[str] = None) -> None:
        # slime and verl initialise torch.distributed inside each training actor.
        if init_method is not None:
            dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
        self.args = Namespace(kl_coef=0.1)
        self.rollout_data: dict[str, Any] = {}

    def environment(self) -> dict[str, Any]:
        """This process's `KVGUARD*` variables and pid, and whether kvguard activated here."""
        import sys
        return {"pid": os.getpid(), "executable": sys.executable,
                "env": {k: v for k, v in os.environ.items() if k.startswith("KVGUARD")},
                "guarded": hasattr(compute_advantages_and_returns, "__wrapped__")}

    def train_step(self, seed: int = 0) -> float:
        """One rollout's advantages; returns the KL the trainer logs."""
        self.rollout_data = make_rollout(seed=seed)
        compute_advantages_and_returns(self.args, self.rollout_data)
        return float(torch.cat(self.rollout_data["kl"]).mean())

    def kl(self) -> list[list[float]]:
        return [k.tolist() for k in self.rollout_data.get("kl", [])]

    def close(self) -> None:
        """End this actor the graceful way: its atexit handlers run (`ray.kill` would skip them)."""
        import ray
        ray.actor.exit_actor()

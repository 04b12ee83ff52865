"""Two gloo processes: rank 0 is the trainer, rank 1 the rollout worker (no optimizer), under
`KVGUARD_TARGETS=weights`. Run with a port and a shape:

- kept_views: rank 1 receives each bucket with `dist.broadcast` into one reused buffer and keeps
  views of it for the load after the last bucket (no clone): the second broadcast overwrites them.
- sglang: rank 1 receives through the sglang replica's `receive_weights_from_distributed` (a fresh
  tensor per weight, `async_op=True`) and loads with `load_weights_from_distributed`, 3 steps.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank: int, port: int, shape: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    sizes = [("lora_A", (4, 8)), ("lora_B", (8, 4))]
    if shape == "kept_views":
        if rank == 1:
            recv = torch.empty(32)
            pending = {}
            for name, size in sizes:
                dist.broadcast(recv, src=0)  # one bucket per weight, into the same buffer
                pending[name] = recv.view(size)
            print("rank 1 loaded", {n: float(t.sum()) for n, t in pending.items()}, flush=True)
        else:
            for i, _ in enumerate(sizes):
                dist.broadcast(torch.full((32,), float(i + 1)), src=0)
    else:
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        from sglang.srt.models.llama import LlamaForCausalLM

        model = LlamaForCausalLM()
        names = [n for n, _ in model.named_parameters()]
        for step in range(3):
            if rank == 1:
                updater = WeightUpdater(device="cpu", get_model=lambda: model,
                                        _model_update_group={"sync": dist.group.WORLD})
                received = updater.receive_weights_from_distributed(
                    names=names, dtypes=[p.dtype for p in model.parameters()],
                    shapes=[p.shape for p in model.parameters()], group_name="sync")
                updater.load_weights_from_distributed(received)
            else:
                for p in model.parameters():
                    dist.broadcast(torch.randn_like(p.detach()), src=0)
        if rank == 1:
            print("rank 1 steps done", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)

"""A 2-process DDP job on gloo with `broadcast_buffers=True`: clean under `guard_module` in code
(`code`) and under `KVGUARD_TARGETS=weights` with no code change (`env`, the optimizer made
before DDP wraps the model, so DDP's construction broadcasts into watched weights)."""
import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank: int, world: int, port: int, how: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import kvguard

    torch.manual_seed(rank)  # different weights per rank: DDP's construction broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = kvguard.guard_module(model, optimizer=opt, action="raise") if how == "code" else nullcontext()
    with guard as g:
        ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=True)
        for _ in range(3):
            ddp(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    if g is not None:
        print(f"rank{rank} ok={g.report.ok} protected={g.protected_count}", flush=True)
    else:
        print(f"rank{rank} steps done", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2, int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "code"), nprocs=2)

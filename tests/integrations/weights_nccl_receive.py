"""verl #7139 on 2 gloo processes under KVGUARD_TARGETS=weights: rank 1 loads its weights as
views into the receive buffer of a broadcast, and the next broadcast overwrites them."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if rank == 1:
        rollout_model = torch.nn.Linear(3, 2)
        recv = torch.zeros(8)
        dist.broadcast(recv, src=0)
        rollout_model.load_state_dict({"weight": recv[:6].view(2, 3), "bias": recv[6:]}, assign=True)
        dist.broadcast(recv, src=0)  # the next bucket lands in the buffer the weights are views of
    else:
        dist.broadcast(torch.arange(8.0), src=0)
        dist.broadcast(torch.arange(8.0) * 10, src=0)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2, int(sys.argv[1])), nprocs=2)

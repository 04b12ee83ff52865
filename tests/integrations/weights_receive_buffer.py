import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
def main(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import kvguard
    recv = torch.zeros(12)
    model = torch.nn.Linear(3, 2)
    if rank == 1:  # receives weights into one flat buffer, and keeps views of it as its parameters
        dist.broadcast(recv, src=0)
        with torch.no_grad():
            model.weight = torch.nn.Parameter(recv[:6].view(2, 3))
            model.bias = torch.nn.Parameter(recv[6:8])
        with kvguard.guard_module(model, action="record") as g:
            dist.broadcast(recv, src=0)  # the next bucket lands in the same buffer
        print(f"rank1 events: {[(e.path, e.op) for e in g.report.events]}", flush=True)
    else:
        dist.broadcast(torch.arange(12.0), src=0)
        dist.broadcast(torch.arange(12.0) * 10, src=0)
    dist.barrier()
    os._exit(0)
if __name__ == "__main__":
    mp.spawn(main, args=(2, int(sys.argv[1])), nprocs=2)

import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
def main(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import kvguard
    torch.manual_seed(rank)  # different weights per rank: DDP's construction broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
        ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=True)  # noqa: the kwarg the issue names
        for _ in range(3):
            ddp(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    print(f"rank{rank} ok={g.report.ok} protected={g.protected_count}", flush=True)
    dist.barrier()
    os._exit(0)
if __name__ == "__main__":
    mp.spawn(main, args=(2, int(sys.argv[1])), nprocs=2)

#!/usr/bin/python3
"""PyTorch's own DDP over Gloo: the peer of libtorch_fsdp_step's DDP (--only DDP --sgd).

Same model (784-H-H-10 MLP), per-rank batch, SGD and step protocol (a barrier
before each step, rank 0 times zero_grad + forward + backward + step, the
median over the steps), one process per rank, one LibTorch thread each.
Prints "N ms_per_step" for each N asked. Needs Debian's python3-torch (run it
with /usr/bin/python3).

    /usr/bin/python3 bench/torch_ddp_peer.py --ranks 1 --ranks 2 --steps 30
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from ddp_step_options import add_step_options, world_sizes


class Net(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1 = nn.Linear(784, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def worker(rank, n, port, args, out):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.manual_seed(rank + 1)
    model = nn.parallel.DistributedDataParallel(Net(args.hidden))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch, 784)
    y = torch.randint(10, (args.batch,))
    times = []
    for s in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        t1 = time.perf_counter()
        if s >= args.warmup:
            times.append(1000 * (t1 - t0))
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_options(p)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    for n in world_sizes(args):
        out = ctx.SimpleQueue()
        mp.start_processes(worker, args=(n, free_port(), args, out), nprocs=n, join=True, start_method="spawn")
        print(n, f"{out.get():.3f}", flush=True)


if __name__ == "__main__":
    main()

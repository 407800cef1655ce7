#!/usr/bin/env python3
"""PyTorch 2.x's DDP and FSDP2 (fully_shard) over Gloo: the peer of
bench/fsdp_step, on its models, batch, optimizer and step protocol.

    DIR/bin/python bench/peer/torch_step_peer.py --ranks N [--steps 10]
        [--sizes 784,1024,1024,10 ...] [--kinds ddp,full_shard,shard_grad_op] [--adam fused]
        [--units every|hidden] [--optimizer adam|sgd] [--warmup 2] [--stat mean|median]

One process per rank (spawned), torch.set_num_threads(1), MASTER_ADDR
127.0.0.1, Gloo. Models: fsdp_step's MLPs 784-1024-1024-10 and
784-2048-2048-2048-10 (ReLU between Linear layers, cross-entropy), or those
--sizes gives (repeatable); per-rank batch 64 (normal features, random
labels); Adam lr 1e-3 (--adam: fused, foreach or default, PyTorch's
single-tensor CPU path). Kinds:
  ddp            DistributedDataParallel, default buckets
  full_shard     fully_shard on each Linear, then the root; reshard_after_forward=True
  shard_grad_op  the same with reshard_after_forward=False
--units hidden wraps only the Linear layers followed by a ReLU, so that the
last Linear is the root's own unit (bench/libtorch_fsdp_step's three units);
--optimizer sgd steps SGD lr 1e-2 (libtorch_fsdp_step --sgd) instead of Adam.
A step is zero_grad + forward + loss + backward + optimizer step; as
fsdp_step: --warmup (2) warm-up steps, a barrier, then rank 0's mean over
--steps steps (the larger model max(3, steps // 3), as fsdp_step does; with
--stat median, the median of barrier-started steps, as libtorch_fsdp_step
times), subnormals flushed to zero. Prints "<model> <kind> <N> <ms/step>"
per model and kind.
Needs PyTorch 2.x (bench/peer/torch2.py says how to make a venv for it).
"""
import argparse
import os
import socket
import statistics
import sys
import time

from torch2 import import_torch_or_exit

KINDS = ["ddp", "full_shard", "shard_grad_op"]
DEFAULT_MODELS = [[784, 1024, 1024, 10], [784, 2048, 2048, 2048, 10]]


def steps_for(sizes, steps):
    # fsdp_step's rule: the 10M model's steps take ~5x the small one's.
    return max(3, steps // 3) if len(sizes) > 4 else steps


def make_model(torch, sizes):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def wrap(torch, model, kind, mesh, units="every"):
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard
    reshard = kind == "full_shard"
    # One unit per Linear, as fsdp_step's trainers shard the MLP layer by
    # layer; with units == "hidden", the last Linear stays the root's.
    last = len(model) - 1
    for i, layer in enumerate(model):
        if isinstance(layer, torch.nn.Linear) and (units == "every" or i != last):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def worker(rank, n, port, a, out):
    torch = import_torch_or_exit()
    import torch.distributed as dist
    import torch.nn.functional as F
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    mesh = None
    if any(k != "ddp" for k in a.kinds):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (n,))
    gen = torch.Generator().manual_seed(5 + rank)
    flags = {} if a.adam == "default" else {a.adam: True}
    for sizes in a.models:
        x = torch.randn(64, sizes[0], generator=gen)
        y = torch.randint(sizes[-1], (64,), generator=gen)
        steps = steps_for(sizes, a.steps)
        for kind in a.kinds:
            torch.manual_seed(1)
            model = wrap(torch, make_model(torch, sizes), kind, mesh, a.units)
            if a.optimizer == "sgd":
                opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            else:
                opt = torch.optim.Adam(model.parameters(), lr=1e-3, **flags)

            def step():
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()

            for _ in range(a.warmup):
                step()
            dist.barrier()
            times = []
            for _ in range(steps):
                if a.stat == "median":
                    dist.barrier()
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            if rank == 0:
                ms = statistics.median(times) if a.stat == "median" else sum(times) / steps
                out.put(("-".join(map(str, sizes)), kind, n, 1e3 * ms))
            del opt, model
            dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sizes_arg(text):
    v = [int(t) for t in text.split(",")]
    if len(v) < 2 or min(v) < 1:
        raise argparse.ArgumentTypeError("an input and an output width at least, positive")
    return v


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--sizes", type=sizes_arg, action="append", help="layer widths, e.g. 784,1024,1024,10")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--adam", choices=["fused", "foreach", "default"], default="fused")
    p.add_argument("--units", choices=["every", "hidden"], default="every",
                   help="fully_shard every Linear, or only those before a ReLU (the last stays the root's)")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stat", choices=["mean", "median"], default="mean",
                   help="rank 0's mean step, or the median of steps each started by a barrier")
    a = p.parse_args()
    a.models = a.sizes or DEFAULT_MODELS
    a.kinds = a.kinds.split(",")
    for k in a.kinds:
        if k not in KINDS:
            p.error(f"unknown kind {k} ({', '.join(KINDS)})")
    torch = import_torch_or_exit()
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    optimizer = "SGD" if a.optimizer == "sgd" else f"Adam {a.adam}"
    print(f"# torch {torch.__version__}, Gloo, {optimizer}, {a.ranks} process(es), one thread each", flush=True)
    mp.start_processes(worker, args=(a.ranks, free_port(), a, out), nprocs=a.ranks, join=True,
                       start_method="spawn")
    while not out.empty():
        model, kind, n, ms = out.get()
        print(f"{model} {kind} {n} {ms:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

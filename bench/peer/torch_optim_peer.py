#!/usr/bin/env python3
"""torch.optim's SGD (momentum 0.9), Adam and AdamW on flat float32 parameters:
the peer of bench/optim_step, timed the way optim_step times gradsync.

    DIR/bin/python bench/peer/torch_optim_peer.py [--sizes 64K,1M,16M,64M] [--repeats 5]
                                                  [--modes foreach,fused]

One thread (torch.set_num_threads(1)); each optimizer once with foreach=True
and once with fused=True, on one tensor of n parameters with a fixed
gradient (p ~ 0.05 N(0,1), g ~ 1e-3 N(0,1), as optim_step draws them). One
step first (it faults the pages in and makes the state), then `repeats`
rounds of max(1, min(100000, 5e8 / bytes)) steps; the median round's seconds
per step. Bytes per parameter as optim_step counts them: 20 for SGD with
momentum (reads p, g, v; writes p, v), 28 for Adam and AdamW.

Prints one row per optimizer and mode, optim_step's columns:
    <name>/<mode> <params> <B/p> <ms/step> <GB/s>
and "# <name>/<mode> error: ..." where PyTorch refuses the combination.
Needs PyTorch 2.x (bench/peer/torch2.py says how to make a venv for it).
"""
import argparse
import sys
import time

from torch2 import import_torch_or_exit

OPTIMIZERS = {
    # name: (bytes per parameter, constructor arguments)
    "sgd_momentum": (20, lambda torch: (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9})),
    "adam": (28, lambda torch: (torch.optim.Adam, {"lr": 1e-3})),
    "adamw": (28, lambda torch: (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01})),
}


def parse_count(text):
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def seconds_per_step(step, nbytes, repeats):
    step()
    iters = int(min(max(5e8 / nbytes, 1.0), 100000.0))
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        rounds.append((time.perf_counter() - t0) / iters)
    rounds.sort()
    return rounds[len(rounds) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64K,1M,16M,64M", help="parameters per step, comma-separated (K, M suffixes)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modes", default="foreach,fused", help="torch.optim implementations: foreach, fused, forloop")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    a = p.parse_args()
    torch = import_torch_or_exit()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    for n in map(parse_count, a.sizes.split(",")):
        params0 = 0.05 * torch.randn(n, generator=gen)
        grad = 1e-3 * torch.randn(n, generator=gen)
        for name in a.optimizers.split(","):
            bpp, make = OPTIMIZERS[name]
            cls, kwargs = make(torch)
            for mode in a.modes.split(","):
                # forloop: the single-tensor implementation, PyTorch's CPU default.
                flags = {"foreach": False} if mode == "forloop" else {mode: True}
                param = params0.clone().requires_grad_(True)
                param.grad = grad
                label = f"{name}/{mode}"
                try:
                    opt = cls([param], **kwargs, **flags)
                    s = seconds_per_step(opt.step, bpp * n, a.repeats)
                except (RuntimeError, ValueError, TypeError) as e:
                    print(f"# {label} error: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
                    continue
                finally:
                    del param
                print(f"{label:<20} {n:10d} {bpp:5d} {1e3 * s:10.4f} {bpp * n / s / 1e9:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

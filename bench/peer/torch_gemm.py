#!/usr/bin/env python3
"""bench/peer/torch_gemm.py: PyTorch's matrix products at the MLP's shapes, one thread.

The peer of bench/mlp_gemm: the same three products per layer (forward
Y = W X, weights G += D Xᵀ, input E = Wᵀ D) on the same shapes, with
torch.mm into preallocated outputs (out=, as Eigen's noalias() writes in
place), float32, torch.set_num_threads(1). PyTorch stores row-major, so each
product is written on the transposes, which is the same arithmetic on the
same memory as Eigen's column-major one.

    PYTHON bench/peer/torch_gemm.py [--sizes 784,1024,1024,10] [--batch 64] [--repeats 30]

PYTHON: an interpreter with PyTorch 2.x, e.g. a venv made with
`python3 -m venv DIR && DIR/bin/pip install torch numpy`.
"""
import argparse
import statistics
import sys
import time

try:
    import torch
except ImportError:
    sys.exit("torch_gemm.py: no PyTorch here; run it with a venv's python that has torch 2.x "
             "(python3 -m venv DIR && DIR/bin/pip install torch numpy)")


def seconds_per_call(repeats, f):
    f()
    f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="784,1024,1024,10")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if len(sizes) < 2 or args.batch < 1 or args.repeats < 1:
        sys.exit("torch_gemm.py: --sizes needs two widths or more, --batch and --repeats at least 1")
    torch.set_num_threads(1)
    n = args.batch
    print(f"# PyTorch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
          f"batch {n}, median of {args.repeats}")
    print(f"{'layer':7} {'product':8} {'M':>6} {'N':>6} {'K':>6} {'us':>10} {'GFLOP/s':>9}")
    total_s = total_flops = 0.0
    for l in range(len(sizes) - 1):
        fan_in, fan_out = sizes[l], sizes[l + 1]
        # Row-major transposes of Eigen's column-major W (out x in), X (in x n), D (out x n).
        wt = torch.rand(fan_in, fan_out)
        xt = torch.rand(n, fan_in)
        dt = torch.rand(n, fan_out)
        yt = torch.empty(n, fan_out)
        gt = torch.zeros(fan_in, fan_out)
        et = torch.empty(n, fan_in)
        products = [
            ("forward", fan_out, n, fan_in, lambda: torch.mm(xt, wt, out=yt)),
            ("weights", fan_out, fan_in, n, lambda: gt.addmm_(xt.t(), dt)),
        ]
        if l > 0:
            products.append(("input", fan_in, n, fan_out, lambda: torch.mm(dt, wt.t(), out=et)))
        for name, m, cols, k, f in products:
            s = seconds_per_call(args.repeats, f)
            flops = 2.0 * m * cols * k
            total_s += s
            total_flops += flops
            print(f"fc{l + 1:<5} {name:8} {m:6} {cols:6} {k:6} {s * 1e6:10.1f} {flops / s / 1e9:9.1f}")
    print(f"{'all':7} {'':8} {'':>6} {'':>6} {'':>6} {total_s * 1e6:10.1f} {total_flops / total_s / 1e9:9.1f}")


if __name__ == "__main__":
    main()

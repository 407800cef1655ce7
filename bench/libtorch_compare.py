#!/usr/bin/python3
"""gradsync's LibTorch DDP against PyTorch's DDP + Gloo, interleaved in one run.

    /usr/bin/python3 bench/libtorch_compare.py build/bench/libtorch_fsdp_step --rounds 3

Each round runs, for every N, gradsync's DDP (`libtorch_fsdp_step --only DDP
--sgd`, one round of its own) then torch_ddp_peer.py, so
both see the same machine load; the table gives the median over the rounds
of each one's median step time, samples/s over all ranks, the weak-scaling
efficiency (samples/s at N over N times samples/s at 1) and the ratio of
samples/s. Both run the same model in the same LibTorch 1.13 kernels, one
thread per rank. LibTorch's speed depends on the BLAS it finds: Debian's
libtorch recommends OpenBLAS (libopenblas0-pthread); with only the reference
libblas3 a step is about 20 times slower, for both.
"""
import argparse
import os
import pathlib
import statistics
import subprocess
import sys

from ddp_step_options import add_step_options, step_flags, world_sizes

here = pathlib.Path(__file__).resolve().parent
# One thread per rank for both, BLAS included: OpenBLAS reads this when it
# loads, before either program could call set_num_threads.
env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")


def gradsync_ms(exe, n, a):
    """Rank 0's median ms per step of gradsync's DDP at N = n: the ms column of
    libtorch_fsdp_step's row "N DDP ms ...". Five warm-up steps, as the peer."""
    flags = step_flags(a, n) + ["--only", "DDP", "--sgd", "--rounds", "1", "--warmup", "5"]
    out = subprocess.run([exe] + flags, check=True, capture_output=True, text=True, timeout=600, env=env).stdout
    row = [l for l in out.splitlines() if l and not l.startswith("#")][0].split()
    if row[1] != "DDP":
        raise RuntimeError(f"unexpected libtorch_fsdp_step row: {row}")
    return float(row[2])


def torch_ms(n, a):
    out = subprocess.run(["/usr/bin/python3", str(here / "torch_ddp_peer.py")] + step_flags(a, n),
                         check=True, capture_output=True, text=True, timeout=600, env=env).stdout
    return float(out.split()[1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("exe")
    p.add_argument("--rounds", type=int, default=3)
    add_step_options(p)
    a = p.parse_args()
    ns = world_sizes(a)
    gs = {n: [] for n in ns}
    pt = {n: [] for n in ns}
    for _ in range(a.rounds):
        for n in ns:
            gs[n].append(gradsync_ms(a.exe, n, a))
            pt[n].append(torch_ms(n, a))
    print(f"# MLP 784-{a.hidden}-{a.hidden}-10, per-rank batch {a.batch}, SGD, one thread per rank; "
          f"median of {a.rounds} interleaved rounds of {a.steps} steps")
    print("#  N   gradsync ms  samples/s  weak-eff   PyTorch ms  samples/s  weak-eff   gradsync/PyTorch")
    base = {}
    for n in ns:
        g, t = statistics.median(gs[n]), statistics.median(pt[n])
        gsps, tsps = 1000 * n * a.batch / g, 1000 * n * a.batch / t
        if n == 1:
            base = {"g": gsps, "t": tsps}
        eff = (lambda s, b: f"{100 * s / (n * b):.0f}%" if b else "-")
        print(f"{n:4d} {g:13.2f} {gsps:10.0f} {eff(gsps, base.get('g')):>9} {t:12.2f} {tsps:10.0f} "
              f"{eff(tsps, base.get('t')):>9} {gsps / tsps:18.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""gradsync's LibTorch fully_shard and DistributedDataParallel
(bench/libtorch_fsdp_step) against PyTorch 2.x's DDP and FSDP2 fully_shard
over Gloo (bench/peer/torch_step_peer.py), interleaved round by round, one
thread per rank.

    python3 bench/peer/libtorch_fsdp_compare.py --python DIR/bin/python [-B build-o2] [--ranks 1,2,4]
                                                [--rounds 5] [--steps 20] [--warmup 3] [--hidden 1024]
                                                [--sgd] [--adam fused|foreach|default] [--replay FILE]

DIR is a venv with PyTorch 2.x (python3 -m venv DIR && DIR/bin/pip install
torch numpy); --python defaults to $GRADSYNC_TORCH2_PYTHON. For every round
and N, one after the other, the first alternating from N to N and round to
round:
  gradsync  libtorch_fsdp_step --ranks N --rounds 1: DDP, FullShard,
            ShardGradOp, NoShard, no-comm (threads, LibTorch 1.13)
  PyTorch   torch_step_peer.py --ranks N --units hidden --stat median: DDP,
            fully_shard with reshard_after_forward True (FullShard) and
            False (ShardGradOp) (processes, Gloo on 127.0.0.1)
Same model (MLP 784-H-H-10, each hidden Linear a unit, the head the root's),
per-rank batch 64, optimizer (Adam lr 1e-3, PyTorch's fused unless --adam;
--sgd: SGD lr 1e-2), warm-up steps, and statistic (rank 0's median of
barrier-started steps). The table gives, per N and strategy, the median over
rounds of each ms/step [min-max], samples/s over all ranks, PyTorch's ms over
gradsync's in the same round (median [min-max]; above 1 gradsync is faster)
and gradsync's step over its own DDP's in the same run (xDDP). The ceiling
is PyTorch's ms over gradsync's no-comm ms (the same model with no wrapper
and no communication) round by round: the most PyTorch/gradsync could reach
with collectives and wrapping free. Targets at N = 2: FullShard xDDP <= 1.3,
PyTorch/gradsync FullShard >= 2. --replay FILE prints the tables again from
the raw rows of an earlier run's output, running nothing.
Exits 2 when the interpreter or libtorch_fsdp_step is missing, 1 on a run error.
"""
import pathlib
import statistics
import sys

from torch2 import (built_tool, check_python, driver_options, interleaved_runs, paired_ratio, print_preamble, summary,
                    uptime)

here = pathlib.Path(__file__).resolve().parent
TORCH_KIND = {"ddp": "DDP", "full_shard": "FullShard", "shard_grad_op": "ShardGradOp"}
STRATEGIES = ["DDP", "FullShard", "ShardGradOp", "NoShard", "no-comm"]


def parse_gradsync(text):
    """({strategy: ms}, {strategy: xDDP}, collectives line or None) of one --rounds 1 run."""
    ms, xddp, coll = {}, {}, None
    for line in text.splitlines():
        f = line.split()
        if not f or line.startswith("#"):
            continue
        if f[1] == "collectives":
            coll = " ".join(f[2:])
        else:
            ms[f[1]] = float(f[2])
            xddp[f[1]] = float(f[4])
    return ms, xddp, coll


def parse_peer(text):
    return {TORCH_KIND[f[1]]: float(f[3]) for f in (l.split() for l in text.splitlines()) if f and f[0] != "#"}


def cell(values):
    if not values:
        return "-"
    m, lo, hi = summary(values)
    return f"{m:.2f} [{lo:.2f}-{hi:.2f}]"


def main():
    p = driver_options(__doc__, "libtorch_fsdp_step", rounds=5)
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--sgd", action="store_true", help="SGD lr 1e-2 for both instead of Adam lr 1e-3")
    p.add_argument("--adam", choices=["fused", "foreach", "default"], default="fused", help="PyTorch's Adam")
    p.add_argument("--replay", help="an earlier run's output: print its tables from its raw rows")
    a = p.parse_args()
    ranks = [int(n) for n in a.ranks.split(",")]
    if a.replay:
        ms, xddp, coll = {}, {}, {}
        rounds = 0
        for line in open(a.replay, encoding="utf-8"):
            f = line.split()
            if len(f) < 5 or not f[0].isdigit():
                continue
            rounds = max(rounds, int(f[0]))
            if f[2] == "collectives":
                coll.setdefault(int(f[3]), []).append(" ".join(f[4:]))
                continue
            ms.setdefault((f[1], f[2], int(f[3])), []).append(float(f[4]))
            if len(f) > 5:
                xddp.setdefault((f[1], f[2], int(f[3])), []).append(float(f[5]))
        return tables(a, ranks, rounds, ms, xddp, coll)
    version = check_python(a.python)
    exe = built_tool(a.build, "libtorch_fsdp_step")
    common = ["--steps", str(a.steps), "--warmup", str(a.warmup)]

    def command(who, n):
        if who == "gradsync":
            return [str(exe), "--ranks", str(n), "--rounds", "1", "--hidden", str(a.hidden)] + common + \
                (["--sgd"] if a.sgd else [])
        return [a.python, str(here / "torch_step_peer.py"), "--ranks", str(n), "--sizes", f"784,{a.hidden},{a.hidden},10",
                "--units", "hidden", "--stat", "median", "--kinds", ",".join(TORCH_KIND), "--adam", a.adam,
                "--optimizer", "sgd" if a.sgd else "adam"] + common

    ms, xddp, coll = {}, {}, {}  # (who, strategy, N) -> list over rounds; N -> collectives lines
    print_preamble(f"# torch {version} ({'SGD' if a.sgd else 'Adam ' + a.adam}); {exe}; one thread per rank",
                   "# raw rows: round who strategy N ms/step [xDDP]")
    for r, n, who, out in interleaved_runs(a.rounds, ranks, ["gradsync", "PyTorch"], command):
        if who == "gradsync":
            g, x, c = parse_gradsync(out)
            for s, t in g.items():
                ms.setdefault((who, s, n), []).append(t)
                xddp.setdefault((who, s, n), []).append(x[s])
                print(f"{r + 1} gradsync {s:12} {n} {t:9.2f} {x[s]:.2f}", flush=True)
            if c:
                coll.setdefault(n, []).append(c)
                print(f"{r + 1} gradsync collectives {n} {c}", flush=True)
        else:
            for s, t in parse_peer(out).items():
                ms.setdefault((who, s, n), []).append(t)
                print(f"{r + 1} PyTorch  {s:12} {n} {t:9.2f}", flush=True)
    print(f"# load after: {uptime()}")
    return tables(a, ranks, a.rounds, ms, xddp, coll)


def tables(a, ranks, rounds, ms, xddp, coll):
    model = f"784-{a.hidden}-{a.hidden}-10"
    print(f"\n# MLP {model}, per-rank batch 64, {'SGD' if a.sgd else 'Adam'}, one thread per rank; ms/step: median "
          f"of {rounds} interleaved rounds [min-max]; ratios: round by round, median [min-max]")
    print("| N | strategy | gradsync ms | gradsync xDDP | gradsync samples/s | PyTorch 2.x ms | PyTorch samples/s "
          "| PyTorch/gradsync | ceiling |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for n in ranks:
        bare = ms.get(("gradsync", "no-comm", n), [])
        for s in STRATEGIES:
            g, t = ms.get(("gradsync", s, n)), ms.get(("PyTorch", s, n))
            sps = (lambda v: f"{1000 * n * 64 / statistics.median(v):.0f}" if v else "-")
            print(f"| {n} | {s} | {cell(g)} | {cell(xddp.get(('gradsync', s, n)))} | {sps(g)} | {cell(t)} | "
                  f"{sps(t)} | {paired_ratio(t or [], g or []) if t and g else '-'} | "
                  f"{paired_ratio(t, bare) if t and bare else '-'} |")
    for n in ranks:
        for c in coll.get(n, []):
            print(f"# N = {n} collectives alone (gradsync, ms): {c}")
    g2 = ms.get(("gradsync", "FullShard", 2))
    if g2:
        x = statistics.median(xddp[("gradsync", "FullShard", 2)])
        print(f"# N = 2 targets: FullShard xDDP {x:.2f} (<= 1.3: {'holds' if x <= 1.3 else 'short'}); "
              f"PyTorch/gradsync FullShard {paired_ratio(ms.get(('PyTorch', 'FullShard', 2), []), g2)} (>= 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

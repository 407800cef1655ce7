#!/usr/bin/env python3
"""gradsync's trainers (bench/fsdp_step) against PyTorch 2.x's DDP and FSDP2
over Gloo (bench/peer/torch_step_peer.py), interleaved in one run, one thread
per rank.

    python3 bench/peer/step_compare.py --python DIR/bin/python [-B build-o2] [--ranks 1,2,4]
                                       [--rounds 3] [--steps 10] [--small-only|--large-only] [--mpi]

DIR is a venv with PyTorch 2.x (python3 -m venv DIR && DIR/bin/pip install
torch numpy); --python defaults to $GRADSYNC_TORCH2_PYTHON. For every round
and N, one after the other, the first rotating from N to N and round to round:
  gradsync Threads   fsdp_step --ranks N (ReplicatedTrainer "DDP", ShardGradOp,
                     FullShard, and NoShard and Hybrid2x, not compared)
  gradsync Mpi       mpirun -np N fsdp_step --backend mpi (with --mpi)
  PyTorch            torch_step_peer.py --ranks N: DDP, fully_shard with
                     reshard_after_forward True (FullShard) and False (ShardGradOp)
Same models (MLP 784-1024-1024-10 and 784-2048-2048-2048-10), per-rank batch
64, Adam (PyTorch's fused=True unless --adam), step protocol (2 warm-up steps,
a barrier, rank 0's mean over --steps steps; the larger model
max(3, steps // 3)). Tables: the median over rounds of each ms/step with the
range, PyTorch's over gradsync's round by round (above 1, gradsync is
faster; median and range over rounds) against the
targets (N = 1: 1.3 for every trainer; N = 2: 2 for DDP, 3 for FullShard),
and gradsync's sharded steps over its own ReplicatedTrainer in the same run
(fsdp_step's xDDP; targets on the 10M model: FullShard 1.15, ShardGradOp 1.05).
"compute+optim" is fsdp_step's compute (forward + backward, less the waits for
collectives) plus optim columns: the step with no communication cost; the
ceiling, PyTorch's ms over it round by round, is the most that a faster
communication could bring the ratio to.
Exits 2 when the interpreter or fsdp_step is missing, 1 on a run error.
"""
import pathlib
import shutil
import sys

from torch2 import (built_tool, check_python, driver_options, fail, interleaved_runs, paired_ratio, print_preamble,
                    summary, uptime)

here = pathlib.Path(__file__).resolve().parent
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
TORCH_KIND = {"ddp": "DDP", "full_shard": "FullShard", "shard_grad_op": "ShardGradOp"}
COMPARED = ["DDP", "ShardGradOp", "FullShard"]
TARGET = {(1, "DDP"): 1.3, (1, "ShardGradOp"): 1.3, (1, "FullShard"): 1.3, (2, "DDP"): 2.0, (2, "FullShard"): 3.0}
XDDP_TARGET = {"FullShard": 1.15, "ShardGradOp": 1.05}


def parse_fsdp_step(text):
    """[(model, trainer, N, ms, xDDP, compute + optim ms)] from fsdp_step's output."""
    rows, model = [], None
    for line in text.splitlines():
        if line.startswith("# MLP "):
            model = line.split()[2]
        elif line.strip() and not line.startswith("#"):
            f = line.split()
            rows.append((model, f[1], int(f[0]), float(f[2]), float(f[3]), float(f[5]) + float(f[7])))
    return rows


def parse_peer(text):
    rows = []
    for line in text.splitlines():
        f = line.split()
        if f and not line.startswith("#"):
            rows.append((f[0], TORCH_KIND[f[1]], int(f[2]), float(f[3]), None, None))
    return rows


def cell(values):
    m, lo, hi = summary(values)
    return f"{m:.1f} [{lo:.1f}-{hi:.1f}]"


def main():
    p = driver_options(__doc__, "fsdp_step")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--adam", choices=["fused", "foreach", "default"], default="fused", help="PyTorch's Adam")
    p.add_argument("--mpi", action="store_true", help="also fsdp_step --backend mpi under mpirun")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--small-only", action="store_true")
    g.add_argument("--large-only", action="store_true")
    a = p.parse_args()
    version = check_python(a.python)
    exe = built_tool(a.build, "fsdp_step")
    if a.mpi and not shutil.which("mpirun"):
        fail("--mpi: no mpirun on PATH (install Open MPI, e.g. openmpi-bin libopenmpi-dev, and rebuild fsdp_step)")
    ranks = [int(n) for n in a.ranks.split(",")]
    models = []
    if not a.large_only:
        models.append("784,1024,1024,10")
    if not a.small_only:
        models.append("784,2048,2048,2048,10")
    model_flags = ["--small-only"] if a.small_only else ["--large-only"] if a.large_only else []
    peer_models = [x for m in models for x in ("--sizes", m)]

    def command(who, n):
        if who == "Threads":
            return [str(exe), "--ranks", str(n), "--steps", str(a.steps)] + model_flags
        if who == "Mpi":
            return MPIRUN + ["-np", str(n), str(exe), "--backend", "mpi", "--steps", str(a.steps)] + model_flags
        return [a.python, str(here / "torch_step_peer.py"), "--ranks", str(n), "--steps", str(a.steps),
                "--adam", a.adam] + peer_models

    contenders = ["Threads"] + (["Mpi"] if a.mpi else []) + ["PyTorch"]
    ms, xddp, busy = {}, {}, {}  # (contender, model, trainer, N) -> list over rounds
    print_preamble(f"# torch {version} (Adam {a.adam}); fsdp_step {exe}; one thread per rank",
                   "# raw rows: round contender model trainer N ms/step [xDDP compute+optim_ms]")
    for r, n, who, out in interleaved_runs(a.rounds, ranks, contenders, command):
        for model, trainer, rn, t, x, c in (parse_peer(out) if who == "PyTorch" else parse_fsdp_step(out)):
            key = (who, model, trainer, rn)
            ms.setdefault(key, []).append(t)
            extra = ""
            if x is not None:
                xddp.setdefault(key, []).append(x)
                busy.setdefault(key, []).append(c)
                extra = f" {x:.2f} {c:.2f}"
            print(f"{r + 1} {who:8} {model:22} {trainer:12} {rn} {t:9.2f}{extra}", flush=True)
    print(f"# load after: {uptime()}")
    gs = [c for c in contenders if c != "PyTorch"]
    for m in models:
        model = m.replace(",", "-")
        print(f"\n# MLP {model}, per-rank batch 64, Adam, one thread per rank; ms/step: median of {a.rounds} "
              f"interleaved rounds [min-max]; ratio: PyTorch's ms over gradsync's in the same round, median [min-max]")
        print("| N | trainer | " + " | ".join(f"gradsync {c} ms" for c in gs) + " | PyTorch 2.x ms | " +
              " | ".join(f"PyTorch/gradsync {c}" for c in gs) + " | target | gradsync Threads compute+optim ms | ceiling |")
        print("|---:|---|" + "---:|" * (2 * len(gs) + 4))
        for n in ranks:
            for trainer in COMPARED:
                pt = ms.get(("PyTorch", model, trainer, n))
                cells, ratios = [], []
                for c in gs:
                    v = ms.get((c, model, trainer, n))
                    cells.append(cell(v) if v else "-")
                    ratios.append(paired_ratio(pt or [], v or []))
                target = TARGET.get((n, trainer))
                b = busy.get(("Threads", model, trainer, n))
                print(f"| {n} | {trainer} | " + " | ".join(cells) + f" | {cell(pt) if pt else '-'} | " +
                      " | ".join(ratios) + f" | {f'≥ {target}' if target else '-'} | {cell(b) if b else '-'} | " +
                      f"{paired_ratio(pt or [], b or [])} |")
        print(f"\n# MLP {model}: gradsync's sharded step over its ReplicatedTrainer's in the same run "
              f"(fsdp_step's xDDP), median [min-max] over rounds")
        print("| N | " + " | ".join(f"{t} ({c})" for c in gs for t in XDDP_TARGET) + " |")
        print("|---:|" + "---:|" * (len(gs) * len(XDDP_TARGET)))
        for n in ranks:
            cells = []
            for c in gs:
                for t in XDDP_TARGET:
                    v = xddp.get((c, model, t, n))
                    cells.append(f"{summary(v)[0]:.2f} [{min(v):.2f}-{max(v):.2f}]" if v else "-")
            print(f"| {n} | " + " | ".join(cells) + " |")
        print("# targets on the 10M model: " + ", ".join(f"{t} ≤ {v}" for t, v in XDDP_TARGET.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

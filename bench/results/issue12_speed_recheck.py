#!/usr/bin/python3
"""Issue 12's speed recheck: per-call time of issue12_call_cost binaries built at 315de20
(before), main (after) and this branch, interleaved in a fresh random order each round.
MPI: mpirun -np 2 --bind-to core (one core per rank); Threads: N = 2, CALL_COST_PIN=1
(rank r on core r). Each run prints rank 0's time per call for REPEATS loops; a run's
figure is their median; the table gives the median over rounds, the spread of the runs'
figures (min-max) and the best single loop of all rounds (least disturbed by other load).

usage: issue12_speed_recheck.py ROUNDS name=BINARY[,MPI_BINARY] ...
       (a name without MPI_BINARY is timed on Threads only, one with only ,MPI on MPI only)
CASES=mpi:auto:2,threads:ring:1024,... (backend:algorithm:floats) times only those."""
import random, statistics, subprocess, sys, os

rounds = int(sys.argv[1])
bins = {}
for a in sys.argv[2:]:
    name, paths = a.split("=", 1)
    t, _, m = paths.partition(",")
    bins[name] = (t or None, m or None)
MPI = ["mpirun", "--allow-run-as-root", "--bind-to", "core", "-np", "2"]
# floats per rank -> calls per loop (about 10-40 ms a loop)
SIZES = {2: 20000, 64: 20000, 1024: 5000, 16384: 1000, 262144: 100}
REPEATS = "5"
cases = [("mpi", a, f) for a in ("auto", "ring", "native") for f in SIZES]
cases += [("threads", a, f) for a in ("auto", "ring", "tree", "rhd", "native") for f in SIZES]
if os.environ.get("CASES"):
    cases = [(k, a, int(f)) for k, a, f in (c.split(":") for c in os.environ["CASES"].split(","))]
res = {}
best = {}
env = dict(os.environ, CALL_COST_PIN="1")
for rnd in range(rounds):
    for kind, algo, floats in cases:
        names = [n for n in bins if bins[n][0 if kind == "threads" else 1]]
        random.shuffle(names)
        for n in names:
            exe = bins[n][0 if kind == "threads" else 1]
            args = [exe, algo, str(floats), str(SIZES[floats]), "2", REPEATS]
            cmd = MPI + args if kind == "mpi" else args
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.split()
            loops = [float(x) for x in out]
            res.setdefault((kind, algo, floats, n), []).append(statistics.median(loops))
            best[(kind, algo, floats, n)] = min(best.get((kind, algo, floats, n), 1e30), min(loops))
    print(f"round {rnd + 1} done", file=sys.stderr, flush=True)

names = list(bins)
print(f"# {rounds} rounds; us per call: median of runs (min-max of runs) best loop; ratios of medians, then of bests")
print(f"{'backend':8s} {'algo':7s} {'bytes':>8s}" + "".join(f" {n + ' median (min-max) best':>36s}" for n in names)
      + "".join(f" {n + '/' + names[0]:>18s}" for n in names[1:]))
for kind, algo, floats in cases:
    row = f"{kind:8s} {algo:7s} {floats * 4:>8d}"
    meds, bests = {}, {}
    for n in names:
        v = res.get((kind, algo, floats, n))
        if not v:
            row += f" {'-':>36s}"
            continue
        meds[n] = statistics.median(v)
        bests[n] = best[(kind, algo, floats, n)]
        row += f" {meds[n]:>9.3f} ({min(v):8.3f}-{max(v):8.3f}) {bests[n]:8.3f}"
    for n in names[1:]:
        if n in meds and names[0] in meds:
            row += f" {meds[n] / meds[names[0]]:>8.3f} {bests[n] / bests[names[0]]:>9.3f}"
        else:
            row += f" {'-':>18s}"
    print(row)

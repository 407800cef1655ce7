#!/usr/bin/python3
"""Before/after the issue-12 reshaping, interleaved: all_reduce_perf (threads, N=2; mpi, np 2)
time per call per algorithm and size, and ddp_step ms/step. Prints after/before ratios (median over rounds)."""
import json, subprocess, sys, statistics, re, os, tempfile
B, A = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
MPI = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2"]
sizes = ["-b", "16", "-e", "256M", "-f", "16", "-r", "3"]
res = {}
def perf(tag, d, kind):
    j = tempfile.mktemp(suffix=".json")
    if kind == "threads":
        cmd = [f"{d}/bench/all_reduce_perf", "-t", "2", "--algo", "all"] + sizes + ["-J", j]
    else:
        cmd = MPI + [f"{d}/bench/all_reduce_perf_mpi", "--backend", "mpi", "--algo", "all"] + sizes + ["-J", j]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    data = json.load(open(j))
    for t in data["tables"]:
        for r in t["rows"]:
            res.setdefault((kind, t["algorithm"], r["size"], tag), []).append(r["out_of_place"]["time_us"])
def step(tag, d):
    out = subprocess.run([f"{d}/bench/ddp_step", "--steps", "30", "--ranks", "1,2", "--small-only"], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = re.match(r"\s*(\d+)\s+(\S+)\s+([\d.]+)", line)
        if m and not line.startswith("#"):
            res.setdefault(("ddp_step", m.group(2), int(m.group(1)), tag), []).append(float(m.group(3)))
for rnd in range(rounds):
    order = [("before", B), ("after", A)] if rnd % 2 == 0 else [("after", A), ("before", B)]
    for kind in ("threads", "mpi"):
        for tag, d in order:
            perf(tag, d, kind)
    for tag, d in order:
        step(tag, d)
    print(f"round {rnd+1} done", file=sys.stderr, flush=True)
keys = sorted({k[:3] for k in res})
print(f"{'what':10s} {'algo':8s} {'size/N':>10s} {'before':>10s} {'after':>10s} {'after/before':>12s}")
worst = 0
for k in keys:
    b = res.get(k + ("before",)); a = res.get(k + ("after",))
    if not b or not a: continue
    mb, ma = statistics.median(b), statistics.median(a)
    print(f"{k[0]:10s} {k[1]:8s} {k[2]:>10} {mb:10.2f} {ma:10.2f} {ma/mb:12.3f}")

#!/usr/bin/python3
"""Small MPI all-reduces, two builds interleaved (issue12_speed_recheck.txt, 2026-12-01 late).

  issue12_probe_flag_timed.py ROUNDS NAME=PERF_MPI_BINARY NAME=PERF_MPI_BINARY ...

Each round runs every binary once, in a shuffled order:
  mpirun --allow-run-as-root -np 2 --bind-to core BIN --backend mpi -b 8 -e 4K -J out.json
(Auto, out of place and in place, all_reduce_perf's own repeats and medians), and
prints per size and binary the median over rounds of each run's time, the min
and max of the runs, and the ratios of the medians and of the minima to the
first binary's. The load average is printed per round: the machine is shared.
"""
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile


def one(binary, path):
    cmd = ["mpirun", "--allow-run-as-root", "-np", "2", "--bind-to", "core", binary, "--backend", "mpi",
           "-b", "8", "-e", "4K", "-J", path]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    rows = json.load(open(path))["tables"][0]["rows"]
    return {(r["size"], p): r[p]["time_us"] for r in rows for p in ("out_of_place", "in_place")}


def main():
    rounds = int(sys.argv[1])
    builds = [a.split("=", 1) for a in sys.argv[2:]]
    times = {name: {} for name, _ in builds}
    tmp = tempfile.mkdtemp(prefix="probe-flag-")
    for r in range(rounds):
        order = builds[:]
        random.shuffle(order)
        for name, binary in order:
            for k, t in one(binary, os.path.join(tmp, "t.json")).items():
                times[name].setdefault(k, []).append(t)
        print(f"# round {r + 1}: order {' '.join(n for n, _ in order)}, load {os.getloadavg()[0]:.2f}", flush=True)
    first = builds[0][0]
    print(f"# {rounds} rounds; us per call: median of runs (min-max); ratios to {first}: of medians, of minima")
    keys = sorted(times[first])
    for size, place in keys:
        line = f"{place:12s} {size:6d}"
        base = times[first][(size, place)]
        for name, _ in builds:
            v = times[name][(size, place)]
            line += f"   {name} {statistics.median(v):7.3f} ({min(v):6.3f}-{max(v):7.3f})"
            if name != first:
                line += f" {statistics.median(v) / statistics.median(base):5.3f} {min(v) / min(base):5.3f}"
        print(line)


if __name__ == "__main__":
    main()

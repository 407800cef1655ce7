#!/usr/bin/python3
"""Two builds of gradsync, timed interleaved: all_reduce_perf (threads, N = 2; mpi, np 2 bound to cores),
time per call per algorithm, size and placement, and ddp_step ms/step. It made
checked_call_latency_two_builds.txt (315de20 against 895d760, 8 rounds; docs/PERFORMANCE.md).

  checked_call_latency_two_builds.py BEFORE AFTER [ROUNDS] [PICKLE]

BEFORE and AFTER are build trees (BEFORE/bench/all_reduce_perf, ...). Each round runs every tool once
per tree, alternating which goes first. A process on this 2-core VM is either fast or slow for its whole
life (2 spinning ranks on 2 cores), so every repeat is kept, each process is summarised by the median
of its repeats, and the table shows, per row, the best process and the median process of each tree and
their after/before ratios. "<" marks a row where both ratios exceed 1.05."""
import json, pickle, re, statistics, subprocess, sys, tempfile

MPI = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "core", "-np", "2"]
SIZES = ["-b", "16", "-e", "256M", "-f", "16", "-r", "5"]
REPEATS = 5


def perf(res, tag, d, kind):
    j = tempfile.mktemp(suffix=".json")
    if kind == "threads":
        cmd = [f"{d}/bench/all_reduce_perf", "-t", "2", "--algo", "all"] + SIZES + ["-J", j]
    else:
        cmd = MPI + [f"{d}/bench/all_reduce_perf_mpi", "--backend", "mpi", "--algo", "all"] + SIZES + ["-J", j]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    for t in json.load(open(j))["tables"]:
        for r in t["rows"]:
            for place, suffix in (("out_of_place", ""), ("in_place", "-ip")):
                res.setdefault((kind + suffix, t["algorithm"], r["size"], tag), []).append(
                    statistics.median(r[place]["repeats_us"]))


def step(res, tag, d):
    out = subprocess.run([f"{d}/bench/ddp_step", "--steps", "30", "--ranks", "1,2", "--small-only"], check=True,
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = re.match(r"\s*(\d+)\s+(\S+)\s+([\d.]+)", line)
        if m and not line.startswith("#"):
            res.setdefault(("ddp_step", m.group(2), int(m.group(1)), tag), []).append(float(m.group(3)))


def report(res):
    print(f"{'what':10s} {'algo':7s} {'size/N':>10s} {'runs':>4s} {'best b':>9s} {'best a':>9s} {'a/b':>6s} "
          f"{'med b':>9s} {'med a':>9s} {'a/b':>6s}")
    for k in sorted({k[:3] for k in res}):
        b, a = res.get(k + ("before",)), res.get(k + ("after",))
        if not b or not a:
            continue
        best, med = min(a) / min(b), statistics.median(a) / statistics.median(b)
        print(f"{k[0]:10s} {k[1]:7s} {k[2]:>10} {len(a):4d} {min(b):9.2f} {min(a):9.2f} {best:6.3f} "
              f"{statistics.median(b):9.2f} {statistics.median(a):9.2f} {med:6.3f}"
              + ("  <" if best > 1.05 and med > 1.05 else ""))


def main():
    before, after = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    keep = sys.argv[4] if len(sys.argv) > 4 else None
    res = {}
    for rnd in range(rounds):
        order = [("before", before), ("after", after)]
        if rnd % 2:
            order.reverse()
        for kind in ("threads", "mpi"):
            for tag, d in order:
                perf(res, tag, d, kind)
        for tag, d in order:
            step(res, tag, d)
        if keep:
            pickle.dump(res, open(keep, "wb"))
        print(f"round {rnd + 1} done", file=sys.stderr, flush=True)
    report(res)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Injects each fault into flight_faults on 3 to 5 ranks, at a rank and a
call drawn at random, and checks that the failing ranks wrote their flight
records and that tools/flight-analyze names the right rank and call.

  flight_test.py ANALYZER threads FLIGHT_FAULTS
  flight_test.py ANALYZER mpi FLIGHT_FAULTS_MPI MPIRUN

GRADSYNC_FLIGHT_SEED replays a run (the seed is printed first).
"""
import json
import os
import random
import subprocess
import sys
import tempfile


def run_fault(args, fault, n, rank, call, deadline_ms, mode):
    with tempfile.TemporaryDirectory(prefix="flight-") as d:
        env = dict(os.environ, GRADSYNC_FLIGHT_DIR=d)
        if mode == "threads":
            cmd = [args["exe"], fault, str(rank), str(call), str(deadline_ms), str(n)]
        else:
            cmd = [args["mpirun"], "--allow-run-as-root", "--oversubscribe", "--enable-recovery", "--mca", "btl",
                   "self,vader,tcp", "-np", str(n), args["exe"], fault, str(rank), str(call), str(deadline_ms)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        out = p.stdout + p.stderr
        ends = sorted(int(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("END "))
        survivors = [r for r in range(n) if not (fault == "kill" and r == rank)]
        problems = []
        if ends != survivors:
            problems.append(f"ranks that ended: {ends}, expected {survivors}")
        files = sorted(f for f in os.listdir(d) if f.startswith("gradsync-flight-"))
        expected = [f"gradsync-flight-world-rank{r}.json" for r in survivors]
        if files != sorted(expected):
            problems.append(f"records {files}, expected {sorted(expected)}")
        a = subprocess.run([args["analyzer"], d, "--json"], capture_output=True, text=True)
        b = subprocess.run([args["analyzer"], d], capture_output=True, text=True)
        line = b.stdout.strip()
        try:
            v = json.loads(a.stdout.splitlines()[0])
        except (IndexError, json.JSONDecodeError):
            return problems + [f"analyzer said: {a.stdout} {a.stderr}"], out, line
        if v.get("call") != call:
            problems.append(f"analyzer's call #{v.get('call')}, expected #{call}")
        others = [r for r in range(n) if r != rank]
        if fault in ("skip", "sleep"):
            if v.get("absent", []) + v.get("late", []) != [rank]:
                problems.append(f"analyzer's absent {v.get('absent')} and late {v.get('late')}, expected rank {rank}")
            if v.get("waiting") != others:
                problems.append(f"analyzer's waiting {v.get('waiting')}, expected {others}")
            if f"rank {rank} never entered" not in line:
                problems.append("the line does not say that the rank never entered the call")
        elif fault == "different":
            if v.get("mismatch") != [rank]:
                problems.append(f"analyzer's mismatch {v.get('mismatch')}, expected [{rank}]")
            if f"rank {rank} called" not in line:
                problems.append("the line does not name the rank that called something else")
        elif fault == "kill":
            if v.get("missing") != [rank]:
                problems.append(f"analyzer's missing {v.get('missing')}, expected [{rank}]")
            if v.get("waiting") != others:
                problems.append(f"analyzer's waiting {v.get('waiting')}, expected {others}")
        if f"#{call}" not in line:
            problems.append(f"the line does not name call #{call}")
        return problems, out, line


def main():
    analyzer, mode, exe = sys.argv[1], sys.argv[2], sys.argv[3]
    args = {"analyzer": analyzer, "exe": exe, "mpirun": sys.argv[4] if mode == "mpi" else None}
    seed = int(os.environ.get("GRADSYNC_FLIGHT_SEED", random.randrange(1 << 32)))
    print(f"GRADSYNC_FLIGHT_SEED={seed}")
    g = random.Random(seed)
    faults = ["skip", "different", "sleep"] + (["kill"] if mode == "mpi" else [])
    # Under mpirun ranks outnumber cores, and a sanitizer slows every rank: a
    # longer deadline keeps a slow but healthy rank in time.
    deadline_ms = int(os.environ.get("GRADSYNC_FLIGHT_DEADLINE_MS", 400 if mode == "threads" else 1500))
    failed = False
    for fault in faults:
        n = g.choice([3, 4, 5])
        rank = g.randrange(n)
        call = g.randrange(2, 12)
        problems, out, line = run_fault(args, fault, n, rank, call, deadline_ms, mode)
        print(f"{fault}: N = {n}, rank {rank}, call #{call}: {line}")
        if problems:
            failed = True
            print("  FAIL: " + "; ".join(problems))
            print("  output:\n" + out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

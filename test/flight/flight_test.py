#!/usr/bin/env python3
"""Injects each fault into flight_faults on 3 to 5 ranks, at a rank and a
call drawn at random, and checks that the failing ranks wrote their flight
records and that tools/flight-analyze names the right rank and call. The
"signal" fault sends SIGUSR1 (GRADSYNC_FLIGHT_SIGNAL=USR1) while the other
ranks wait for the absent one: they write their records from inside the call.

  flight_test.py ANALYZER threads -- FLIGHT_FAULTS...
  flight_test.py ANALYZER mpi MPIRUN -- FLIGHT_FAULTS...

FLIGHT_FAULTS... is the command of the flight_faults helper (a test binary
and `--helper flight_faults`).

GRADSYNC_FLIGHT_SEED replays a run (the seed is printed first).
"""
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from helper_command import split_command  # noqa: E402


def run_with_signal(cmd, env, n, directory, settle):
    """Runs cmd; once its n ranks are ready and one is away from its call,
    and `settle` seconds later (the others then wait in that call), sends
    SIGUSR1 (to mpirun, which forwards it) every 0.3 s until every other
    rank has written its record."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, ready, away = [], 0, False
    while not (ready == n and away):
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        ready += line.startswith("READY ")
        away = away or line.startswith("AWAY ")
    time.sleep(settle)
    until = time.monotonic() + 30
    while ready == n and away and time.monotonic() < until:
        p.send_signal(signal.SIGUSR1)
        time.sleep(0.3)
        if len([f for f in os.listdir(directory) if f.startswith("gradsync-flight-")]) >= n - 1:
            break
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(cmd, p.returncode, "".join(lines) + out, err)


def run_fault(args, fault, n, rank, call, deadline_ms, mode):
    with tempfile.TemporaryDirectory(prefix="flight-") as d:
        env = dict(os.environ, GRADSYNC_FLIGHT_DIR=d, GRADSYNC_FLIGHT_SIGNAL="USR1")
        if mode == "threads":
            cmd = args["exe"] + [fault, str(rank), str(call), str(deadline_ms), str(n)]
        else:
            cmd = [args["mpirun"], "--allow-run-as-root", "--oversubscribe", "--enable-recovery", "--mca", "btl",
                   "self,vader,tcp", "-np", str(n), *args["exe"], fault, str(rank), str(call), str(deadline_ms)]
        if fault == "signal":
            p = run_with_signal(cmd, env, n, d, deadline_ms / 1e4 * 0.75)
        else:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        out = p.stdout + p.stderr
        ends = sorted(int(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("END "))
        survivors = [r for r in range(n) if not (fault == "kill" and r == rank)]
        problems = []
        if ends != survivors:
            problems.append(f"ranks that ended: {ends}, expected {survivors}")
        files = sorted(f for f in os.listdir(d) if f.startswith("gradsync-flight-"))
        # After a signal, only the ranks waiting in a call write (the absent rank was in none).
        writers = [r for r in survivors if not (fault == "signal" and r == rank)]
        expected = [f"gradsync-flight-world-rank{r}.json" for r in writers]
        if files != sorted(expected):
            problems.append(f"records {files}, expected {sorted(expected)}")
        a = subprocess.run([args["analyzer"], d, "--json"], capture_output=True, text=True)
        b = subprocess.run([args["analyzer"], d], capture_output=True, text=True)
        line = b.stdout.strip()
        try:
            v = json.loads(a.stdout.splitlines()[0])
        except (IndexError, json.JSONDecodeError):
            return problems + [f"analyzer said: {a.stdout} {a.stderr}"], out, line
        others = [r for r in range(n) if r != rank]
        if fault == "signal":
            # A Broadcast's ranks that need nothing from the absent one may finish it and wait in the next.
            waiting = v.get("waiting", {})
            if v.get("missing") != [rank] or sorted(r for rs in waiting.values() for r in rs) != others:
                problems.append(f"analyzer's waiting {waiting} and missing {v.get('missing')}, "
                                f"expected {others} waiting and [{rank}] missing")
            elif not any(f"#{call} " in what for what in waiting):
                problems.append(f"analyzer's calls {list(waiting)}, expected #{call} among them")
            if "on the signal" not in line or f"rank {rank} wrote no record" not in line:
                problems.append("the line does not say who waited where and that the rank wrote nothing")
            return problems, out, line
        if v.get("call") != call:
            problems.append(f"analyzer's call #{v.get('call')}, expected #{call}")
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
    (analyzer, mode, *mpirun), exe = split_command(sys.argv)
    args = {"analyzer": analyzer, "exe": exe, "mpirun": mpirun[0] if mode == "mpi" else None}
    seed = int(os.environ.get("GRADSYNC_FLIGHT_SEED", random.randrange(1 << 32)))
    print(f"GRADSYNC_FLIGHT_SEED={seed}")
    g = random.Random(seed)
    faults = ["skip", "different", "sleep", "signal"] + (["kill"] if mode == "mpi" else [])
    # Under mpirun ranks outnumber cores, and a sanitizer slows every rank: a
    # longer deadline keeps a slow but healthy rank in time.
    deadline_ms = int(os.environ.get("GRADSYNC_FLIGHT_DEADLINE_MS", 400 if mode == "threads" else 1500))
    failed = False
    for fault in faults:
        n = g.choice([3, 4, 5])
        rank = g.randrange(n)
        call = g.randrange(2, 12)
        # The signal fault's ranks wait for the signal, not for a deadline: ten times longer.
        problems, out, line = run_fault(args, fault, n, rank, call, deadline_ms * (10 if fault == "signal" else 1), mode)
        print(f"{fault}: N = {n}, rank {rank}, call #{call}: {line}")
        if problems:
            failed = True
            print("  FAIL: " + "; ".join(problems))
            print("  output:\n" + out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What the timeline (GRADSYNC_TRACE) costs a step: bench/ddp_step and
bench/fsdp_step, and flight_recorder_cost's cheapest all-reduce, run with the
timeline off and on (and, given --baseline, from another build's bench
directory, e.g. one without the timeline), in interleaved rounds whose order
rotates; prints each row's median ms per step (best in brackets).

    bench/trace_cost.py BENCH_DIR [--baseline OTHER_BENCH_DIR] [--rounds 8]
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile

BENCHES = {
    "ddp_step": ["--ranks", "2", "--small-only", "--steps", "30", "--overlap", "on"],
    "fsdp_step": ["--ranks", "2", "--small-only", "--steps", "12"],
    "flight_recorder_cost": ["200000"],
}


def rows(bench, out):
    """{row name: value} from one run's output."""
    found = {}
    for line in out.splitlines():
        if bench == "flight_recorder_cost":
            m = re.match(r"\s*recorder on\s+\(256 entries\):\s+([\d.]+) ns", line)
            if m:
                found["8-byte all-reduce (ns)"] = float(m.group(1))
            continue
        f = line.split()
        if len(f) > 3 and f[0].isdigit():
            found[f[1]] = float(f[2])
    return found


def main():
    p = argparse.ArgumentParser()
    p.add_argument("bench_dir")
    p.add_argument("--baseline")
    p.add_argument("--rounds", type=int, default=8)
    a = p.parse_args()
    variants = ([("baseline", a.baseline, False)] if a.baseline else []) + [("off", a.bench_dir, False),
                                                                             ("on", a.bench_dir, True)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="trace-cost-") as traces:
        for r in range(a.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for bench, args in BENCHES.items():
                for name, directory, on in order:
                    env = dict(os.environ)
                    env.pop("GRADSYNC_TRACE", None)
                    if on:
                        shutil.rmtree(traces, ignore_errors=True)
                        env["GRADSYNC_TRACE"] = traces
                        # The cheapest call with every call kept: the cost of storing, not of dropping.
                        if bench == "flight_recorder_cost":
                            env["GRADSYNC_TRACE_EVENTS"] = "1000000"
                    out = subprocess.run([os.path.join(directory, bench)] + args, env=env, capture_output=True,
                                         text=True).stdout
                    for row, value in rows(bench, out).items():
                        results.setdefault((bench, row), {}).setdefault(name, []).append(value)
    names = [n for n, _, _ in variants]
    for (bench, row), by in results.items():
        med = {n: statistics.median(v) for n, v in by.items()}
        line = f"{bench:>20} {row:<22}" + "".join(f"  {n} {med[n]:8.2f} ({min(by[n]):.2f})" for n in names if n in med)
        if "baseline" in med and "off" in med:
            line += f"  off/baseline {med['off'] / med['baseline'] - 1:+.1%}"
        if "on" in med and "off" in med:
            line += f"  on/off {med['on'] / med['off'] - 1:+.1%}"
        print(line)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Time per step inside each kind of collective, from a GRADSYNC_TRACE file of
bench/libtorch_fsdp_step --only STRATEGY (one rank's gradsync-trace-rank<R>.json).

    python3 bench/results/libtorch_fsdp_trace_sum.py DIR/gradsync-trace-rank0.json [--warmup 3]

fully_shard records its collectives but no step phases (tools/trace-summary
wants those), so steps are cut at the bench's barrier before each step; the
first --warmup steps are left out. Prints, per slice name, the median over
steps of its summed duration (the upper one of an even count, as the bench
takes its medians) and its calls per step.
"""
import argparse
import collections
import json


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", nargs="+")
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    for path in a.trace:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        events = d["traceEvents"] if isinstance(d, dict) else d
        events = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
        cuts = [i for i, e in enumerate(events) if e["name"] == "Barrier"]
        steps = [events[i + 1:j] for i, j in zip(cuts, cuts[1:] + [len(events)])][a.warmup:]
        if not steps:
            print(f"{path}: no timed steps")
            continue
        names = sorted({(e["name"], e.get("cat", "")) for s in steps for e in s})
        print(f"{path} {len(steps)} steps")
        for name, cat in names:
            per_step = sorted(sum(e["dur"] for e in s if e["name"] == name) / 1000 for s in steps)
            calls = sum(1 for s in steps for e in s if e["name"] == name) / len(steps)
            print(f"  {name:14} {cat:14} median {per_step[len(per_step) // 2]:7.2f} ms/step  calls/step {calls:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

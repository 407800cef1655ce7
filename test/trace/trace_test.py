#!/usr/bin/env python3
"""Runs the trainers' timeline cases (test_train_trace.cpp) with their files
kept, parses every rank's file as JSON and checks what Chrome's and
Perfetto's readers rely on: one process per rank named for it, complete
slices with dur >= 0, times monotonic on each track, slices properly nested
on each track, the dropped count in the metadata; and that one
ShardedTrainer step holds its strategy's collectives on the worker's track.
Then tools/trace-summary must name every rank, --merge give one process
per rank, and --png draw FullShard's step as a PNG file.

  trace_test.py TRACE_SUMMARY TRAIN_TESTS_EXE
"""
import json
import os
import subprocess
import sys
import tempfile

UNITS = 4  # test_schedule's model: 4 units, wrapped one each
# One step's collectives on the worker per strategy (keep_last_forward_unit,
# no prefetch): FullShard gathers every unit in forward and all but the last
# again in backward, then reduce-scatters each; ShardGradOp gathers once;
# NoShard all-reduces each unit; HybridShard is FullShard within a group of 2
# plus an all-reduce of each unit's shard across the groups.
EXPECTED = {
    "FullShard": {"AllGather": 2 * UNITS - 1, "ReduceScatter": UNITS},
    "ShardGradOp": {"AllGather": UNITS, "ReduceScatter": UNITS},
    "NoShard": {"AllReduce": UNITS},
    "HybridShard": {"AllGather": 2 * UNITS - 1, "ReduceScatter": UNITS, "AllReduce": UNITS},
}
# Ranks per case (test_train_trace.cpp): HybridShard needs two groups.
WORLD = {"FullShard": 3, "ShardGradOp": 3, "NoShard": 3, "HybridShard": 4, "Replicated": 3, "AsyncSave": 3}


def check_file(path, rank, problems):
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    if trace["otherData"]["world_rank"] != rank or "dropped" not in trace["otherData"]:
        problems.append(f"{path}: otherData {trace['otherData']}")
    meta = [e for e in events if e["ph"] == "M"]
    if not any(e["name"] == "process_name" and e["args"]["name"] == f"rank {rank}" for e in meta):
        problems.append(f"{path}: no process named rank {rank}")
    if not any(e["name"] == "gradsync_trace" and "dropped" in e["args"] for e in meta):
        problems.append(f"{path}: no dropped count in the metadata")
    tracks = {}
    for e in events:
        if e["pid"] != rank:
            problems.append(f"{path}: an event of pid {e['pid']}")
        if e["ph"] == "X":
            if e["dur"] < 0:
                problems.append(f"{path}: {e['name']} has dur {e['dur']}")
            tracks.setdefault(e["tid"], []).append(e)
        elif e["ph"] != "M":
            problems.append(f"{path}: an event of phase {e['ph']}")
    for tid, xs in tracks.items():
        stack = []
        for prev, e in zip([None] + xs, xs):
            if prev and e["ts"] < prev["ts"]:
                problems.append(f"{path}: track {tid} goes back in time at {e['name']}")
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            if stack and e["ts"] + e["dur"] > stack[-1] + 0.001:
                problems.append(f"{path}: track {tid}: {e['name']} at {e['ts']} overlaps the slice around it")
            stack.append(e["ts"] + e["dur"])
    return trace


def worker_collectives_in_step(trace):
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    step = next(e for e in xs if e["name"] == "step 1")
    counts = {}
    for e in xs:
        if ("seq" in e.get("args", {}) and names[e["tid"]] == "progress worker" and e["ts"] >= step["ts"]
                and e["ts"] + e["dur"] <= step["ts"] + step["dur"]):
            counts[e["name"]] = counts.get(e["name"], 0) + 1
    return counts


def main():
    summary, exe = sys.argv[1], sys.argv[2]
    problems = []
    with tempfile.TemporaryDirectory(prefix="trace-") as d:
        env = dict(os.environ, GRADSYNC_TRACE_TEST_DIR=d)
        env.pop("GRADSYNC_TRACE", None)
        run = subprocess.run([exe, "--source-file=*/test_train_trace.cpp"], env=env, capture_output=True, text=True,
                             timeout=240)
        print(run.stdout[-2000:] + run.stderr[-2000:])
        if run.returncode != 0:
            print("the timeline cases failed")
            return 1
        for case in list(EXPECTED) + ["Replicated", "AsyncSave"]:
            directory = os.path.join(d, case)
            for rank in range(WORLD[case]):
                trace = check_file(os.path.join(directory, f"gradsync-trace-rank{rank}.json"), rank, problems)
                if case in EXPECTED and worker_collectives_in_step(trace) != EXPECTED[case]:
                    problems.append(f"{case} rank {rank}: the step's worker collectives "
                                    f"{worker_collectives_in_step(trace)}, expected {EXPECTED[case]}")
            merged = os.path.join(d, case + "-merged.json")
            out = subprocess.run([summary, directory, "--merge", merged], capture_output=True, text=True)
            print(f"$ trace-summary {case}\n{out.stdout}{out.stderr}")
            if out.returncode != 0:
                problems.append(f"{case}: trace-summary exited {out.returncode}")
            for rank in range(WORLD[case]):
                if f"rank {rank} " not in out.stdout:
                    problems.append(f"{case}: trace-summary does not name rank {rank}")
            if "step 1:" not in out.stdout or "slowest rank" not in out.stdout or "exposed" not in out.stdout:
                problems.append(f"{case}: trace-summary gives no step 1 and its slowest rank")
            with open(merged, encoding="utf-8") as f:
                pids = {e["pid"] for e in json.load(f)["traceEvents"]}
            if pids != set(range(WORLD[case])):
                problems.append(f"{case}: the merged trace's processes are {sorted(pids)}")
            if case == "FullShard":
                png = os.path.join(d, "step.png")
                out = subprocess.run([summary, directory, "--png", png], capture_output=True, text=True, timeout=120)
                if out.returncode != 0:
                    problems.append(f"trace-summary --png exited {out.returncode}: {out.stderr[-800:]}")
                else:
                    with open(png, "rb") as f:
                        if f.read(8) != b"\x89PNG\r\n\x1a\n":
                            problems.append("trace-summary --png wrote no PNG file")
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Kills a trainer's save with SIGKILL before every file operation of every
rank: a ReplicatedTrainer's full checkpoint and a ShardedTrainer's sharded
one, on 1 to 4 ranks (threads), over a directory that holds a checkpoint of
the same layout or of the other one. Each kill starts from a copy of the
same directory, which holds a committed checkpoint of step 2 (and the files
of step 1 a save removes); the save writes step 3. After each kill the
directory must load (at N = 3) step 2 or step 3 bit for bit, never an error
or a mix. Then a complete save into a killed directory (killed mid-way, and
killed between the commit and the removal of the old files) must leave only
its own files.

With --async the saves go through an AsyncCheckpointer (a step runs while
the background threads write, then wait() commits), and each configuration
is killed at GRADSYNC_KILL_POINTS (default 12) random file operations of
the process, whichever thread makes them: their order across threads
varies from run to run. GRADSYNC_KILL_SEED replays the points.

usage: trainer_kill_test.py WORKDIR [--async] -- WRITER...

Environment: GRADSYNC_KILL_WORLDS (default "1,2,3,4"), GRADSYNC_KILL_SWITCHES
(default "full>full,sharded>sharded,full>sharded,sharded>full": the layout
in the directory, then the layout saved over it).
"""

import collections
import concurrent.futures
import json
import os
import pathlib
import random
import shutil
import sys
import time

import kill_harness as kh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from helper_command import split_command  # noqa: E402

STEP = r"step (\d+)"


def main():
    options, writer = split_command(sys.argv)
    work, asynchronous = pathlib.Path(options[0]), options[1:] == ["--async"]
    points = int(os.environ.get("GRADSYNC_KILL_POINTS", "12"))
    seed = int(os.environ.get("GRADSYNC_KILL_SEED", random.randrange(1 << 31)))
    rng = random.Random(seed)
    if asynchronous:
        print(f"asynchronous saves, {points} random kill points each, seed {seed} (GRADSYNC_KILL_SEED={seed} replays)")
    worlds = [int(n) for n in os.environ.get("GRADSYNC_KILL_WORLDS", "1,2,3,4").split(",")]
    switches = [s.split(">") for s in os.environ.get(
        "GRADSYNC_KILL_SWITCHES", "full>full,sharded>sharded,full>sharded,sharded>full").split(",")]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    start = time.monotonic()
    total = 0
    # The kills of one configuration run side by side: each has its own directory.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1))
    for old, new in switches:
        for n in worlds:
            command = "write-async" if asynchronous else "write"
            write = lambda layout, d, gen, *kill: [*writer, command, layout, str(n), d, str(gen), *map(str, kill)]
            base = work / f"{old}-{new}-n{n}"
            kh.complete(write(old, base, 1))
            kh.complete(write(old, base, 2))
            # A complete save from a copy counts each rank's file operations from this state.
            probe = work / f"{base.name}-probe"
            shutil.copytree(base, probe)
            ops = kh.complete(write(new, probe, 3))
            if asynchronous:
                # One count for the process: the kill is at its k-th file operation, on any thread.
                # The last (rank 0's last removal after the commit) is always among them.
                ks = sorted(set(rng.sample(range(1, ops[0] + 1), min(points, ops[0]))) | {ops[0]})
                dirs = kh.kill_points([(0, k) for k in ks], base, lambda d, r, k: kh.run(write(new, d, 3, k)), pool)
            else:
                dirs = kh.every_kill_point(ops, base, lambda d, r, k: kh.run(write(new, d, 3, r, k)), pool)
            steps = kh.verify_each([*writer, "verify"], dirs, STEP)
            seen = collections.Counter()
            for d, (step,) in zip(dirs, steps):
                if step not in (2, 3):
                    sys.exit(f"FAIL: {d} holds step {step}, expected 2 (old) or 3 (new)")
                seen[step] += 1
            # Rank 0 does the commit and the removals: a kill half-way through its operations
            # leaves a temporary or step 3's files uncommitted, one before its last leaves step 3
            # committed with a file of step 2.
            for d in (dirs[len(dirs) // 2], dirs[-1]):
                kh.complete(write(new, d, 4))
                with open(d / "checkpoint.commit") as f:
                    own = "checkpoint-%08d" % json.load(f)["generation"]
                left = sorted(f for f in os.listdir(d) if f != "checkpoint.commit" and not f.startswith(own))
                if left:
                    sys.exit(f"FAIL: a complete save into {d} left {left}")
                if kh.verify_each([*writer, "verify"], [d], STEP) != [(4,)]:
                    sys.exit(f"FAIL: {d} does not hold step 4 after a complete save of it")
            total += len(dirs)
            print(f"{old} then {new}, N={n}: file operations {'of the process' if asynchronous else 'per rank'} {ops}; "
                  f"{len(dirs)} kill points: "
                  f"{seen[2]} left step 2, {seen[3]} step 3")
            for d in [base, probe] + dirs:
                shutil.rmtree(d, ignore_errors=True)
    print(f"{total} kill points, each loads the old or the new checkpoint; {time.monotonic() - start:.1f} s")
    shutil.rmtree(work, ignore_errors=True)
    print("PASS")


if __name__ == "__main__":
    main()

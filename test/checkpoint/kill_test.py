#!/usr/bin/python3
"""Kills a checkpoint writer with SIGKILL at random I/O steps.

usage: kill_test.py WORKDIR -- WRITER...

The writer (checkpoint_writer.cpp) raises SIGKILL before the file operation given on its
command line (a create, pwrite, fsync, close, rename, directory fsync or old-file removal),
so each kill point is deterministic and replayable. After every kill the
previous checkpoint (full file and sharded index) must load and verify, and
the new one must be complete or absent. Environment: GRADSYNC_KILL_TRIALS
(default 60), GRADSYNC_KILL_SEED (default: random, printed).
"""

import collections
import os
import re
import shutil
import sys
import time

import kill_harness as kh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from helper_command import split_command  # noqa: E402

# What `WRITER verify` prints: the generation of the full file and of the sharded index.
GENERATIONS = r"full (\d+) sharded (\d+)\n"


def main():
    (work,), writer = split_command(sys.argv)
    trials, rng = kh.start("kill test", 60, work)
    start = time.monotonic()

    # The second write also removes the first one's shard files; every later
    # write has at least as many steps, so every k <= steps is a kill.
    for gen in (1, 2):
        steps = kh.write_whole(writer, work, gen)
    print(f"a write takes {steps} I/O steps")
    state = kh.verify(writer, work, GENERATIONS)
    assert state == (2, 2), state

    killed_at = collections.Counter()
    kills = 0
    for trial in range(trials):
        gen = 3 + trial
        # A completed write also removes the old generation's shard files.
        k = kh.kill_point(rng, trial, steps)
        p = kh.write_killed(writer, work, gen, k, trial)
        if kh.killed(p):
            kills += 1
            killed_at[re.search(r"\((\w+)\)", p.stderr).group(1)] += 1
        full, sharded = kh.verify(writer, work, GENERATIONS)
        for what, got, before in (("full", full, state[0]), ("sharded", sharded, state[1])):
            if got not in (before, gen):
                sys.exit(f"FAIL: trial {trial} (kill at {k}): {what} checkpoint is generation {got}, "
                         f"expected {before} (old) or {gen} (new)")
        if p.returncode == 0 and (full, sharded) != (gen, gen):
            sys.exit(f"FAIL: trial {trial}: a completed write left generations {(full, sharded)}")
        if sharded == gen and full != gen:
            sys.exit(f"FAIL: trial {trial}: the sharded checkpoint is new but the full one (written first) is not")
        state = (full, sharded)
        print(f"trial {trial}: {kh.outcome(k, p)} -> full {full} sharded {sharded}")

    leftovers = [f for f in os.listdir(work) if ".tmp-" in f]
    print(f"{kills} of {trials} writes killed, at {dict(killed_at)}; "
          f"{len(leftovers)} stale temporaries left (never under a final name); "
          f"{time.monotonic() - start:.1f} s")
    if kills < 50 and trials >= 60:
        sys.exit(f"FAIL: only {kills} kills (want >= 50)")
    shutil.rmtree(work, ignore_errors=True)
    print("PASS")


if __name__ == "__main__":
    main()

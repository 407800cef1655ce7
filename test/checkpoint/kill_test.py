#!/usr/bin/python3
"""Kills a checkpoint writer with SIGKILL at random I/O steps.

usage: kill_test.py WRITER WORKDIR

The writer (checkpoint_writer.cpp) raises SIGKILL at the I/O step given on its
command line (a pwrite, fsync, rename, directory fsync or old-file removal),
so each kill point is deterministic and replayable. After every kill the
previous checkpoint (full file and sharded index) must load and verify, and
the new one must be complete or absent. Environment: GRADSYNC_KILL_TRIALS
(default 60), GRADSYNC_KILL_SEED (default: random, printed).
"""

import collections
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time


def run(args):
    return subprocess.run(args, capture_output=True, text=True)


def verify(writer, work):
    p = run([writer, "verify", work])
    if p.returncode != 0:
        sys.exit(f"FAIL: checkpoint in {work} does not load: {p.stderr.strip()}")
    m = re.fullmatch(r"full (\d+) sharded (\d+)\n", p.stdout)
    if not m:
        sys.exit(f"FAIL: unexpected verify output {p.stdout!r}")
    return int(m.group(1)), int(m.group(2))


def main():
    writer, work = sys.argv[1], sys.argv[2]
    trials = int(os.environ.get("GRADSYNC_KILL_TRIALS", "60"))
    seed = int(os.environ.get("GRADSYNC_KILL_SEED", random.randrange(1 << 31)))
    print(f"kill test: {trials} trials, seed {seed} (GRADSYNC_KILL_SEED={seed} replays)")
    rng = random.Random(seed)
    start = time.monotonic()
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)

    # The second write also removes the first one's shard files; every later
    # write has at least as many steps, so every k <= steps is a kill.
    for gen in (1, 2):
        p = run([writer, "write", work, str(gen)])
        if p.returncode != 0:
            sys.exit(f"FAIL: write of generation {gen}: {p.stderr.strip()}")
    steps = int(re.search(r"steps (\d+)", p.stdout).group(1))
    print(f"a write takes {steps} I/O steps")
    state = verify(writer, work)
    assert state == (2, 2), state

    killed_at = collections.Counter()
    kills = 0
    for trial in range(trials):
        gen = 3 + trial
        # Every tenth write finishes, so later trials start from a new
        # generation too (and the old shard files get removed).
        k = 0 if trial % 10 == 9 else rng.randint(1, steps)
        p = run([writer, "write", work, str(gen)] + ([str(k)] if k else []))
        if p.returncode == -signal.SIGKILL:
            kills += 1
            killed_at[re.search(r"\((\w+)\)", p.stderr).group(1)] += 1
        elif p.returncode != 0:
            sys.exit(f"FAIL: trial {trial} (kill at {k}): writer failed: {p.stderr.strip()}")
        full, sharded = verify(writer, work)
        for what, got, before in (("full", full, state[0]), ("sharded", sharded, state[1])):
            if got not in (before, gen):
                sys.exit(f"FAIL: trial {trial} (kill at {k}): {what} checkpoint is generation {got}, "
                         f"expected {before} (old) or {gen} (new)")
        if p.returncode == 0 and (full, sharded) != (gen, gen):
            sys.exit(f"FAIL: trial {trial}: a completed write left generations {(full, sharded)}")
        if sharded == gen and full != gen:
            sys.exit(f"FAIL: trial {trial}: the sharded checkpoint is new but the full one (written first) is not")
        state = (full, sharded)
        print(f"trial {trial}: {f'kill at {k}' if k else 'no kill'}: {'killed' if p.returncode else 'completed'} -> full {full} sharded {sharded}")

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

#!/usr/bin/python3
"""Kills a ShardedTrainer's sharded save (2 ranks, threads) with SIGKILL at
random I/O steps of either rank: the checkpoint directory must always load
at N = 3, holding the previous step's state or the new one, bit for bit.

usage: sharded_trainer_kill_test.py WRITER WORKDIR

Two ranks write at once, so which rank's step a kill number hits varies
from run to run; the seed replays the numbers. Environment:
GRADSYNC_KILL_TRIALS (default 30), GRADSYNC_KILL_SEED (default: random).
"""

import os
import random
import re
import shutil
import signal
import subprocess
import sys


def run(args):
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def verify(writer, work):
    p = run([writer, "verify", work])
    if p.returncode != 0:
        sys.exit(f"FAIL: the checkpoint in {work} does not load: {p.stderr.strip()}")
    return int(re.fullmatch(r"step (\d+)\n", p.stdout).group(1))


def main():
    writer, work = sys.argv[1], sys.argv[2]
    trials = int(os.environ.get("GRADSYNC_KILL_TRIALS", "30"))
    seed = int(os.environ.get("GRADSYNC_KILL_SEED", random.randrange(1 << 31)))
    print(f"sharded trainer kill test: {trials} trials, seed {seed} (GRADSYNC_KILL_SEED={seed} replays)")
    rng = random.Random(seed)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    p = run([writer, "write", work, "1"])
    if p.returncode != 0:
        sys.exit(f"FAIL: first write: {p.stderr.strip()}")
    steps = int(re.search(r"steps (\d+)", p.stdout).group(1))
    print(f"a save takes {steps} I/O steps")
    state = verify(writer, work)
    assert state == 1, state
    kills = 0
    for trial in range(trials):
        gen = 2 + trial
        k = 0 if trial % 10 == 9 else rng.randint(1, steps)
        p = run([writer, "write", work, str(gen)] + ([str(k)] if k else []))
        if p.returncode == -signal.SIGKILL:
            kills += 1
        elif p.returncode != 0:
            sys.exit(f"FAIL: trial {trial} (kill at {k}): writer failed: {p.stderr.strip()}")
        got = verify(writer, work)
        if got not in (state, gen) or (p.returncode == 0 and got != gen):
            sys.exit(f"FAIL: trial {trial} (kill at {k}): the checkpoint holds step {got}, "
                     f"expected {state} (old) or {gen} (new)")
        print(f"trial {trial}: {f'kill at {k}' if k else 'no kill'}: "
              f"{'killed' if p.returncode else 'completed'} -> step {got}")
        state = got
    print(f"{kills} of {trials} saves killed")
    if kills < trials * 8 // 10:
        sys.exit(f"FAIL: only {kills} kills")
    shutil.rmtree(work, ignore_errors=True)
    print("PASS")


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Kills a ShardedTrainer's sharded save (2 ranks, threads) with SIGKILL at
random I/O steps of either rank: the checkpoint directory must always load
at N = 3, holding the previous step's state or the new one, bit for bit.

usage: sharded_trainer_kill_test.py WRITER WORKDIR

Two ranks write at once, so which rank's step a kill number hits varies
from run to run; the seed replays the numbers. Environment:
GRADSYNC_KILL_TRIALS (default 30), GRADSYNC_KILL_SEED (default: random).
"""

import shutil
import sys

import kill_harness as kh

# What `WRITER verify` prints: the trainer step the checkpoint holds.
STEP = r"step (\d+)\n"


def main():
    writer, work = sys.argv[1], sys.argv[2]
    trials, rng = kh.start("sharded trainer kill test", 30, work)
    steps = kh.write_whole(writer, work, 1)
    print(f"a save takes {steps} I/O steps")
    (state,) = kh.verify(writer, work, STEP)
    assert state == 1, state
    kills = 0
    for trial in range(trials):
        gen = 2 + trial
        k = kh.kill_point(rng, trial, steps)
        p = kh.write_killed(writer, work, gen, k, trial)
        kills += kh.killed(p)
        (got,) = kh.verify(writer, work, STEP)
        if got not in (state, gen) or (p.returncode == 0 and got != gen):
            sys.exit(f"FAIL: trial {trial} (kill at {k}): the checkpoint holds step {got}, "
                     f"expected {state} (old) or {gen} (new)")
        print(f"trial {trial}: {kh.outcome(k, p)} -> step {got}")
        state = got
    print(f"{kills} of {trials} saves killed")
    if kills < trials * 8 // 10:
        sys.exit(f"FAIL: only {kills} kills")
    shutil.rmtree(work, ignore_errors=True)
    print("PASS")


if __name__ == "__main__":
    main()

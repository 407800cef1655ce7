"""What the checkpoint kill tests share: a writer program that saves
generation GEN into WORKDIR (`WRITER write WORKDIR GEN [K]`, killing itself
with SIGKILL at its K-th I/O step) and checks what is there
(`WRITER verify WORKDIR`), driven with a replayable seed.
"""

import os
import random
import re
import shutil
import signal
import subprocess
import sys


def run(args):
    # A writer that hangs fails its trial rather than the whole test's timeout.
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def start(title, default_trials, work):
    """Trials and a seeded generator from GRADSYNC_KILL_TRIALS and
    GRADSYNC_KILL_SEED (printed, so a failure replays), and an empty WORKDIR."""
    trials = int(os.environ.get("GRADSYNC_KILL_TRIALS", str(default_trials)))
    seed = int(os.environ.get("GRADSYNC_KILL_SEED", random.randrange(1 << 31)))
    print(f"{title}: {trials} trials, seed {seed} (GRADSYNC_KILL_SEED={seed} replays)")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    return trials, random.Random(seed)


def verify(writer, work, pattern):
    """The generations `WRITER verify` reports, as the integer groups of `pattern`."""
    p = run([writer, "verify", work])
    if p.returncode != 0:
        sys.exit(f"FAIL: the checkpoint in {work} does not load: {p.stderr.strip()}")
    m = re.fullmatch(pattern, p.stdout)
    if not m:
        sys.exit(f"FAIL: unexpected verify output {p.stdout!r}")
    return tuple(int(g) for g in m.groups())


def write_whole(writer, work, gen):
    """A write that must complete; returns how many I/O steps it took."""
    p = run([writer, "write", work, str(gen)])
    if p.returncode != 0:
        sys.exit(f"FAIL: write of generation {gen}: {p.stderr.strip()}")
    return int(re.search(r"steps (\d+)", p.stdout).group(1))


def kill_point(rng, trial, steps):
    """The I/O step to kill trial `trial` at, 0 for none: every tenth write
    completes, so later trials start from a new generation too."""
    return 0 if trial % 10 == 9 else rng.randint(1, steps)


def write_killed(writer, work, gen, k, trial):
    """Writes generation `gen`, killed at step k (none if 0). Returns the
    completed process; exits on any failure other than the kill."""
    p = run([writer, "write", work, str(gen)] + ([str(k)] if k else []))
    if p.returncode not in (0, -signal.SIGKILL):
        sys.exit(f"FAIL: trial {trial} (kill at {k}): writer failed: {p.stderr.strip()}")
    return p


def killed(p):
    return p.returncode == -signal.SIGKILL


def outcome(k, p):
    """The start of a trial's line: where it was to be killed and whether it was."""
    return f"{f'kill at {k}' if k else 'no kill'}: {'killed' if p.returncode else 'completed'}"

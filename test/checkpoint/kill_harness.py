"""What the checkpoint kill tests share: a writer program that saves
generation GEN into WORKDIR, killing itself with SIGKILL before its K-th
file operation (`WRITER write WORKDIR GEN [K]`; the trainers' writer takes
a rank too), and checks what is there (`WRITER verify ...`). Random kill
points come from a replayable seed; `every_kill_point` tries them all.
WRITER is a command, the words after `--` on a test's command line (a
test binary's helper: `test_core --helper checkpoint_writer`).
"""

import os
import pathlib
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
    p = run(writer + ["verify", work])
    if p.returncode != 0:
        sys.exit(f"FAIL: the checkpoint in {work} does not load: {p.stderr.strip()}")
    m = re.fullmatch(pattern, p.stdout)
    if not m:
        sys.exit(f"FAIL: unexpected verify output {p.stdout!r}")
    return tuple(int(g) for g in m.groups())


def write_whole(writer, work, gen):
    """A write that must complete; returns how many I/O steps it took."""
    p = run(writer + ["write", work, str(gen)])
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
    p = run(writer + ["write", work, str(gen)] + ([str(k)] if k else []))
    if p.returncode not in (0, -signal.SIGKILL):
        sys.exit(f"FAIL: trial {trial} (kill at {k}): writer failed: {p.stderr.strip()}")
    return p


def killed(p):
    return p.returncode == -signal.SIGKILL


def outcome(k, p):
    """The start of a trial's line: where it was to be killed and whether it was."""
    return f"{f'kill at {k}' if k else 'no kill'}: {'killed' if p.returncode else 'completed'}"


def complete(args):
    """A writer run that must complete; returns the integers of its "ops ..." line."""
    p = run(args)
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(map(str, args))}: {p.stderr.strip()}")
    m = re.search(r"^ops((?: \d+)+)$", p.stdout, re.M)
    if not m:
        sys.exit(f"FAIL: no ops line from {' '.join(map(str, args))}: {p.stdout!r}")
    return [int(c) for c in m.group(1).split()]


def every_kill_point(ops, start, killed_write, pool):
    """For each rank r and each k in 1..ops[r]: a copy of directory `start`,
    into which `killed_write(directory, r, k)` (a completed process) must have
    been killed, run on executor `pool`. Returns the directories, in order."""
    return kill_points([(r, k) for r, c in enumerate(ops) for k in range(1, c + 1)], start, killed_write, pool)


def kill_points(points, start, killed_write, pool):
    """every_kill_point for the (r, k) pairs of `points` only."""
    start = pathlib.Path(start)

    def trial(r, k):
        d = start.parent / f"{start.name}-rank{r}-op{k}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(start, d)
        p = killed_write(d, r, k)
        if not killed(p):
            return d, (f"the write into {d} was to be killed before rank {r}'s file operation {k}, "
                       f"but exited {p.returncode}: {p.stderr.strip()}")
        return d, None

    dirs = []
    for d, error in pool.map(lambda rk: trial(*rk), points):
        if error:
            sys.exit("FAIL: " + error)
        dirs.append(d)
    return dirs


def verify_each(args, dirs, pattern):
    """Runs `args + dirs` (a verify that prints "DIR ..." for each) once;
    returns each directory's rest of line as the integer groups of
    `pattern`, exiting with the writer's message for one that does not
    load."""
    p = run(list(args) + [str(d) for d in dirs])
    if p.returncode != 0:
        sys.exit(f"FAIL: verify exited {p.returncode}: {p.stderr.strip()}")
    got = {}
    for line in p.stdout.splitlines():
        d, rest = line.split(" ", 1)
        m = re.fullmatch(pattern, rest)
        if not m:
            sys.exit(f"FAIL: {d} does not load as a whole checkpoint: {rest}")
        got[d] = tuple(int(g) for g in m.groups())
    missing = [str(d) for d in dirs if str(d) not in got]
    if missing:
        sys.exit(f"FAIL: verify said nothing of {missing}")
    return [got[str(d)] for d in dirs]

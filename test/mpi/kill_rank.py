#!/usr/bin/env python3
"""Rank 2 of 3 dies by SIGKILL mid-loop (see kill_rank.cpp); checks that the
survivors end within the deadline plus slack.

  kill_rank.py MPIRUN throw|abort [DEADLINE_S] [RUNS] [ring|native] [FLOATS] -- KILL_RANK...

KILL_RANK... is the kill_rank helper's command (a test binary and
`--helper kill_rank`).

throw: both survivors end with Timeout or Aborted, naming rank 2.
abort: a survivor prints why and MPI_Aborts the job, which ends in time.
FLOATS: large messages, and rank 2 dies inside a call at a drawn time (see
kill_rank.cpp); each run's seed is printed, GRADSYNC_TEST_SEED=<seed>
replays it.
"""
import os
import random
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'support'))
from helper_command import split_command  # noqa: E402

SLACK_S = 1.5  # past the deadline: hearing out the others, then leaving


def run_once(mpirun, exe, policy, deadline, algo, floats):
    cmd = [mpirun, '--allow-run-as-root', '--oversubscribe', '--enable-recovery', '--mca', 'btl', 'self,vader,tcp',
           '-np', '3', *exe, policy, str(deadline), algo]
    if floats:
        env_seed = os.environ.get('GRADSYNC_TEST_SEED')
        seed = int(env_seed, 0) if env_seed else random.getrandbits(63)
        print('seed %d' % seed, flush=True)
        cmd += [str(floats), str(seed)]
    # Each line is stamped as it arrives: under abort, when a survivor said
    # it was aborting is gradsync's part; how long mpirun then takes to tear
    # the job down is Open MPI's (1 to 4 s here, in steps of about a second).
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(deadline + 60, p.kill)
    timer.start()
    lines = [(time.time(), line) for line in p.stdout]
    p.wait()
    timer.cancel()
    ended = time.time()
    out = ''.join(line for _, line in lines)
    kills = [float(l.split()[1]) for l in out.splitlines() if l.startswith('KILL ')]
    survivors = [l.split(' ', 4) for l in out.splitlines() if l.startswith('SURVIVOR ')]
    problems = []
    if len(kills) != 1:
        problems.append('expected one KILL line')
        return problems, out
    killed = kills[0]
    for l in out.splitlines():
        if l.startswith('LARGE '):
            print(l)
    if policy == 'throw':
        ranks = sorted(int(s[1]) for s in survivors)
        if ranks != [0, 1]:
            problems.append('expected survivors 0 and 1, got %s' % ranks)
        for s in survivors:
            rank, t, kind, what = int(s[1]), float(s[2]), s[3], s[4]
            took = t - killed
            if kind not in ('Timeout', 'Aborted'):
                problems.append('rank %d ended with %s, not Timeout or Aborted' % (rank, kind))
            if 'rank 2' not in what:
                problems.append('rank %d did not name rank 2: %s' % (rank, what))
            if took > deadline + SLACK_S:
                problems.append('rank %d took %.2f s after the kill (deadline %.1f s)' % (rank, took, deadline))
            print('rank %d: %s after %.2f s: %s' % (rank, kind, took, what))
    else:
        aborting = [t for t, line in lines if 'aborting the MPI job' in line]
        took = (aborting[0] if aborting else ended) - killed
        # Under --enable-recovery, Open MPI 4.1's mpirun exits 0 even when a
        # rank called MPI_Abort, and its own report of it is sometimes lost
        # (ORTE_ERROR_LOG in show_help): the survivor's line is the sign,
        # with no survivor returning and mpirun ending in time.
        if 'aborting the MPI job' not in out or 'rank 2' not in out:
            problems.append('no survivor printed why it aborted the job, naming rank 2')
        if survivors:
            problems.append('a survivor returned instead of aborting the job')
        if took > deadline + SLACK_S:
            problems.append('the first survivor aborted %.2f s after the kill (deadline %.1f s)' % (took, deadline))
        # mpirun needs a moment to take the job down once a rank aborts.
        if ended - killed > deadline + SLACK_S + 10:
            problems.append('the job ended %.2f s after the kill (deadline %.1f s)' % (ended - killed, deadline))
        print('a survivor aborted %.2f s after the kill, the job ended after %.2f s, mpirun exit %d' %
              (took, ended - killed, p.returncode))
    return problems, out


def main():
    (mpirun, policy, *rest), exe = split_command(sys.argv)
    deadline = float(rest[0]) if len(rest) > 0 else 2.0
    runs = int(rest[1]) if len(rest) > 1 else 3
    algo = rest[2] if len(rest) > 2 else 'ring'
    floats = int(rest[3]) if len(rest) > 3 else 0
    for i in range(runs):
        problems, out = run_once(mpirun, exe, policy, deadline, algo, floats)
        if problems:
            print(out)
            print('run %d of %d FAILED:\n  %s' % (i + 1, runs, '\n  '.join(problems)))
            return 1
    print('%d runs passed' % runs)
    return 0


if __name__ == '__main__':
    sys.exit(main())

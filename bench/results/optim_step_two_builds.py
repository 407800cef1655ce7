#!/usr/bin/python3
"""Two builds' bench/optim_step, interleaved: ms per step of Sgd with momentum,
Adam and AdamW per size, the median of each build's runs, and after/before.
It made optim_step_state_stagger.txt (docs/PERFORMANCE.md).

  optim_step_two_builds.py BEFORE AFTER [SIZES] [ROUNDS]

BEFORE and AFTER are optim_step executables. Each round runs both once, the
first alternating from round to round, so both see the same load."""
import collections
import statistics
import subprocess
import sys

before, after = sys.argv[1], sys.argv[2]
sizes = sys.argv[3] if len(sys.argv) > 3 else "4M,16M,17M,32M,64M"
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 6
ms = collections.defaultdict(list)
for r in range(rounds):
    order = (("before", before), ("after", after))
    for tag, exe in order if r % 2 == 0 else order[::-1]:
        out = subprocess.run([exe, "--sizes", sizes, "--repeats", "3"], capture_output=True, text=True,
                             check=True).stdout
        for line in out.splitlines():
            f = line.split()
            if f and f[0] in ("adam", "adamw", "sgd_momentum"):
                ms[(f[0], int(f[1]), tag)].append(float(f[3]))
print(f"{'optimizer':14s} {'params':>10s} {'before ms':>10s} {'after ms':>10s} {'after/before':>13s}"
      f"   (medians of {rounds} interleaved runs)")
for name, n, _ in sorted(k for k in ms if k[2] == "before"):
    b, a = statistics.median(ms[(name, n, "before")]), statistics.median(ms[(name, n, "after")])
    print(f"{name:14s} {n:10d} {b:10.2f} {a:10.2f} {a / b:13.2f}")

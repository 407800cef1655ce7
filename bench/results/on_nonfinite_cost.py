#!/usr/bin/env python3
"""Medians of on_nonfinite_cost.sh's step rows, throw_error against ignore.

usage: on_nonfinite_cost.py on_nonfinite_cost.txt

One line per tool, backend, N and trainer: the median step (ms) under each
value, their ratio, and the spread of the ratio of each interleaved pair.
"""

import statistics
import sys

rows = {}
tool = backend = "?"
for line in open(sys.argv[1]):
    if line.startswith("#"):
        if "MLP" in line:
            tool = "ddp_step" if "SGD" in line else "fsdp_step"
            backend = "Mpi" if ", Mpi," in line else "Threads"
        continue
    f = line.split()
    if len(f) < 3 or not f[0].isdigit() or f[-1] not in ("throw_error", "ignore"):
        continue
    trainer = "ReplicatedTrainer" if f[1] == "on" else f[1]
    rows.setdefault((tool, backend, int(f[0]), trainer), {}).setdefault(f[-1], []).append(float(f[2]))
for (t, b, n, trainer), v in rows.items():
    a, c = v.get("throw_error", []), v.get("ignore", [])
    if not a or not c:
        continue
    pairs = [x / y for x, y in zip(a, c)]
    print(f"{t:9} {b:7} N={n} {trainer:17} throw_error {statistics.median(a):7.2f}  ignore {statistics.median(c):7.2f}"
          f"  ratio {statistics.median(a) / statistics.median(c):5.3f}  pairs {min(pairs):.2f}-{max(pairs):.2f}")

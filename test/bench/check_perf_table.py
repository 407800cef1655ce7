#!/usr/bin/env python3
"""Runs a *_perf tool over a tiny size range and checks its output: every
data row parses into the nccl-tests columns, #wrong is 0 in and out of
place (a placement the header declares not measured shows "-"), and the
footer is there. Usage: check_perf_table.py [LAUNCHER...] -- TOOL ARGS..."""
import subprocess
import sys

argv = sys.argv[1:]
cmd = argv[argv.index("--") + 1:] if "--" in argv else argv
launcher = argv[:argv.index("--")] if "--" in argv else []
run = subprocess.run(launcher + cmd, capture_output=True, text=True, timeout=600)
out = run.stdout
print(out)
print(run.stderr, file=sys.stderr)
if run.returncode != 0:
    sys.exit(f"{cmd[0]} exited with {run.returncode}")

# A placement the collective's primitive lacks (broadcast out of place,
# reduce-scatter in place) prints "-" in all four of its columns; allowed only
# where the header says "# <placement>: not measured".
unmeasured = {side for side in ("out-of-place", "in-place") if f"# {side}: not measured" in out}
rows = 0
for line in out.splitlines():
    if not line.strip() or line.startswith("#"):
        continue
    f = line.split()
    # size count type redop root | time algbw busbw #wrong | time algbw busbw #wrong [| predicted]
    if len(f) < 13 or not f[0].isdigit():
        continue
    size, count = int(f[0]), int(f[1])
    if size < 0 or count < 0:
        sys.exit(f"bad row: {line}")
    measured = 0
    for side, first in (("out-of-place", 5), ("in-place", 9)):
        cols = f[first:first + 4]
        if cols == ["-"] * 4 and side in unmeasured:
            continue
        try:
            for c in cols[:3]:
                float(c)
            wrong = int(cols[3])
        except ValueError:
            sys.exit(f"bad row ({side} does not parse and is not declared not measured): {line}")
        if wrong != 0:
            sys.exit(f"bad row ({side} #wrong {cols[3]}): {line}")
        measured += 1
    if measured == 0:
        sys.exit(f"bad row (no placement measured): {line}")
    rows += 1
if rows == 0:
    sys.exit("no data rows parsed")
if "# Avg bus bandwidth" not in out:
    sys.exit("no '# Avg bus bandwidth' footer")
print(f"{rows} rows parsed, #wrong 0 everywhere")

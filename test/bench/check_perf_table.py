#!/usr/bin/env python3
"""Runs a *_perf tool over a tiny size range and checks its output: every
data row parses into the nccl-tests columns, #wrong is 0 in and out of
place, and the footer is there. Usage: check_perf_table.py [LAUNCHER...] -- TOOL ARGS..."""
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

rows = 0
for line in out.splitlines():
    if not line.strip() or line.startswith("#"):
        continue
    f = line.split()
    # size count type redop root | time algbw busbw #wrong | time algbw busbw #wrong [| predicted]
    if len(f) < 13 or not f[0].isdigit():
        continue
    size, count = int(f[0]), int(f[1])
    wrong_out, wrong_in = int(f[8]), int(f[12])
    for col in (5, 6, 7, 9, 10, 11):
        float(f[col])
    if size < 0 or count < 0 or wrong_out or wrong_in:
        sys.exit(f"bad row: {line}")
    rows += 1
if rows == 0:
    sys.exit("no data rows parsed")
if "# Avg bus bandwidth" not in out:
    sys.exit("no '# Avg bus bandwidth' footer")
print(f"{rows} rows parsed, #wrong 0 everywhere")

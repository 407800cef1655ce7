"""What the example tests share: running an example to its exit status, and
finding the line it ends with. Imported by the scripts beside it (Python puts
a script's own folder on its path)."""
import pathlib
import re
import subprocess
import sys


def run(binary, args, expect_rc=0):
    """binary's stdout and stderr, together; exits naming the command and
    showing its output when it exits other than expect_rc."""
    p = subprocess.run([binary] + args, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    if p.returncode != expect_rc:
        sys.exit(f"{pathlib.Path(binary).name} {' '.join(args)} exited {p.returncode}, expected {expect_rc}\n{out}")
    return out


def line_groups(pattern, out, what):
    """The groups of the first line of `out` that `pattern` matches; exits
    showing `out` when none does."""
    m = re.search(pattern, out, re.M)
    if not m:
        sys.exit(f"no {what} line in:\n" + out)
    return m.groups()

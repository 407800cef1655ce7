#!/usr/bin/python3
"""Compile-fail tests: each case must fail to compile with its expected message.

usage: check_compile_fail.py SOURCE_ROOT -- CXX [CXX_ARGS...]

Every test/compile_fail/*.cpp holds a line `// expect: <text>`. Compiled as
is, it must fail and the compiler's output must contain <text>. Compiled with
-DGRADSYNC_CONTROL it must succeed: that proves the failure comes from the
one violation the case is about, not from a typo elsewhere in it.
"""

import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys

FLAGS = ["-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Wpedantic", "-Werror"]


def compile_case(cxx, include_dir, source, extra):
    cmd = cxx + FLAGS + [f"-I{include_dir}"] + extra + [str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def check_case(cxx, include_dir, case):
    """Returns (ok, report line) for one case."""
    match = re.search(r"^// expect: (.+)$", case.read_text(), re.MULTILINE)
    if not match:
        return False, f"FAIL  {case.name}: no '// expect:' line"
    expected = match.group(1).strip()
    rc, out = compile_case(cxx, include_dir, case, ["-DGRADSYNC_CONTROL"])
    if rc != 0:
        return False, f"FAIL  {case.name}: the control build (-DGRADSYNC_CONTROL) does not compile:\n{out}"
    rc, out = compile_case(cxx, include_dir, case, [])
    if rc == 0:
        return False, f"FAIL  {case.name}: compiled, but must not"
    if expected not in out:
        return False, f"FAIL  {case.name}: failed without the expected message '{expected}':\n{out}"
    errors = len(re.findall(r"error:", out))
    return True, f"ok    {case.name}: '{expected}' ({errors} error line(s))"


def main():
    root = pathlib.Path(sys.argv[1])
    cxx = sys.argv[sys.argv.index("--") + 1:]
    include_dir = root / "include"
    cases = sorted((root / "test" / "compile_fail").glob("*.cpp"))
    # One compiler per core, as headers_alone does: meson runs the tests one
    # at a time, so serial compiles here left a core idle for ~40 s of CI.
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda c: check_case(cxx, include_dir, c), cases))
    failed = 0
    for ok, line in results:
        print(line)
        failed += not ok
    print(f"{len(cases) - failed} of {len(cases)} compile-fail cases behave")
    return 1 if failed or not cases else 0


if __name__ == "__main__":
    sys.exit(main())

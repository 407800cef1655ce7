#!/usr/bin/python3
"""Compile-fail tests: each case must fail to compile with its expected message.

usage: check_compile_fail.py SOURCE_ROOT -- CXX [CXX_ARGS...]

Every test/compile_fail/*.cpp holds a line `// expect: <text>`. Compiled as
is, it must fail and the compiler's output must contain <text>. Compiled with
-DGRADSYNC_CONTROL it must succeed: that proves the failure comes from the
one violation the case is about, not from a typo elsewhere in it.

Most of each compile is parsing gradsync.hpp, the same in every case, so
the cases share a precompiled gradsync.hpp (made here, with their flags),
and the controls compile as one translation unit, each case in a namespace
of its own (a case that fails there is then compiled alone, to name it).
That takes the check from 20 compiles of the whole library to 12, most of
them without its parse (75 CPU-s before, on this project's CI machine).
"""

import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys
import tempfile

FLAGS = ["-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Wpedantic", "-Werror"]


def compile_case(cxx, include_dir, source, extra):
    cmd = cxx + FLAGS + [f"-I{include_dir}"] + extra + [str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def expected_message(case):
    match = re.search(r"^// expect: (.+)$", case.read_text(), re.MULTILINE)
    return match.group(1).strip() if match else None


def check_failure(cxx, include_dir, case, pch):
    """Returns (ok, report line) for one case compiled as is."""
    expected = expected_message(case)
    if expected is None:
        return False, f"FAIL  {case.name}: no '// expect:' line"
    rc, out = compile_case(cxx, include_dir, case, pch)
    if rc == 0:
        return False, f"FAIL  {case.name}: compiled, but must not"
    if expected not in out:
        return False, f"FAIL  {case.name}: failed without the expected message '{expected}':\n{out}"
    errors = len(re.findall(r"error:", out))
    return True, f"ok    {case.name}: '{expected}' ({errors} error line(s))"


INCLUDE = re.compile(r"^\s*#\s*include\s*([<\"][^>\"]+[>\"])", re.MULTILINE)


def controls_source(cases):
    """One translation unit holding every case's control build. Each case's
    includes come first, at file scope, so that inside its namespace they
    are already included (each header has #pragma once) and only its own
    declarations remain."""
    includes = []
    for case in cases:
        for inc in INCLUDE.findall(case.read_text()):
            if inc not in includes:
                includes.append(inc)
    lines = ["#define GRADSYNC_CONTROL 1"] + [f"#include {inc}" for inc in includes]
    for i, case in enumerate(cases):
        lines += [f"namespace compile_fail_case_{i} {{", f'#include "{case.resolve()}"', "}"]
    return "\n".join(lines) + "\n"


def check_controls(cxx, include_dir, cases, work, pch):
    """[] if every case's control compiles; else a report line per case whose
    control does not compile alone."""
    unity = work / "controls.cpp"
    unity.write_text(controls_source(cases))
    rc, _ = compile_case(cxx, include_dir, unity, pch + [f"-I{cases[0].parent}"])
    if rc == 0:
        return []
    failures = []
    for case in cases:
        rc, out = compile_case(cxx, include_dir, case, ["-DGRADSYNC_CONTROL"])
        if rc != 0:
            failures.append(f"FAIL  {case.name}: the control build (-DGRADSYNC_CONTROL) does not compile:\n{out}")
    if not failures:
        rc, out = compile_case(cxx, include_dir, unity, [f"-I{cases[0].parent}"])
        failures.append(f"FAIL  the controls compile one by one but not together (a name clash?):\n{out}")
    return failures


def make_pch(cxx, include_dir, work):
    """Flags that include a precompiled gradsync.hpp, or [] if the compiler
    cannot make one (the cases then parse the header themselves)."""
    header = work / "gradsync_pch.hpp"
    header.write_text("#include <gradsync/gradsync.hpp>\n")
    flags = [f for f in FLAGS if f != "-fsyntax-only"]
    cmd = cxx + flags + [f"-I{include_dir}", "-x", "c++-header", str(header), "-o", str(header) + ".gch"]
    if subprocess.run(cmd, capture_output=True, text=True).returncode != 0:
        return []
    return ["-include", str(header)]


def main():
    root = pathlib.Path(sys.argv[1])
    cxx = sys.argv[sys.argv.index("--") + 1:]
    include_dir = root / "include"
    cases = sorted((root / "test" / "compile_fail").glob("*.cpp"))
    if not cases:
        print("FAIL: no test/compile_fail/*.cpp cases")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        pch = make_pch(cxx, include_dir, work)
        # One compiler per core, as headers_alone does: meson runs the tests
        # one at a time.
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            controls = pool.submit(check_controls, cxx, include_dir, cases, work, pch)
            results = list(pool.map(lambda c: check_failure(cxx, include_dir, c, pch), cases))
            control_failures = controls.result()
    failed = 0
    for ok, line in results:
        print(line)
        failed += not ok
    for line in control_failures:
        print(line)
    print(f"{len(cases) - failed} of {len(cases)} compile-fail cases fail as expected; "
          + ("their controls compile" if not control_failures else f"{len(control_failures)} control failure(s)"))
    return 1 if failed or control_failures else 0


if __name__ == "__main__":
    sys.exit(main())

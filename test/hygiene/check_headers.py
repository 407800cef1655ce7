#!/usr/bin/python3
"""Header hygiene checks, run by meson test.

usage: check_headers.py MODE SOURCE_ROOT -- CXX [CXX_ARGS...]

  alone     every public header except the MPI/NCCL backends compiles alone
  mpi       the MPI backend headers compile alone (skipped without MPI)
  torch     the LibTorch integration headers compile alone (skipped without libtorch-dev)
  umbrella  gradsync.hpp includes no MPI, NCCL or CUDA header, even indirectly

Exit 0 pass, 1 fail, 77 skip (meson's convention).
"""

import concurrent.futures
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

SKIP = 77
WARNINGS = ["-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Wpedantic", "-Werror"]
# A path in the umbrella's include tree that names one of these is a leak.
BACKEND_HEADER = re.compile(r"(^|/)(mpi\.h|mpi\.hpp|mpicxx\.h|nccl\.h|nccl_net\.h)$|cuda|(^|/)torch/torch\.h$",
                            re.IGNORECASE)
# Debian's libtorch-dev: the C++ frontend's headers live below this, the rest under /usr/include.
TORCH_API_INCLUDE = pathlib.Path("/usr/include/torch/csrc/api/include")


def public_headers(include_dir):
    root = include_dir / "gradsync"
    return sorted(p.relative_to(include_dir).as_posix() for p in root.rglob("*.hpp"))


# The LibTorch integration's one CUDA header: it includes the Nccl backend
# and no torch, so it is checked with the NCCL headers, not the torch ones.
TORCH_NCCL_HEADER = "gradsync/integration/torch/nccl_device_communicator.hpp"


def is_backend(header, name):
    if name == "torch":
        return header.startswith("gradsync/integration/torch") and header != TORCH_NCCL_HEADER
    if name == "nccl" and header == TORCH_NCCL_HEADER:
        return True
    return header.startswith(f"gradsync/backend/{name}")


def compile_alone(cxx, include_dir, header, extra_flags):
    source = f"#include <{header}>\n"
    cmd = cxx + WARNINGS + [f"-I{include_dir}"] + extra_flags + ["-x", "c++", "-"]
    proc = subprocess.run(cmd, input=source, capture_output=True, text=True)
    return header, proc.returncode, proc.stdout + proc.stderr


INCLUDE_LINE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]\s*(//.*)?$')


def umbrella_includes(include_dir, header):
    """What `header` includes, if it is nothing but #pragma once, #include lines
    and comments (an umbrella such as gradsync.hpp); None otherwise."""
    included, in_comment = [], False
    for line in (include_dir / header).read_text().splitlines():
        text = line.strip()
        if in_comment:
            in_comment = "*/" not in text
            continue
        if not text or text.startswith("//") or text == "#pragma once":
            continue
        if text.startswith("/*"):
            in_comment = "*/" not in text
            continue
        match = INCLUDE_LINE.match(text)
        if not match:
            return None
        included.append(match.group(1))
    return included


def split_umbrellas(include_dir, headers):
    """Headers to compile, and the umbrellas among `headers` that need not be:
    an umbrella whose gradsync includes are all compiled alone in this run
    (its other includes being system or library headers) compiles alone too,
    and every translation unit that includes it checks that its parts agree.
    Each of them parses in seconds (gradsync/integration/torch.hpp: 12 s,
    most of the torch run's CPU), so skipping them is worth the rule."""
    checked, umbrellas = set(headers), []
    for h in headers:
        included = umbrella_includes(include_dir, h)
        if included and all(i in checked for i in included if i.startswith("gradsync/")):
            umbrellas.append(h)
    return [h for h in headers if h not in umbrellas], umbrellas


def run_alone(cxx, include_dir, headers, extra_flags=()):
    headers, umbrellas = split_umbrellas(include_dir, headers)
    for h in umbrellas:
        print(f"umbrella {h}: only #include lines, each of a header compiled alone here or of a system header")
    failed = []
    workers = os.cpu_count() or 1
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        jobs = [pool.submit(compile_alone, cxx, include_dir, h, list(extra_flags)) for h in headers]
        for job in jobs:
            header, rc, output = job.result()
            if rc == 0:
                print(f"ok    {header}")
            else:
                print(f"FAIL  {header}\n{output}")
                failed.append(header)
    print(f"{len(headers) - len(failed)} of {len(headers)} headers compile alone"
          + (f"; {len(umbrellas)} umbrella(s) made of them" if umbrellas else ""))
    return 1 if failed else 0


def mpi_flags():
    """Include flags for MPI, as -isystem so its own warnings don't trip -Werror."""
    flags = None
    pkg_config = shutil.which("pkg-config")
    if pkg_config:
        for module in ("ompi-cxx", "mpi-cxx", "ompi", "mpi"):
            proc = subprocess.run([pkg_config, "--cflags", module], capture_output=True, text=True)
            if proc.returncode == 0:
                flags = shlex.split(proc.stdout)
                print(f"MPI include flags from pkg-config {module}: {' '.join(flags) or '(none)'}")
                break
    if flags is None:
        mpicxx = shutil.which("mpicxx")
        if mpicxx:
            proc = subprocess.run([mpicxx, "--showme:compile"], capture_output=True, text=True)
            if proc.returncode == 0:
                flags = shlex.split(proc.stdout)
                print(f"MPI include flags from mpicxx --showme:compile: {' '.join(flags) or '(none)'}")
    if flags is None:
        return None
    out = []
    for flag in flags:
        if flag.startswith("-I"):
            out += ["-isystem", flag[2:]]
        elif flag != "-pthread":
            out.append(flag)
    return out


def mode_alone(cxx, include_dir):
    headers = public_headers(include_dir)
    if not headers:
        print("SKIP: no headers under include/gradsync yet")
        return SKIP
    for name, why in (("mpi", "checked by headers_alone_mpi"),
                      ("nccl", "need CUDA and NCCL; checked on a GPU machine"),
                      ("torch", "checked by headers_alone_torch")):
        skipped = [h for h in headers if is_backend(h, name)]
        if skipped:
            print(f"not here: {len(skipped)} {name} headers ({why})")
    headers = [h for h in headers if not any(is_backend(h, n) for n in ("mpi", "nccl", "torch"))]
    return run_alone(cxx, include_dir, headers)


def mode_mpi(cxx, include_dir):
    headers = [h for h in public_headers(include_dir) if is_backend(h, "mpi")]
    if not headers:
        print("SKIP: no gradsync/backend/mpi* headers yet")
        return SKIP
    flags = mpi_flags()
    if flags is None:
        print("SKIP: no MPI found (no pkg-config ompi-cxx/mpi-cxx/ompi/mpi, no mpicxx); "
              "install libopenmpi-dev to check the MPI backend headers")
        return SKIP
    return run_alone(cxx, include_dir, headers, flags)


def mode_torch(cxx, include_dir):
    headers = [h for h in public_headers(include_dir) if is_backend(h, "torch")]
    if not headers:
        print("SKIP: no gradsync/integration/torch* headers yet")
        return SKIP
    if not (TORCH_API_INCLUDE / "torch" / "torch.h").is_file():
        print(f"SKIP: no {TORCH_API_INCLUDE}/torch/torch.h; install libtorch-dev to check the LibTorch headers")
        return SKIP
    return run_alone(cxx, include_dir, headers, ["-isystem", str(TORCH_API_INCLUDE)])


def mode_umbrella(cxx, include_dir):
    umbrella = include_dir / "gradsync" / "gradsync.hpp"
    if not umbrella.is_file():
        print("SKIP: include/gradsync/gradsync.hpp does not exist yet")
        return SKIP
    # -H lists every header opened, one per line, prefixed with dots for depth.
    cmd = cxx + ["-std=c++20", "-E", "-H", f"-I{include_dir}", "-x", "c++", str(umbrella), "-o", os.devnull]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"FAIL: preprocessing gradsync.hpp failed:\n{proc.stderr}")
        return 1
    included = [line.lstrip(".").strip() for line in proc.stderr.splitlines()
                if re.match(r"^\.+ ", line)]
    if not included:
        print(f"FAIL: {' '.join(cmd)} printed no include tree; is this compiler's -H supported?")
        return 1
    leaks = [path for path in included if BACKEND_HEADER.search(path)]
    print(f"gradsync.hpp opens {len(included)} headers")
    for path in leaks:
        print(f"FAIL: gradsync.hpp includes {path}; only an opt-in backend header may")
    return 1 if leaks else 0


def main(argv):
    if len(argv) < 5 or argv[3] != "--":
        print(__doc__)
        return 2
    mode, source_root, cxx = argv[1], pathlib.Path(argv[2]), argv[4:]
    include_dir = (source_root / "include").resolve()
    modes = {"alone": mode_alone, "mpi": mode_mpi, "torch": mode_torch, "umbrella": mode_umbrella}
    if mode not in modes:
        print(f"unknown mode {mode!r}; expected one of {', '.join(modes)}")
        return 2
    return modes[mode](cxx, include_dir)


if __name__ == "__main__":
    sys.exit(main(sys.argv))

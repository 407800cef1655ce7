#!/usr/bin/python3
"""Header hygiene checks, run by meson test.

usage: check_headers.py MODE SOURCE_ROOT -- CXX [CXX_ARGS...]

  alone     every public header except the MPI/NCCL backends compiles alone
  mpi       the MPI backend headers compile alone (skipped without MPI)
  torch     the LibTorch integration headers compile alone (skipped without libtorch-dev)
  umbrella  gradsync.hpp and collectives.hpp include no MPI, NCCL or CUDA
            header, even indirectly, and collectives.hpp no trainer header

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
import tempfile

SKIP = 77
WARNINGS = ["-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Wpedantic", "-Werror"]
# A path in the umbrella's include tree that names one of these is a leak.
BACKEND_HEADER = re.compile(r"(^|/)(mpi\.h|mpi\.hpp|mpicxx\.h|nccl\.h|nccl_net\.h)$|cuda|(^|/)torch/torch\.h$",
                            re.IGNORECASE)
# What collectives.hpp promises to leave out besides: the trainers and what only they use.
TRAINER_HEADER = re.compile(r"(^|/)gradsync/(train/|core/host_offload_space\.hpp$)")
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


def compile_alone(cxx, include_dir, header, extra_flags, base=None):
    """Compiles `header` as the only line of a translation unit; with `base`
    (a base header's precompiled form, see BaseHeaders), that base first."""
    source = f"#include <{header}>\n"
    prefix = ["-include", str(base)] if base else []
    cmd = cxx + WARNINGS + [f"-I{include_dir}"] + extra_flags + prefix + ["-x", "c++", "-"]
    proc = subprocess.run(cmd, input=source, capture_output=True, text=True)
    return header, proc.returncode, proc.stdout + proc.stderr


class BaseHeaders:
    """Most of a header's compile is parsing what it includes, and many
    headers include the same few gradsync headers (a collective, the Threads
    backend) and, through them, much of the standard library. A few such
    base headers are precompiled once here, and a header that includes base
    B, directly or through others, is compiled with B's precompiled form
    first. That checks the same thing as compiling it alone: B and all that B
    includes are among what the header includes anyway, and its own code
    comes after its includes (a header with code before an #include is
    compiled without a base), so its code sees the same declarations in both
    cases. Includes inside #if blocks are not counted as included.
    A base's precompile is its check: that is the header compiled alone, with
    the same warnings and -Werror, written out instead of thrown away (a base
    that fails to precompile is then compiled alone, to report why)."""

    CONDITIONAL = re.compile(r"^\s*#\s*(if|ifdef|ifndef)\b")
    ENDIF = re.compile(r"^\s*#\s*endif\b")
    DIRECTIVE = re.compile(r"^\s*#")
    INCLUDE = re.compile(r"^\s*#\s*include\s*[<\"]([^>\"]+)[>\"]")
    # GCC reads a precompiled header in whole (the LibTorch base, 409 MB, in
    # 2.5 s for each header after it), so a base must spare more than twice
    # its own parse. Clang reads one lazily (a header after a base: 0.3 s
    # against 2.0 s alone), so there a base that spares half its parse repays
    # it, and more of them do: headers_alone 110 -> 101 CPU-s (docs/CI.md).
    RULES = {False: (10, 2.0), True: (30, 0.5)}

    def __init__(self, include_dir, headers, lazy_load=False):
        self.count, self.repay = self.RULES[lazy_load]
        self.include_dir = include_dir
        self._direct = {}
        self.closure = {h: self._closure(h) for h in headers}
        self.code_first = {h for h in headers if self._scan(h)[1]}
        self.bases = self._choose(headers)

    def _scan(self, header):
        """(unconditional includes, whether code precedes an #include)."""
        if header in self._direct:
            return self._direct[header]
        depth, includes, seen_code, code_first, in_comment = 0, [], False, False, False
        for line in (self.include_dir / header).read_text().splitlines():
            text = line.strip()
            if in_comment:
                in_comment = "*/" not in text
                continue
            if not text or text.startswith("//"):
                continue
            if text.startswith("/*"):
                in_comment = "*/" not in text
                continue
            if self.CONDITIONAL.match(text):
                depth += 1
            elif self.ENDIF.match(text):
                depth -= 1
            elif (m := self.INCLUDE.match(text)):
                code_first = code_first or seen_code
                if depth == 0:
                    includes.append(m.group(1))
            elif not self.DIRECTIVE.match(text):
                seen_code = True
        self._direct[header] = (includes, code_first)
        return self._direct[header]

    def _closure(self, header):
        seen, todo = set(), [header]
        while todo:
            for name in self._scan(todo.pop())[0]:
                if name not in seen:
                    seen.add(name)
                    if name.startswith("gradsync/") and (self.include_dir / name).is_file():
                        todo.append(name)
        return seen

    # A LibTorch header opened from outside (torch/, ATen/, c10/) brings in
    # hundreds more: parsing <torch/nn/module.h> alone takes about as long as
    # fifty of gradsync's headers.
    HEAVY = ("torch/", "ATen/", "c10/")
    HEAVY_WEIGHT = 50

    def size(self, header):
        """What parsing `header`'s includes costs, in gradsync headers' worth."""
        return sum(self.HEAVY_WEIGHT if n.startswith(self.HEAVY) else 1 for n in self.closure[header])

    def _choose(self, headers):
        """Greedily, the bases that spare the most parsing, counted as the
        weight of the headers a base brings in (size()), summed over its
        users; a base must spare more than `repay` times what precompiling it
        costs (its own parse), since loading its precompiled form costs each
        user too (RULES)."""
        users = [h for h in headers if h not in self.code_first]
        best, bases = {h: 0 for h in users}, []
        for _ in range(self.count):
            def gain(b):
                size = self.size(b)
                return sum(max(0, size - best[h]) for h in users if b in self.closure[h])
            candidates = [b for b in headers if b not in bases and b in self.closure]
            if not candidates:
                break
            pick = max(candidates, key=gain)
            if gain(pick) <= self.repay * self.size(pick):
                break
            bases.append(pick)
            for h in users:
                if pick in self.closure[h]:
                    best[h] = max(best[h], self.size(pick))
        return bases

    def base_for(self, header, built):
        """The built base with the largest closure that `header` includes, or None."""
        if header in self.code_first:
            return None
        fits = [b for b in built if b in self.closure[header]]
        return max(fits, key=self.size, default=None)


def precompile(cxx, include_dir, base, extra_flags, work):
    """The precompiled form of `base` in `work`; None if it does not build
    (its own compile, alone, then reports why)."""
    stub = work / (base.replace("/", "_") + ".hpp")
    stub.write_text(f"#include <{base}>\n")
    flags = [f for f in WARNINGS if f != "-fsyntax-only"]
    cmd = cxx + flags + [f"-I{include_dir}"] + extra_flags + ["-x", "c++-header", str(stub), "-o", f"{stub}.gch"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return (base, stub) if proc.returncode == 0 else (base, None)


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
    extra_flags = list(extra_flags)
    index = BaseHeaders(include_dir, headers, lazy_load="clang" in pathlib.Path(cxx[0]).name)
    failed = []
    workers = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        # The headers that include no base compile beside the bases'
        # precompiles (one LibTorch base parses for as long as a dozen small
        # headers take); the others wait for their base.
        precompiles = [pool.submit(precompile, cxx, include_dir, b, extra_flags, pathlib.Path(tmp)) for b in index.bases]
        jobs = [pool.submit(compile_alone, cxx, include_dir, h, extra_flags)
                for h in headers if h not in index.bases and index.base_for(h, index.bases) is None]
        built = dict(job.result() for job in precompiles)
        built = {b: stub for b, stub in built.items() if stub}
        for h in headers:
            if h in built or (h not in index.bases and index.base_for(h, index.bases) is None):
                continue
            base = index.base_for(h, built)
            jobs.append(pool.submit(compile_alone, cxx, include_dir, h, extra_flags, built[base] if base else None))
        for h in built:
            print(f"ok    {h} (precompiled alone)")
        for job in jobs:
            header, rc, output = job.result()
            if rc == 0:
                print(f"ok    {header}")
            else:
                print(f"FAIL  {header}\n{output}")
                failed.append(header)
    with_base = sum(1 for h in headers if h not in built and index.base_for(h, built))
    print(f"{len(headers) - len(failed)} of {len(headers)} headers compile alone"
          + (f"; {len(umbrellas)} umbrella(s) made of them" if umbrellas else "")
          + f"; {with_base} of them after one of {len(built)} precompiled base headers they include")
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


def include_tree(cxx, include_dir, header):
    """Every header that preprocessing `header` opens, or None (after saying why)."""
    # -H lists every header opened, one per line, prefixed with dots for depth.
    cmd = cxx + ["-std=c++20", "-E", "-H", f"-I{include_dir}", "-x", "c++", str(include_dir / header), "-o", os.devnull]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"FAIL: preprocessing {header} failed:\n{proc.stderr}")
        return None
    included = [line.lstrip(".").strip() for line in proc.stderr.splitlines()
                if re.match(r"^\.+ ", line)]
    if not included:
        print(f"FAIL: {' '.join(cmd)} printed no include tree; is this compiler's -H supported?")
        return None
    return included


def mode_umbrella(cxx, include_dir):
    # Each umbrella, and what it must never open: (pattern, what the pattern names).
    rules = {
        "gradsync/gradsync.hpp": [(BACKEND_HEADER, "only an opt-in backend header may")],
        "gradsync/collectives.hpp": [(BACKEND_HEADER, "only an opt-in backend header may"),
                                     (TRAINER_HEADER, "the trainers are gradsync.hpp's")],
    }
    failed = False
    for header, forbidden in rules.items():
        if not (include_dir / header).is_file():
            print(f"FAIL: include/{header} does not exist")
            failed = True
            continue
        included = include_tree(cxx, include_dir, header)
        if included is None:
            failed = True
            continue
        print(f"{header} opens {len(included)} headers")
        for pattern, why in forbidden:
            for path in included:
                if pattern.search(path):
                    print(f"FAIL: {header} includes {path}; {why}")
                    failed = True
    return 1 if failed else 0


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

#!/usr/bin/env python3
"""Every public name is in docs/DESIGN.md's "Public API" list.

usage: check_public_api.py SOURCE_ROOT -- CLANG++ [ARGS...]

The public API is every name declared directly in `namespace gradsync` (or
`gradsync::checkpoint`) outside `detail`, by a header under include/gradsync.
Clang lists them from its syntax tree (`-ast-dump` of the namespace), so a
name is found however it is spelled; a regex over the headers would miss
some and invent others. The headers parsed are the umbrella and the opt-in
host headers (checkpoints, the checkpoint file layer); the MPI, NCCL and
LibTorch headers need their own include paths or a compiler that can parse
them (Clang 14 cannot parse LibTorch 1.13 as C++20), and their names are
checked by hand.

A name missing from the list fails the test, naming the header and line,
so a new public name has to be documented (or moved into `detail`).
Exit 0 pass, 1 fail, 77 skip (no clang++).
"""

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SKIP = 77
HEADERS = [
    "gradsync/gradsync.hpp",
    "gradsync/train/checkpoint/replicated_checkpoint.hpp",
    "gradsync/train/checkpoint/sharded_checkpoint.hpp",
    "gradsync/train/checkpoint/async_checkpointer.hpp",
    "gradsync/checkpoint/safetensors_reader.hpp",
    "gradsync/checkpoint/safetensors_writer.hpp",
    "gradsync/checkpoint/shard_writer.hpp",
    "gradsync/checkpoint/shard_index.hpp",
    "gradsync/checkpoint/atomic_file.hpp",
    "gradsync/checkpoint/commit_record.hpp",
    "gradsync/checkpoint/crc32.hpp",
    "gradsync/core/host_offload_space.hpp",
]
# A declaration line directly under a namespace node: "|-Kind 0x... <range> line:col ..."
DECL = re.compile(r"^[|`]-(\w+)Decl 0x[0-9a-f]+ (?:parent 0x[0-9a-f]+ )?(?:prev 0x[0-9a-f]+ )?<([^>]*)>(.*)$")
# Kinds whose name is the last identifier before the type ('...') or the end.
NAMED = {"CXXRecord", "ClassTemplate", "Concept", "Enum", "Function", "FunctionTemplate", "Var",
         "VarTemplate", "TypeAlias", "TypeAliasTemplate", "Typedef"}


def public_names(cxx, include_dir):
    """{name: "header:line"} for every declaration directly in the public namespaces."""
    headers = [h for h in HEADERS if (include_dir / h).is_file()]
    with tempfile.TemporaryDirectory() as tmp:
        tu = Path(tmp, "public_api.cpp")
        tu.write_text("".join(f"#include <{h}>\n" for h in headers))
        cmd = cxx + ["-std=c++20", "-fsized-deallocation", "-fsyntax-only", "-fno-color-diagnostics",
                     "-I", str(include_dir), "-Xclang", "-ast-dump", "-Xclang", "-ast-dump-filter",
                     "-Xclang", "gradsync", str(tu)]
        out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print("clang++ could not parse the headers:\n" + out.stderr[-4000:])
        return None
    names = {}
    in_public = False
    header = ""  # the file of the namespace block being read
    for line in out.stdout.splitlines():
        if line.startswith("Dumping "):
            # "Dumping gradsync:" or "Dumping gradsync::checkpoint:" is a whole namespace block.
            in_public = line in ("Dumping gradsync:", "Dumping gradsync::checkpoint:")
            header = ""
            continue
        if not in_public:
            continue
        if line.startswith("NamespaceDecl "):  # the block's root: "<file:line:col, ...>"
            f = re.search(r"<([^:<>]+\.hpp):", line)
            header = f.group(1) if f else ""
            continue
        m = DECL.match(line)
        if not m or m.group(1) not in NAMED or "include/gradsync/" not in header:
            continue
        ln = re.match(r"line:(\d+)", m.group(2))
        loc = header[header.find("include/gradsync/"):] + (f":{ln.group(1)}" if ln else "")
        rest = re.sub(r"'[^']*'(:'[^']*')?", "'", m.group(3))  # types may hold anything
        words = re.findall(r"[A-Za-z_]\w*|'", rest)
        if "'" in words:
            words = words[:words.index("'")]
        words = [w for w in words if w not in ("line", "col", "implicit", "referenced", "used", "struct",
                                               "class", "union", "definition", "constexpr", "inline",
                                               "static", "cinit", "callinit", "invalid", "sloc")]
        if words:
            names.setdefault(words[-1], loc)
    return names


def listed_names(design):
    """Identifiers inside `code spans` of DESIGN.md's "## Public API" section."""
    text = design.read_text()
    start = text.find("\n## Public API")
    if start < 0:
        return None
    end = text.find("\n## ", start + 1)
    section = text[start:end if end > 0 else len(text)]
    spans = re.findall(r"`([^`]+)`", section)
    return {w for s in spans for w in re.findall(r"[A-Za-z_]\w*", s)}


def main(argv):
    if "--" not in argv:
        print(__doc__)
        return 1
    sep = argv.index("--")
    root = Path(argv[1])
    cxx = argv[sep + 1:] or ["clang++"]
    if shutil.which(cxx[0]) is None:
        print(f"SKIP: no {cxx[0]}")
        return SKIP
    names = public_names(cxx, root / "include")
    if names is None:
        return 1
    listed = listed_names(root / "docs" / "DESIGN.md")
    if listed is None:
        print("docs/DESIGN.md has no '## Public API' section")
        return 1
    missing = sorted((n, where) for n, where in names.items() if n not in listed and not n.startswith("operator"))
    print(f"{len(names)} public names found in {len(HEADERS)} headers; {len(names) - len(missing)} listed")
    for n, where in missing:
        print(f"not in docs/DESIGN.md's Public API: {n} ({where})")
    if len(names) < 50:
        print("fewer than 50 public names: the syntax tree was not read as expected")
        return 1
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

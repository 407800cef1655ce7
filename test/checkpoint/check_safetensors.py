#!/usr/bin/python3
"""Python's safetensors package reads a file gradsync wrote.

usage: check_safetensors.py WORKDIR -- WRITER...

Runs `WRITER sample FILE SIDECAR` (checkpoint_writer.cpp), loads FILE with
safetensors.numpy.load_file and compares every tensor's dtype, shape and
values with the sidecar JSON, and each tensor's bytes with the CRC-32 that
gradsync stored in __metadata__ (zlib.crc32). Then the other way: a file
saved by safetensors.numpy.save_file is read by `WRITER read`. Runs under the interpreter in
GRADSYNC_PYTHON (default /usr/bin/python3; tools/python-venv makes one) and
exits 77 (skip) when that interpreter cannot import safetensors and numpy.
"""

import json
import os
import shutil
import subprocess
import sys
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from gradsync_python import under_gradsync_python  # noqa: E402
from helper_command import split_command  # noqa: E402

NUMPY_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
    "U8": "uint8", "BOOL": "bool",
}


def main():
    skip = under_gradsync_python(__file__, "; make a venv with tools/python-venv and set GRADSYNC_PYTHON to its python")
    if skip:
        return skip
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file

    (work,), writer = split_command(sys.argv)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    path, sidecar = os.path.join(work, "sample.safetensors"), os.path.join(work, "sample.json")
    subprocess.run(writer + ["sample", path, sidecar], check=True)
    with open(sidecar) as f:
        expected = json.load(f)

    tensors = load_file(path)
    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata()
    failures = []
    if set(tensors) != set(expected):
        failures.append(f"names differ: file {sorted(tensors)}, sidecar {sorted(expected)}")
    for name, want in expected.items():
        got = tensors.get(name)
        if got is None:
            continue
        if got.dtype != np.dtype(NUMPY_DTYPES[want["dtype"]]):
            failures.append(f"{name}: dtype {got.dtype}, expected {want['dtype']}")
        if list(got.shape) != want["shape"]:
            failures.append(f"{name}: shape {list(got.shape)}, expected {want['shape']}")
        values = np.array(want["values"], dtype=np.float64).reshape(want["shape"])
        if want["dtype"] in ("I64", "U64"):
            # Compare 64-bit integers exactly, not through float64.
            ok = np.array_equal(got, np.array(want["values"], dtype=got.dtype).reshape(want["shape"]))
        else:
            ok = np.array_equal(got.astype(np.float64), values)
        if not ok:
            failures.append(f"{name}: values {got.ravel().tolist()}, expected {want['values']}")
        stored = metadata.get(f"gradsync.crc32:{name}")
        crc = f"{zlib.crc32(np.ascontiguousarray(got).tobytes()) & 0xFFFFFFFF:08x}"
        if stored != crc:
            failures.append(f"{name}: zlib.crc32 of its bytes is {crc}, __metadata__ says {stored}")
    if metadata.get("producer") != "gradsync checkpoint_writer":
        failures.append(f"user metadata lost: {metadata}")

    # The other way: gradsync reads what Python wrote (no gradsync checksums there).
    from safetensors.numpy import save_file
    theirs = {name: np.ascontiguousarray(a) for name, a in tensors.items()}
    theirs_path = os.path.join(work, "from_python.safetensors")
    save_file(theirs, theirs_path, metadata={"from": "python"})
    out = subprocess.run(writer + ["read", theirs_path], capture_output=True, text=True)
    if out.returncode != 0:
        failures.append(f"gradsync cannot read a file safetensors wrote: {out.stderr.strip()}")
    else:
        seen = {}
        for line in out.stdout.splitlines():
            name, dtype, rest = line.split(" ", 2)
            shape, crc = rest.rsplit(" ", 1)
            seen[name] = (dtype, shape, crc)
        for name, a in theirs.items():
            want = (expected[name]["dtype"], "[" + ", ".join(str(d) for d in a.shape) + "]",
                    f"{zlib.crc32(a.tobytes()) & 0xFFFFFFFF:08x}")
            if seen.get(name) != want:
                failures.append(f"gradsync read {name} from Python's file as {seen.get(name)}, expected {want}")
    for f in failures:
        print("FAIL", f)
    if failures:
        return 1
    shutil.rmtree(work, ignore_errors=True)
    print(f"PASS: {len(expected)} tensors read by safetensors {__import__('safetensors').__version__} "
          f"and numpy {np.__version__} under {sys.executable}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

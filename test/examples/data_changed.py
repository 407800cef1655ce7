#!/usr/bin/env python3
"""A run saved on IDX data in a directory, resumed after that directory's
labels were replaced by others of the same count: refused on resume (exit 2,
naming the data's checksum), where training on would go on from a model of
other data without a word. With the files as they were, it resumes.

usage: data_changed.py BINARY WORKDIR [options...]
"""
import pathlib
import random
import shutil
import struct
import sys

from example_run import run


def write_split(directory, split, count, rng):
    images = struct.pack(">IIII", 0x803, count, 28, 28) + bytes(rng.randrange(256) for _ in range(count * 784))
    labels = struct.pack(">II", 0x801, count) + bytes(rng.randrange(10) for _ in range(count))
    (directory / f"{split}-images-idx3-ubyte").write_bytes(images)
    (directory / f"{split}-labels-idx1-ubyte").write_bytes(labels)


def main():
    binary, work = sys.argv[1], pathlib.Path(sys.argv[2])
    options = sys.argv[3:]
    shutil.rmtree(work, ignore_errors=True)
    data = work / "data"
    data.mkdir(parents=True)
    rng = random.Random(5)
    write_split(data, "train", 256, rng)
    write_split(data, "t10k", 64, rng)
    common = options + ["--data", str(data), "--batch", "16", "--target", "0"]
    run(binary, common + ["--epochs", "1", "--save", str(work / "saved")])
    run(binary, common + ["--epochs", "2", "--resume", str(work / "saved")])
    labels = data / "train-labels-idx1-ubyte"
    old = labels.read_bytes()
    labels.write_bytes(old[:8] + bytes((b + 1) % 10 for b in old[8:]))
    out = run(binary, common + ["--epochs", "2", "--resume", str(work / "saved")], expect_rc=2)
    if "data_values" not in out or "resume with the same data" not in out:
        sys.exit("resumed on changed labels, it was not refused naming the data's values:\n" + out)
    shutil.rmtree(work)
    print("ok")


main()

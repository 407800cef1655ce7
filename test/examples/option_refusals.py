#!/usr/bin/env python3
"""A trainer example refuses option values that would otherwise read as
something else, before training, with exit 2 and the option named: an empty
value (`--resume "$DIR"` with DIR unset read as no --resume), a value that is
not finite (a NaN --warmup held the learning rate near 0), and a count
written with a sign after a space (" -5" read as 2^64 - 5). `--help` prints
the usage and exits 0.

usage: option_refusals.py BINARY [options...]
"""
import sys

from example_run import run

CASES = [
    (["--resume", ""], "--resume needs a value, got an empty one"),
    (["--save", ""], "--save needs a value, got an empty one"),
    (["--data", ""], "--data needs a value, got an empty one"),
    (["--metrics", ""], "--metrics needs a value, got an empty one"),
    (["--warmup", "nan"], "bad value for --warmup: 'nan'"),
    (["--lr", "inf"], "bad value for --lr: 'inf'"),
    (["--target", "nan"], "bad value for --target: 'nan'"),
    (["--train-samples", " -5"], "bad value for --train-samples: ' -5'"),
]


def main():
    binary, options = sys.argv[1], sys.argv[2:]
    # --help: the usage, every option the program takes, exit 0, no training.
    usage = run(binary, ["--help"], expect_rc=0)
    for option in ("--backend", "--ranks", "--epochs", "--lr", "--save", "--resume", "--data", "--dataset"):
        if option not in usage or "epoch 1" in usage:
            sys.exit(f"--help: no line for {option}, or training ran:\n{usage}")
    for case, says in CASES:
        out = run(binary, options + case, expect_rc=2)
        if says not in out or "epoch 1" in out:
            sys.exit(f"{' '.join(repr(c) for c in case)}: no '{says}' before training:\n{out}")
    print("ok")


main()

#!/usr/bin/env python3
"""An example refuses what it cannot do: it exits with RC before training and
says why in words that contain TEXT (any other exit, a crash included, fails).

usage: expect_refusal.py RC TEXT BINARY [options...]
"""
import subprocess
import sys


def main():
    rc, text, binary, args = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    p = subprocess.run([binary] + args, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    print(out[-2000:])
    if p.returncode != rc:
        print(f"exited {p.returncode}, expected {rc}")
        return 1
    if text not in out:
        print(f"the output does not say '{text}'")
        return 1
    if "epoch 1" in out:
        print("it trained before refusing")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

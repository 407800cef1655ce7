"""The main example's recipe on Fashion-MNIST, one epoch on 4 ranks: it reaches
its stated accuracy less a margin, and prints the walkthrough of how the data,
the batch and the learning rate follow from the world size. Skipped (exit 77)
only where Debian's dataset-fashion-mnist is not installed.

    fashion_mnist_accuracy.py BINARY TARGET
"""

import pathlib
import subprocess
import sys

DATA = pathlib.Path("/usr/share/datasets/fashion-mnist")
FILES = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
         "t10k-labels-idx1-ubyte.gz"]

# What the seed scenario prints: 60,000 samples as 4 shards of 15,000, batch 64
# per rank and 256 per step, the learning rate 0.03 at batch 64 scaled to 0.12.
WALKTHROUGH = [
    "on Fashion-MNIST (60000 train / 10000 test)",
    "4 ranks x 15000 samples",
    "batch 64 per rank, 256 per step",
    "learning rate 0.03 at batch 64, scaled linearly to 0.12 at batch 256",
]


def main():
    binary, target = sys.argv[1], sys.argv[2]
    missing = [f for f in FILES if not (DATA / f).is_file()]
    if missing:
        print(f"SKIP: Fashion-MNIST is not installed ({DATA}: no {', '.join(missing)}); "
              "apt-get install dataset-fashion-mnist")
        return 77
    run = subprocess.run([binary, "--dataset", "fashion-mnist", "--ranks", "4", "--epochs", "1", "--target", target],
                         capture_output=True, text=True, timeout=240)
    print(run.stdout, end="")
    print(run.stderr, end="", file=sys.stderr)
    absent = [line for line in WALKTHROUGH if line not in run.stdout]
    if absent:
        print(f"FAIL: the walkthrough lacks {absent}")
        return 1
    if run.returncode != 0:
        print(f"FAIL: {binary} exited {run.returncode} (its last line says why)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

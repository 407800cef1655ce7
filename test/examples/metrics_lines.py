"""A tiny run of a trainer example with --metrics writes one JSON line per
epoch and one per --metrics-every steps, each with every field, its numbers
consistent with the run; with --plot, tools/plot-training draws them into a
PNG (skipped, exit 77, where matplotlib is not installed).

    metrics_lines.py BINARY WORKDIR [--plot] OPTIONS...
"""

import json
import math
import pathlib
import shutil
import subprocess
import sys

FIELDS = {"kind", "epoch", "step", "samples", "loss", "train_acc", "test_acc", "seconds", "samples_per_s", "ranks",
          "batch", "lr"}


def check(lines, epochs, every):
    kinds = [l["kind"] for l in lines]
    if kinds.count("epoch") != epochs:
        sys.exit(f"{kinds.count('epoch')} epoch lines, expected {epochs}")
    steps = [l for l in lines if l["kind"] == "step"]
    if not steps:
        sys.exit("no step lines")
    for l in lines:
        if set(l) != FIELDS:
            sys.exit(f"fields {sorted(l)}, expected {sorted(FIELDS)}")
        if l["kind"] not in ("epoch", "step"):
            sys.exit(f"kind {l['kind']!r}")
        if not (0 <= l["train_acc"] <= 1 and math.isfinite(l["loss"]) and l["seconds"] > 0 and l["lr"] > 0):
            sys.exit(f"implausible figures: {l}")
        if l["kind"] == "epoch" and not 0 <= l["test_acc"] <= 1:
            sys.exit(f"an epoch line without a test accuracy: {l}")
        if l["kind"] == "step" and (l["test_acc"] is not None or l["step"] % every):
            sys.exit(f"a step line with a test accuracy, or off --metrics-every {every}: {l}")
    seen = [l["samples"] for l in lines]
    if seen != sorted(seen) or [l["step"] for l in lines] != sorted(l["step"] for l in lines):
        sys.exit("samples seen and steps do not grow line by line")


def main():
    binary, work = sys.argv[1], pathlib.Path(sys.argv[2])
    options = sys.argv[3:]
    plot = "--plot" in options
    if plot:
        options.remove("--plot")
        try:
            import matplotlib  # noqa: F401  (only whether it is there)
        except ImportError:
            print("SKIP: matplotlib is not installed (Debian: python3-matplotlib); tools/plot-training needs it")
            sys.exit(77)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    metrics = work / "run.jsonl"
    every = 5
    run = subprocess.run([binary] + options + ["--epochs", "2", "--metrics", str(metrics), "--metrics-every", str(every)],
                         capture_output=True, text=True, timeout=300)
    print(run.stdout, run.stderr)
    if run.returncode != 0:
        sys.exit(f"exit {run.returncode}")
    if "\r" in run.stdout:
        sys.exit("a progress line went to a pipe")
    lines = [json.loads(t) for t in metrics.read_text().splitlines()]
    check(lines, 2, every)
    if plot:
        png = work / "plot.png"
        tool = pathlib.Path(__file__).resolve().parents[2] / "tools" / "plot-training"
        out = subprocess.run([sys.executable, str(tool), str(metrics), str(metrics), "--label", "ranks", "-o", str(png)],
                             capture_output=True, text=True, timeout=120)
        print(out.stdout, out.stderr)
        if out.returncode != 0 or not png.read_bytes().startswith(b"\x89PNG"):
            sys.exit("tools/plot-training did not write a PNG")
    shutil.rmtree(work)
    print("ok")


if __name__ == "__main__":
    main()

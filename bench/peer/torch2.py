"""What the PyTorch 2.x peers and their drivers share: finding the
interpreter that has torch, one thread per process, the lines a run's output
starts with, the interleaved order of the runs, and median/range summaries.

The peers need PyTorch 2.x (FSDP2's fully_shard, CPU fused optimizers), which
no system package here provides; make a venv for them and name its
interpreter with --python or GRADSYNC_TORCH2_PYTHON:

    python3 -m venv DIR && DIR/bin/pip install torch numpy
"""
import argparse
import os
import pathlib
import shlex
import statistics
import subprocess
import sys

MAKE_VENV = "python3 -m venv DIR && DIR/bin/pip install torch numpy"

# One thread per process for BLAS and OpenMP too: they read these when they
# load, before torch.set_num_threads could run.
ONE_THREAD_ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def fail(message):
    """Prints message and exits 2: what every missing prerequisite does."""
    print(message, file=sys.stderr)
    sys.exit(2)


def add_python_option(p):
    p.add_argument("--python", default=os.environ.get("GRADSYNC_TORCH2_PYTHON"),
                   help="interpreter with PyTorch 2.x (default: $GRADSYNC_TORCH2_PYTHON)")


def driver_options(doc, tool, rounds=3):
    """A driver's parser: its usage from `doc`, -B (the build with bench/`tool`), --python and --rounds."""
    p = argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].split()))
    p.add_argument("-B", "--build", default="build-o2", help=f"build directory with bench/{tool}")
    add_python_option(p)
    p.add_argument("--rounds", type=int, default=rounds)
    return p


def built_tool(build, tool):
    """build/bench/tool, or exit 2 saying how to build it."""
    exe = pathlib.Path(build) / "bench" / tool
    if not exe.is_file():
        fail(f"{exe} not built: meson setup {build} --buildtype=plain -Doptimization=2 && ninja -C {build} bench/{tool}")
    return exe


def check_python(python):
    """Exits 2 with how to make the venv unless `python` imports torch 2.x; returns its version."""
    if not python:
        fail(f"no PyTorch 2.x interpreter: pass --python DIR/bin/python or set GRADSYNC_TORCH2_PYTHON "
                 f"(make one with: {MAKE_VENV})")
    try:
        out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, timeout=120)
    except OSError as e:
        fail(f"cannot run {python}: {e} (make a venv with: {MAKE_VENV})")
    version = out.stdout.strip()
    if out.returncode != 0 or not version or int(version.split(".")[0]) < 2:
        fail(f"{python} has no PyTorch 2.x ({version or out.stderr.strip()[-300:]}); make a venv with: {MAKE_VENV}")
    return version


def import_torch_or_exit():
    """For the peers: torch, or exit 2 naming the fix."""
    try:
        import torch
    except ImportError:
        fail(f"{sys.executable} has no torch: run the peer with a PyTorch 2.x venv's python "
                 f"(make one with: {MAKE_VENV})")
    if int(torch.__version__.split(".")[0]) < 2:
        fail(f"{sys.executable} has torch {torch.__version__}; the peer needs 2.x ({MAKE_VENV})")
    return torch


def run(cmd, timeout=1800):
    """stdout of cmd, one thread per process; raises with its output's tail if it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ONE_THREAD_ENV)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {p.returncode}:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    return p.stdout


def uptime():
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def print_preamble(*lines):
    """Starts a driver's output: its command line and the machine's load, then `lines`."""
    print(f"# {' '.join(map(shlex.quote, sys.argv))}")
    print(f"# load before: {uptime()}")
    for line in lines:
        print(line)


def interleaved_runs(rounds, points, contenders, command):
    """Runs command(who, point) for every round, point and contender, yielding
    (round, point, who, stdout). The contender that goes first turns with the
    round and the point, so that none always runs on a warmer or a cooler
    machine. A failed run prints its error and exits 1."""
    for r in range(rounds):
        for i, point in enumerate(points):
            k = (r + i) % len(contenders)
            for who in contenders[k:] + contenders[:k]:
                try:
                    out = run(command(who, point))
                except (RuntimeError, OSError) as e:
                    print(e, file=sys.stderr)
                    sys.exit(1)
                yield r, point, who, out


def summary(values):
    """(median, min, max) of a non-empty list."""
    return statistics.median(values), min(values), max(values)


def paired_ratio(num, den):
    """"median [min-max]" of num[r] / den[r] over the rounds r both have: each
    round's pair ran back to back, so their ratio drifts less with the
    machine's load than the medians' ratio does."""
    r = [a / b for a, b in zip(num, den)]
    if not r:
        return "-"
    m, lo, hi = summary(r)
    return f"{m:.2f} [{lo:.2f}-{hi:.2f}]"

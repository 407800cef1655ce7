#!/usr/bin/python3
"""PyTorch loads the full state of a gradsync::fully_shard model into its own nn.Module.

usage: check_fsdp_state.py TORCH_TESTS WORKDIR

For N = 1..4, runs TORCH_TESTS' case in test_torch_fsdp_python.cpp with
GRADSYNC_FSDP_STATE_N = N and GRADSYNC_FSDP_STATE_DIR = DIR: N ranks train a
fully_shard model and save_full_state_dict writes DIR/state.safetensors;
DIR/io.safetensors holds an input x and the sharded model's output for it.
Here a torch.nn.Module of the same shape, its parameters and buffers named
as LibTorch's named_parameters()/named_buffers() name them, loads the file
with safetensors.torch.load_file and load_state_dict(strict=True), and its
forward on x must match that output within 1e-5 (relative).

Runs under the interpreter in GRADSYNC_PYTHON (default /usr/bin/python3;
tools/python-venv makes one that sees Debian's python3-torch) and exits 77
(skip), saying what is missing, when that interpreter cannot import torch
or safetensors.torch.
"""

import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from gradsync_python import SKIP, under_gradsync_python  # noqa: E402

HINT = ("; make a venv with tools/python-venv (it sees Debian's python3-torch: apt-get install python3-torch) "
        "and set GRADSYNC_PYTHON to its python")


def main():
    skip = under_gradsync_python(__file__, HINT)
    if skip:
        return skip
    try:
        import torch
        from safetensors.torch import load_file
    except ImportError as e:
        print(f"SKIP: {sys.executable} cannot import torch and safetensors.torch ({e}){HINT}")
        return SKIP

    class Block(torch.nn.Module):
        """test_torch_fsdp_support's Block: tanh(b(relu(a(x))))."""

        def __init__(self, inputs, hidden, outputs):
            super().__init__()
            self.a = torch.nn.Linear(inputs, hidden)
            self.b = torch.nn.Linear(hidden, outputs)

        def forward(self, x):
            return torch.tanh(self.b(torch.relu(self.a(x))))

    class Net(torch.nn.Module):
        """test_torch_fsdp_support's Net, registered in the same order under the same names."""

        def __init__(self):
            super().__init__()
            self.b1 = Block(12, 13, 11)
            self.b2 = Block(11, 9, 10)
            self.head = torch.nn.Linear(10, 5)
            self.scale = torch.nn.Parameter(torch.ones(10), requires_grad=False)
            self.register_buffer("shift", torch.zeros(10))
            self.double()

        def forward(self, x):
            return self.head(self.b2(self.b1(x)) * self.scale + self.shift)

    writer, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    failures = []
    for n in range(1, 5):
        out_dir = os.path.join(work, f"n{n}")
        env = dict(os.environ, GRADSYNC_FSDP_STATE_N=str(n), GRADSYNC_FSDP_STATE_DIR=out_dir)
        run = subprocess.run([writer, "--source-file=*/test_torch_fsdp_python.cpp"], env=env, capture_output=True,
                             text=True, timeout=120)
        print(run.stdout[-1500:], end="")
        if run.returncode != 0:
            failures.append(f"N={n}: {writer} exited {run.returncode}: {(run.stdout + run.stderr).strip()[-1500:]}")
            continue
        state = load_file(os.path.join(out_dir, "state.safetensors"))
        io = load_file(os.path.join(out_dir, "io.safetensors"))
        net = Net()
        expected_names = [name for name, _ in net.named_parameters()] + [name for name, _ in net.named_buffers()]
        if sorted(state) != sorted(expected_names):
            failures.append(f"N={n}: the file holds {sorted(state)}, the module {sorted(expected_names)}")
            continue
        # strict=True: a name missing or unexpected on either side fails here.
        net.load_state_dict(state, strict=True)
        with torch.no_grad():
            got = net(io["x"])
        want = io["out"]
        if got.shape != want.shape or got.dtype != want.dtype:
            failures.append(f"N={n}: PyTorch's output is {got.dtype} {tuple(got.shape)}, "
                            f"gradsync's {want.dtype} {tuple(want.shape)}")
            continue
        error = (torch.linalg.norm(got - want) / torch.linalg.norm(want)).item()
        print(f"N={n}: {len(state)} tensors loaded strictly; output relative error {error:.3g}")
        if not error <= 1e-5:
            failures.append(f"N={n}: PyTorch's forward differs from the sharded model's by {error:.3g} (relative)")
    for f in failures:
        print("FAIL: " + f)
    if not failures:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

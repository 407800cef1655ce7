#!/usr/bin/python3
"""Python's safetensors package opens a training checkpoint of ddp_mlp.

usage: ddp_mlp_checkpoint_python.py DDP_MLP WORKDIR [ddp_mlp options...]

Runs ddp_mlp --max-steps 7 --save WORKDIR, then loads the checkpoint with
safetensors.numpy.load_file and checks the names the training state is
saved under, every tensor's CRC-32 (zlib) against __metadata__, the shapes
of the optimizer's buffers, and the counters and hyper-parameters. Runs
under GRADSYNC_PYTHON (default /usr/bin/python3; tools/python-venv makes
one) and exits 77 (skip) when it cannot import safetensors and numpy.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from gradsync_python import under_gradsync_python  # noqa: E402


def main():
    skip = under_gradsync_python(__file__)
    if skip:
        return skip
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file

    binary, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    out = subprocess.run([binary] + sys.argv[3:] + ["--max-steps", "7", "--save", work],
                         capture_output=True, text=True, check=True).stdout
    ranks = int(re.search(r"(\d+) ranks x batch (\d+)", out).group(1))
    batch = int(re.search(r"(\d+) ranks x batch (\d+)", out).group(2))
    # The commit file names the checkpoint's file.
    with open(os.path.join(work, "checkpoint.commit")) as f:
        path = os.path.join(work, json.load(f)["file"])
    t = load_file(path)
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata()
    with open(path, "rb") as f:
        raw = f.read()
    failures = []

    def expect(cond, what):
        if not cond:
            failures.append(what)

    # Every tensor's bytes against the CRC-32 gradsync stored for it.
    for name, value in t.items():
        crc = meta.get("gradsync.crc32:" + name)
        expect(crc == f"{zlib.crc32(np.ascontiguousarray(value).tobytes()):08x}", f"CRC-32 of {name}")
    params = [n for n in t if not n.startswith(("optimizer.", "trainer.", "sampler."))]
    expect(sorted(params) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "fc3.bias", "fc3.weight"],
           f"parameter names {sorted(params)}")
    for n in params:
        buf = t.get(f"optimizer.{n}.momentum_buffer")
        expect(buf is not None and buf.shape == t[n].shape and buf.dtype == np.float32,
               f"optimizer.{n}.momentum_buffer beside {n} {t[n].shape}")
        expect(np.isfinite(t[n]).all() and np.abs(t[n]).sum() > 0, f"{n} holds finite, nonzero values")
    expect(t["fc1.weight"].shape[1] == 784, "fc1.weight is [hidden, 784]")
    expect(t["trainer.step"].shape == () and int(t["trainer.step"]) == 7, "trainer.step 7")
    expect(int(t["optimizer.step"]) == 7, "optimizer.step 7")
    expect(t["optimizer.momentum"].dtype == np.float64 and float(t["optimizer.momentum"]) == 0.9,
           "optimizer.momentum 0.9 (F64)")
    expect(not bool(t["optimizer.nesterov"]), "optimizer.nesterov false")
    expect(int(t["sampler.seed"]) == 7 and int(t["sampler.epoch"]) == 0, "sampler.seed 7, epoch 0")
    expect(int(t["sampler.consumed"]) == 7 * batch * ranks, f"sampler.consumed {7 * batch * ranks}")
    expect(meta.get("gradsync.optimizer") == "Sgd" and meta.get("ddp_mlp.epochs") is not None,
           "metadata names the optimizer and keeps the user's keys")
    expect(len(raw) == 8 + int.from_bytes(raw[:8], "little") + sum(v.nbytes for v in t.values()),
           "file length = header + data")
    shutil.rmtree(work)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print(f"ok: {len(t)} tensors from {path}")
    return 0


sys.exit(main())

#!/usr/bin/python3
"""PyTorch training of examples/ddp_mlp's model with its recipe, in one
process: the yardstick its Fashion-MNIST accuracy is checked against.

    /usr/bin/python3 bench/torch_mlp_reference.py [--metrics ref.jsonl --metrics-every 20]
    tools/plot-training ref.jsonl gradsync.jsonl -o both.png

What it repeats of ddp_mlp at 4 ranks x batch 64 (or N x 256/N): the
ranks' batch-64 mean gradients, averaged, are the mean gradient of their
256 samples, so one process at batch 256 computes the same steps.
- data: the IDX files of --data (plain or .gz), pixels / 255 standardised
  by the training set's mean and standard deviation over all its pixels;
- model: Linear-ReLU-Linear-ReLU-Linear (784-256-256-10), weights drawn
  uniformly from +-sqrt(6 / fan_in) (He uniform), biases zero; softmax
  cross-entropy, the batch mean;
- optimizer: SGD, momentum 0.9, no dampening, weight decay or Nesterov.
  torch.optim.SGD then runs gradsync::Sgd's update: v = g on the first
  step, v = 0.9 v + g after, p -= lr v with the lr of that step;
- lr: --lr at batch 64, scaled linearly to --batch; at each epoch's start
  lr * (1 + cos(pi epoch / epochs)) / 2; during the first --warmup epochs'
  steps (counted as ddp_mlp does, ceil(warmup * steps per epoch)) step s
  (from 0) takes that times (s + 1) / (warm-up steps + 1);
- order: every epoch a fresh permutation seeded by seed + epoch, as
  torch's DistributedSampler draws it (not gradsync's permutation, which
  is its own generator); the last batch is the short remainder.
Per epoch it prints the loss, test and train accuracy, samples/s and the
epoch's training seconds (test scoring excluded, as ddp_mlp times it);
--metrics writes ddp_mlp's JSON lines (examples/report.hpp).
"""
import argparse
import gzip
import json
import math
import pathlib
import struct
import sys
import time

import numpy as np
import torch


def read_idx(path):
    """An IDX file (plain or gzip) as a numpy array of its dimensions."""
    candidates = [path, path.with_name(path.name + ".gz")]
    found = next((p for p in candidates if p.exists()), None)
    if found is None:
        sys.exit(f"torch_mlp_reference: neither {candidates[0]} nor {candidates[1]} exists")
    opener = gzip.open if found.suffix == ".gz" else open
    with opener(found, "rb") as f:
        raw = f.read()
    zero, kind, ndim = struct.unpack(">HBB", raw[:4])
    # 0x08: unsigned bytes, the only kind MNIST-layout files use.
    if zero != 0 or kind != 0x08:
        sys.exit(f"torch_mlp_reference: {found} is not an IDX file of unsigned bytes")
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != math.prod(dims):
        sys.exit(f"torch_mlp_reference: {found} holds {data.size} values, its header says {math.prod(dims)}")
    return data.reshape(dims)


def load(data_dir):
    """Train and test features, standardised by the training pixels' mean and deviation, and labels."""
    d = pathlib.Path(data_dir)
    split = {}
    for name in ("train", "t10k"):
        images = read_idx(d / f"{name}-images-idx3-ubyte")
        labels = read_idx(d / f"{name}-labels-idx1-ubyte")
        split[name] = (images.reshape(images.shape[0], -1), labels)
    train_pixels = split["train"][0].astype(np.float64) / 255.0
    # The population deviation, as ddp_mlp computes it (mean of squares less the squared mean).
    mean = train_pixels.mean()
    std = math.sqrt(max((train_pixels * train_pixels).mean() - mean * mean, 0.0)) or 1.0

    def features(images):
        x = (images.astype(np.float32) / np.float32(255.0) - np.float32(mean)) * np.float32(1.0 / std)
        return torch.from_numpy(x)

    return (features(split["train"][0]), torch.from_numpy(split["train"][1].astype(np.int64)),
            features(split["t10k"][0]), torch.from_numpy(split["t10k"][1].astype(np.int64)), mean, std)


def make_model(dims, seed):
    """The MLP, He-uniform weights and zero biases: nn.Linear's own default
    (Kaiming uniform with a=sqrt(5), i.e. bound 1/sqrt(fan_in), and
    non-zero biases) starts from weights sqrt(6) times smaller."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(dims, dims[1:])):
        linear = torch.nn.Linear(fan_in, fan_out)
        bound = math.sqrt(6.0 / fan_in)
        with torch.no_grad():
            linear.weight.uniform_(-bound, bound, generator=g)
            linear.bias.zero_()
        layers.append(linear)
        if i + 2 < len(dims):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def count_correct(model, x, y):
    with torch.no_grad():
        return sum(int((model(x[i:i + 256]).argmax(1) == y[i:i + 256]).sum()) for i in range(0, len(y), 256))


class Metrics:
    """ddp_mlp's --metrics JSON lines, so tools/plot-training draws both alike."""

    def __init__(self, path, batch):
        self.out = open(path, "w", encoding="utf-8") if path else None
        self.batch = batch

    def write(self, kind, epoch, step, samples, loss, train_acc, test_acc, seconds, trained, lr):
        """`samples`: seen since the run began; `trained`: in the `seconds` the line covers."""
        if not self.out:
            return
        # ddp_mlp's precision; JSON has no NaN or infinity, so a diverged loss is null.
        finite = lambda v: float(f"{v:.6g}") if v is not None and math.isfinite(v) else None
        line = {"kind": kind, "epoch": epoch, "step": step, "samples": samples, "loss": finite(loss),
                "train_acc": finite(train_acc), "test_acc": finite(test_acc), "seconds": round(seconds, 4),
                "samples_per_s": round(trained / seconds, 1) if seconds > 0 else 0.0,
                "ranks": 1, "batch": self.batch, "lr": float(f"{lr:.6g}")}
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist",
                   help="directory of {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] (default Debian's Fashion-MNIST)")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch", type=int, default=256, help="the batch (ddp_mlp's ranks x batch; default 256)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.03, help="learning rate at batch 64, scaled linearly (default 0.03)")
    p.add_argument("--warmup", type=float, default=0.5, help="epochs of linear warm-up (default 0.5)")
    p.add_argument("--seed", type=int, default=7, help="seeds the initial weights and, + epoch, each epoch's order")
    # One, like each of ddp_mlp's ranks: on the shared 2-core VM two threads ran an epoch 5-40x slower.
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--metrics", default="", help="write ddp_mlp's JSON lines here")
    p.add_argument("--metrics-every", type=int, default=0, help="a step line every so many steps (0: none)")
    a = p.parse_args()
    if min(a.epochs, a.batch, a.hidden, a.threads) < 1:
        sys.exit("torch_mlp_reference: --epochs, --batch, --hidden and --threads must be at least 1")
    torch.set_num_threads(a.threads)

    t = time.perf_counter()
    x, y, x_test, y_test, mean, std = load(a.data)
    n = len(y)
    classes = int(max(y.max(), y_test.max())) + 1
    lr = a.lr * a.batch / 64
    steps_per_epoch = math.ceil(n / a.batch)
    warmup_steps = math.ceil(a.warmup * steps_per_epoch)
    print(f"MLP {x.shape[1]}-{a.hidden}-{a.hidden}-{classes} on {a.data} ({n} train / {len(y_test)} test, "
          f"pixel mean {mean:.3f} std {std:.3f}, ready in {time.perf_counter() - t:.2f} s); "
          f"torch {torch.__version__}, {a.threads} thread(s)")
    print(f"batch {a.batch}, SGD momentum 0.9, lr {lr:.3g} ({a.lr:.3g} at 64), warm-up {warmup_steps} steps, "
          f"cosine decay per epoch over {a.epochs} epochs, seed {a.seed}")

    model = make_model([x.shape[1], a.hidden, a.hidden, classes], a.seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    metrics = Metrics(a.metrics, a.batch)
    step = 0
    accuracy = 0.0
    for epoch in range(a.epochs):
        epoch_lr = lr * 0.5 * (1 + math.cos(math.pi * epoch / a.epochs))
        step_lr = epoch_lr
        for group in opt.param_groups:
            group["lr"] = epoch_lr
        order = torch.randperm(n, generator=torch.Generator().manual_seed(a.seed + epoch))
        t0 = window_start = time.perf_counter()
        loss_sum, right, steps = 0.0, 0, 0
        window = [0.0, 0, 0, 0]  # loss, steps, right, samples since the last step line
        for at in range(0, n, a.batch):
            if warmup_steps and step <= warmup_steps:
                # The same share as examples/cli.hpp's warmed(): (s + 1) / (warm-up + 1), then 1.
                step_lr = epoch_lr * (1.0 if step >= warmup_steps else (step + 1) / (warmup_steps + 1))
                for group in opt.param_groups:
                    group["lr"] = step_lr
            idx = order[at:at + a.batch]
            xb, yb = x[idx], y[idx]
            logits = model(xb)
            loss = loss_fn(logits, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            steps += 1
            value = float(loss)
            ok = int((logits.detach().argmax(1) == yb).sum())
            loss_sum += value
            right += ok
            if a.metrics_every:
                window[0] += value
                window[1] += 1
                window[2] += ok
                window[3] += len(yb)
                if step % a.metrics_every == 0:
                    now = time.perf_counter()
                    metrics.write("step", epoch + 1, step, epoch * n + at + len(yb), window[0] / window[1],
                                  window[2] / window[3], None, now - window_start, window[3], step_lr)
                    window = [0.0, 0, 0, 0]
                    window_start = now
        seconds = time.perf_counter() - t0
        accuracy = count_correct(model, x_test, y_test) / len(y_test)
        loss_mean = loss_sum / steps
        print(f"epoch {epoch + 1}: loss {loss_mean:.4f}  test {100 * accuracy:.2f}%  train {100 * right / n:.2f}%  "
              f"{n / seconds:.0f} samples/s  {seconds:.1f} s", flush=True)
        metrics.write("epoch", epoch + 1, step, (epoch + 1) * n, loss_mean, right / n, accuracy, seconds, n, step_lr)
    print(f"final test accuracy {100 * accuracy:.2f}%")


if __name__ == "__main__":
    main()

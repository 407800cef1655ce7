#!/usr/bin/env python3
"""ddp_mlp (or fsdp_mlp) stopped mid-epoch with --save, then continued in a
fresh process with --resume, ends exactly as an uninterrupted run: the same
last epoch's loss and accuracy, and a final checkpoint with the same bytes.

usage: ddp_mlp_resume.py BINARY WORKDIR [--stopped-sharded] [options...]

--stopped-sharded: the stopped run saves a sharded checkpoint
(--checkpoint-format sharded), which the resumed run loads; the final
checkpoints are full files either way.
"""
import json
import pathlib
import re
import shutil
import sys

from example_run import run


def committed(directory):
    """The file a checkpoint directory's commit file names: its checkpoint's full file or index."""
    with open(directory / "checkpoint.commit") as f:
        return directory / json.load(f)["file"]


def last_epoch(out):
    """(epoch, loss, accuracy) of the last epoch line."""
    lines = re.findall(r"^epoch\s+(\d+)\s+loss (\S+)\s+test acc\s+(\S+)%", out, re.M)
    if not lines:
        sys.exit("no epoch line in:\n" + out)
    return lines[-1]


def main():
    binary, work = sys.argv[1], pathlib.Path(sys.argv[2])
    options = sys.argv[3:]
    stopped_format = []
    if "--stopped-sharded" in options:
        options.remove("--stopped-sharded")
        stopped_format = ["--checkpoint-format", "sharded"]
    common = options + ["--deterministic", "--epochs", "3"]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    every = ["--metrics-every", "5"]
    straight = run(binary, common + ["--save", str(work / "straight"), "--metrics", str(work / "straight.jsonl")]
                   + every)
    # 20 steps of batch 64 on 2048 samples stop mid-epoch at 1 to 4 ranks.
    # The stopped run and the resumed one write one metrics file.
    metrics = ["--metrics", str(work / "resumed.jsonl")] + every
    first = run(binary, common + ["--max-steps", "20", "--save", str(work / "stopped")] + stopped_format + metrics)
    if stopped_format and not committed(work / "stopped").name.endswith(".index.json"):
        sys.exit("the stopped run did not write a sharded checkpoint:\n" + first)
    if "at step 20" not in first:
        sys.exit("the stopped run did not save at step 20:\n" + first)
    # A line past the checkpoint, as a run that went on after its last save would leave.
    with open(work / "resumed.jsonl", "a") as f:
        f.write('{"kind": "step", "epoch": 2, "step": 25}\n')
    resumed = run(binary, common + ["--resume", str(work / "stopped"), "--save", str(work / "resumed")] + metrics)
    at = re.search(r"resumed from .* step 20, epoch \d+, sample (\d+) of (\d+)", resumed)
    if not at or not 0 < int(at.group(1)) < int(at.group(2)):
        sys.exit("the resumed run did not start mid-epoch at step 20:\n" + resumed)
    a, b = last_epoch(straight), last_epoch(resumed)
    print("uninterrupted:", a, " resumed:", b)
    # The epoch the run resumed in reports the loss of its second part only.
    if len(re.findall(r"^epoch", resumed, re.M)) == 1:
        a, b = (a[0], a[2]), (b[0], b[2])
    if a != b:
        sys.exit(f"the resumed run ends at {b}, the uninterrupted one at {a}\n--- straight\n{straight}\n--- resumed\n{resumed}")
    # The metrics file tells the stopped and resumed run as one: every step
    # line of the uninterrupted run, once, with its figures (windows of 5
    # steps across epoch ends; the stop at 20 ends one), timings aside.
    def step_lines(name):
        lines = [json.loads(t) for t in (work / name).read_text().splitlines()]
        keep = ("epoch", "step", "samples", "loss", "train_acc", "lr")
        return [tuple(l[k] for k in keep) for l in lines if l["kind"] == "step"]
    sl, rl = step_lines("straight.jsonl"), step_lines("resumed.jsonl")
    if not sl or sl != rl:
        sys.exit(f"the step lines of the stopped and resumed run differ from the uninterrupted run's:\n{rl}\n---\n{sl}")
    # One epoch line per epoch, test accuracy and step as the uninterrupted
    # run's; the epoch the run resumed in says which part its loss covers.
    def epoch_lines(name):
        return [json.loads(t) for t in (work / name).read_text().splitlines() if '"kind": "epoch"' in t]
    se, re_ = epoch_lines("straight.jsonl"), epoch_lines("resumed.jsonl")
    if [(l["epoch"], l["step"], l["test_acc"]) for l in re_] != [(l["epoch"], l["step"], l["test_acc"]) for l in se]:
        sys.exit(f"the epoch lines of the stopped and resumed run differ from the uninterrupted run's:\n{re_}\n---\n{se}")
    parts = [l for l in re_ if "part" in l]
    if any("part" in l for l in se) or len(parts) != 1 or parts[0]["part"][0] != int(at.group(1)) + 1:
        sys.exit(f"the epoch the run resumed in is not marked as a part from sample {int(at.group(1)) + 1}:\n{re_}")
    sa = committed(work / "straight").read_bytes()
    sb = committed(work / "resumed").read_bytes()
    if sa != sb:
        sys.exit("the final checkpoints differ: the resumed run's state is not the uninterrupted one's")
    # A checkpoint that is not there: a clear error naming the file, exit 2.
    missing = run(binary, common + ["--resume", str(work / "nowhere")], expect_rc=2)
    if str(work / "nowhere" / "checkpoint.commit") not in missing or "cannot open" not in missing:
        sys.exit("resuming from a missing checkpoint did not say which file:\n" + missing)
    shutil.rmtree(work)
    print("ok")


main()

#!/usr/bin/env python3
"""libtorch_fsdp stopped with --save and resumed in a fresh process at the
same world size ends with the uninterrupted run's held-out loss, to the last
digit printed; resumed again at its end it trains nothing. A resume whose
--heads, --batch, --seed or text differ from the checkpoint's run is refused
(exit 2), and so is a checkpoint whose ranks' files come from two saves (a save
cut short between ranks' renames), at another step or the same. The text is the
first 3,000 bytes of GPL-3, so that the runs cross an epoch's end (5 steps
per epoch at 2 ranks and the options meson.build gives). The full state dict written beside the
shards is a safetensors file naming the unwrapped model's parameters.

usage: libtorch_fsdp_resume.py BINARY WORKDIR [options...]
"""
import json
import pathlib
import re
import shutil
import struct
import sys

from example_run import line_groups, run


def final_loss(out):
    loss, steps = line_groups(r"^final held-out loss (\S+) after (\d+) steps", out, "final loss")
    return loss, int(steps)


def main():
    binary, work = sys.argv[1], pathlib.Path(sys.argv[2])
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    text = work / "text"
    text.write_bytes(pathlib.Path("/usr/share/common-licenses/GPL-3").read_bytes()[:3000])
    common = sys.argv[3:] + ["--text", str(text), "--sample", "20"]
    saved = str(work / "saved")

    whole = run(binary, common + ["--steps", "8"])
    loss, steps = final_loss(whole)
    if steps != 8:
        sys.exit("the uninterrupted run did not take 8 steps:\n" + whole)
    print("uninterrupted:", loss)

    first = run(binary, common + ["--steps", "3", "--save", saved])
    if final_loss(first)[1] != 3:
        sys.exit("the first part did not stop at step 3:\n" + first)
    resumed = run(binary, common + ["--steps", "8", "--resume", saved, "--save", saved])
    per_epoch = int(re.search(r"(\d+) steps per epoch", resumed).group(1))
    at = rf"^epoch {3 // per_epoch + 1} .*\(steps {3 % per_epoch + 1}-"
    if "resumed from" not in resumed or not re.search(at, resumed, re.M):
        sys.exit(f"the resumed run did not go on at step 4 ({per_epoch} steps per epoch):\n" + resumed)
    if final_loss(resumed) != (loss, 8):
        sys.exit(f"resumed at step 3: final loss {final_loss(resumed)}, uninterrupted {loss}:\n{resumed}")
    print("resumed:", final_loss(resumed)[0])

    again = run(binary, common + ["--steps", "8", "--resume", saved])
    if "nothing to train" not in again or final_loss(again) != (loss, 8):
        sys.exit("resumed at its end, the run trained or ended elsewhere:\n" + again)

    def refused(args, says):
        out = run(binary, args, expect_rc=2)
        if says not in out or "resumed from" in out:
            sys.exit(f"{args[-4:]}: expected a refusal saying '{says}':\n{out}")

    heads = common.index("--heads") + 1
    other_heads = common[:heads] + [str(2 * int(common[heads]))] + common[heads + 1:]
    refused(other_heads + ["--steps", "8", "--resume", saved], "the checkpoint's run had model")
    refused(common + ["--steps", "8", "--batch", "3", "--resume", saved], "the checkpoint's run had batch")
    refused(common + ["--steps", "8", "--seed", "9", "--resume", saved], "the checkpoint's run had seed")
    changed = work / "changed"
    changed.write_bytes(text.read_bytes().replace(b"software", b"hardware"))
    changed_text = common[:common.index("--text") + 1] + [str(changed)] + common[common.index("--text") + 2:]
    refused(changed_text + ["--steps", "8", "--resume", saved], "the checkpoint's run had text")

    # Files of two saves: at steps 3 and 8, and two saves at step 3.
    for i in (1, 2):
        run(binary, common + ["--steps", "3", "--save", str(work / f"at3-{i}")])
    for name, zero, one in (("mixed-steps", saved, work / "at3-1"), ("mixed-saves", work / "at3-1", work / "at3-2")):
        mixed = work / name
        mixed.mkdir()
        shutil.copy(pathlib.Path(zero) / "rank-0-of-2.pt", mixed)
        shutil.copy(pathlib.Path(one) / "rank-1-of-2.pt", mixed)
        refused(common + ["--steps", "8", "--resume", str(mixed)], "is of another save")
    print("refused: other heads, batch, seed and text; files of two saves")

    # safetensors: an 8-byte little-endian header length, then the JSON header.
    blob = (pathlib.Path(saved) / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + size])
    for name in ("tok.weight", "head.weight", "block0.qkv.weight", "block0.down.bias"):
        if name not in header:
            sys.exit(f"model.safetensors has no {name}: {sorted(header)}")
    print("model.safetensors:", len([k for k in header if k != "__metadata__"]), "tensors")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A training example resumed from the checkpoint of a run that already
finished: it trains nothing, says so, and ends with the finished run's own
test accuracy (the same model), judged against --target as any run is. Given
more --epochs, it trains just the epochs the checkpoint lacks.

usage: resume_finished.py BINARY WORKDIR [--max-steps] [--constant-lr] [options...]

--max-steps: BINARY takes --max-steps (ddp_mlp, fsdp_mlp): a run halted
there and resumed with the same --max-steps trains nothing either; with a
larger one it goes on to it, and resumed again without one it ends as the
uninterrupted run (options must hold --deterministic).
--constant-lr: BINARY's learning rate does not depend on --epochs
(libtorch_ddp): a run of one epoch resumed with --epochs 2 ends as a run of
two, to the last digit printed.
"""
import pathlib
import re
import shutil
import sys

from example_run import line_groups, run


def final_accuracy(out):
    """The test accuracy (percent, as printed) of the last line."""
    return line_groups(r"^(?:reached|MISSED|stopped by --max-steps): test accuracy (\S+)%", out, "final accuracy")[0]


def epochs_trained(out):
    return [int(e) for e in re.findall(r"^epoch\s+(\d+)\s", out, re.M)]


def expect_nothing_trained(out, why, accuracy, what):
    """`out` trained nothing, said `why`, and ended at `accuracy`."""
    if f"nothing to train: {why}" not in out:
        sys.exit(f"{what}: no 'nothing to train: {why}' line:\n{out}")
    if epochs_trained(out):
        sys.exit(f"{what}: trained epochs {epochs_trained(out)}:\n{out}")
    if final_accuracy(out) != accuracy:
        sys.exit(f"{what}: test accuracy {final_accuracy(out)}%, the checkpoint's model scored {accuracy}%:\n{out}")


def main():
    binary, work = sys.argv[1], pathlib.Path(sys.argv[2])
    options = sys.argv[3:]
    flags = set()
    while options and options[0] in ("--max-steps", "--constant-lr"):
        flags.add(options.pop(0))
    max_steps, constant_lr = "--max-steps" in flags, "--constant-lr" in flags
    # The last of a repeated option counts: these override the test's own.
    common = options + ["--epochs", "2", "--target", "0"]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    done = str(work / "done")

    finished = run(binary, common + ["--save", done])
    if epochs_trained(finished) != [1, 2]:
        sys.exit("the run to finish did not train epochs 1 and 2:\n" + finished)
    accuracy = final_accuracy(finished)
    print("finished run:", accuracy, "%")

    # A target its model meets: exit 0; one it misses: exit 1, as after training.
    met = f"{float(accuracy) / 200:.4f}"
    resumed = run(binary, common + ["--resume", done, "--target", met])
    expect_nothing_trained(resumed, "the checkpoint is at epoch 2 of 2", accuracy, "the finished run resumed")
    if not re.search(r"^reached: test accuracy", resumed, re.M):
        sys.exit("the finished run resumed did not report the target reached:\n" + resumed)
    print(resumed)
    missed = run(binary, common + ["--resume", done, "--target", f"{float(accuracy) / 100 + 0.01:.4f}"], expect_rc=1)
    expect_nothing_trained(missed, "the checkpoint is at epoch 2 of 2", accuracy, "the finished run resumed")
    # Fewer --epochs than the checkpoint's: nothing to train either.
    fewer = run(binary, common + ["--resume", done, "--epochs", "1"])
    expect_nothing_trained(fewer, "the checkpoint is at epoch 2, past --epochs 1", accuracy, "--epochs 1")
    # At another world size: the same model, scored on other shares of the
    # test set (a sample's score may move in the last bits: within a point).
    other = run(binary, common + ["--resume", done, "--ranks", "2"])
    if "nothing to train: the checkpoint is at epoch 2 of 2" not in other or epochs_trained(other):
        sys.exit("the finished run resumed at 2 ranks trained or did not say why not:\n" + other)
    if abs(float(final_accuracy(other)) - float(accuracy)) > 1:
        sys.exit(f"the finished run resumed at 2 ranks scores {final_accuracy(other)}%, not about {accuracy}%:\n{other}")

    # Another --batch: the checkpoint's run is not this one's; refused on
    # every rank, exit 2, before a step (the learning rate, the sampler's
    # steps and the data seen would all be another run's).
    refused = run(binary, common + ["--resume", done, "--epochs", "3", "--batch", "32"], expect_rc=2)
    if "resume with the same data and --batch" not in refused or epochs_trained(refused):
        sys.exit("resumed at another --batch, it was not refused before training:\n" + refused)

    # More --epochs: just the third is trained, and its checkpoint is then finished too.
    more = run(binary, common + ["--resume", done, "--epochs", "3", "--save", str(work / "more")])
    if epochs_trained(more) != [3]:
        sys.exit(f"resumed with --epochs 3, it trained epochs {epochs_trained(more)}, not just 3:\n{more}")
    again = run(binary, common + ["--resume", str(work / "more"), "--epochs", "3"])
    expect_nothing_trained(again, "the checkpoint is at epoch 3 of 3", final_accuracy(more), "--epochs 3 resumed")

    if constant_lr:
        run(binary, common + ["--epochs", "1", "--save", str(work / "half")])
        rest = run(binary, common + ["--resume", str(work / "half")])
        if epochs_trained(rest) != [2]:
            sys.exit(f"resumed after epoch 1 of 2, it trained epochs {epochs_trained(rest)}:\n{rest}")
        line = re.compile(r"^epoch\s+2\s+loss (\S+)\s+test acc\s+(\S+)%", re.M)
        if line.search(rest).groups() != line.search(finished).groups():
            sys.exit(f"resumed after epoch 1, epoch 2 differs from the uninterrupted run's:\n{rest}\n---\n{finished}")

    if max_steps:
        halted_dir = str(work / "halted")
        # 20 steps of batch 64 on 2048 samples end mid-epoch 2 at 2 or 3 ranks.
        # A run cut short by --max-steps is not one that missed its target: it
        # says so and exits 0, whatever the target.
        halted = run(binary, common + ["--max-steps", "20", "--save", halted_dir, "--target", "0.999"])
        if "at step 20" not in halted:
            sys.exit("the halted run did not save at step 20:\n" + halted)
        if not re.search(r"^stopped by --max-steps: test accuracy \S+% so far", halted, re.M):
            sys.exit("the halted run did not end with its 'stopped by --max-steps' line:\n" + halted)
        same = run(binary, common + ["--resume", halted_dir, "--max-steps", "20", "--target", "0.999"])
        expect_nothing_trained(same, "the checkpoint is at step 20, --max-steps 20", final_accuracy(halted),
                               "resumed at --max-steps")
        fewer_steps = run(binary, common + ["--resume", halted_dir, "--max-steps", "10"])
        expect_nothing_trained(fewer_steps, "the checkpoint is at step 20, past --max-steps 10", final_accuracy(halted),
                               "resumed past --max-steps")
        # --max-steps counts the steps before the checkpoint: one more here.
        on = run(binary, common + ["--resume", halted_dir, "--max-steps", "21", "--save", str(work / "on")])
        if "at step 21" not in on or len(epochs_trained(on)) != 1:
            sys.exit("resumed at step 20 with --max-steps 21, it did not take the one step left and save:\n" + on)
        end = run(binary, common + ["--resume", str(work / "on")])
        if final_accuracy(end) != accuracy or epochs_trained(end)[-1:] != [2]:
            sys.exit(f"halted at steps 20 and 21, it ends at {final_accuracy(end)}%, the uninterrupted run at "
                     f"{accuracy}%:\n{end}")
    shutil.rmtree(work)
    print("ok")


main()

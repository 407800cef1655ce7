#!/usr/bin/env python3
"""gradsync's optimizer step (bench/optim_step) against torch.optim's foreach
and fused implementations, interleaved in one run, one thread each.

    python3 bench/peer/optim_compare.py --python DIR/bin/python [-B build-o2]
                                        [--sizes 64K,1M,16M,64M] [--rounds 3] [--repeats 5]

DIR is a venv with PyTorch 2.x (python3 -m venv DIR && DIR/bin/pip install
torch numpy); --python defaults to $GRADSYNC_TORCH2_PYTHON. For every round
and size, optim_step and bench/peer/torch_optim_peer.py run one after the
other, the first alternating from size to size and round to round, so both
see the same load. Both time a step the same way (median of --repeats rounds
of back-to-back steps on one flat float32 tensor with a fixed gradient) and
count the same bytes per parameter (SGD with momentum 20, Adam and AdamW 28).
The table gives, per size and optimizer, the median over rounds of each
one's ms per step with the range, GB/s at the median, and the throughput
ratio gradsync/PyTorch: PyTorch's ms over gradsync's in the same round
(above 1, gradsync is faster), median and range over rounds. Build the
tools at -O2 (-march=native unless -Dnative_arch=false):

    meson setup build-o2 --buildtype=plain -Doptimization=2 -Dcuda=disabled -Dnccl=disabled -Dtorch=disabled -Dtests=disabled
    nice ninja -C build-o2 bench/optim_step bench/fsdp_step

Exits 2 when the interpreter or optim_step is missing, 1 on a run error.
"""
import pathlib
import sys

from torch2 import built_tool, check_python, driver_options, paired_ratio, print_preamble, run, summary, uptime

here = pathlib.Path(__file__).resolve().parent
ROWS = ["sgd_momentum", "adam", "adamw"]


def parse_rows(text):
    """{name: ms} from optim_step's or the peer's rows (comments skipped).
    From params, B/p and GB/s: optim_step prints ms to 1 us only, 6% of a 64K step."""
    out = {}
    for line in text.splitlines():
        f = line.split()
        if f and not line.startswith("#"):
            out[f[0]] = int(f[1]) * int(f[2]) / float(f[4]) / 1e6
    return out


def main():
    p = driver_options(__doc__, "optim_step")
    p.add_argument("--sizes", default="64K,1M,16M,64M")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    version = check_python(a.python)
    exe = built_tool(a.build, "optim_step")
    sizes = a.sizes.split(",")
    modes = ["foreach", "fused"]
    # ms[(size, contender)] -> list over rounds; contender "gradsync/adam", "adam/fused", ...
    ms = {}
    errors = set()
    print_preamble(f"# torch {version}; optim_step {exe}; one thread each; raw rows: round size first contender ms")
    for r in range(a.rounds):
        for i, size in enumerate(sizes):
            # --bound-bytes small: the memcpy bound is not used here, only each optimizer's time.
            gs_cmd = [str(exe), "--sizes", size, "--repeats", str(a.repeats), "--bound-bytes", "1M"]
            pt_cmd = [a.python, str(here / "torch_optim_peer.py"), "--sizes", size, "--repeats", str(a.repeats),
                      "--modes", ",".join(modes), "--optimizers", ",".join(ROWS)]
            gs_first = (r + i) % 2 == 0
            try:
                for who in (["gradsync", "torch"] if gs_first else ["torch", "gradsync"]):
                    out = run(gs_cmd if who == "gradsync" else pt_cmd)
                    errors |= {l.split()[1] for l in out.splitlines() if " error: " in l}
                    for name, t in parse_rows(out).items():
                        key = f"gradsync/{name}" if who == "gradsync" else name
                        ms.setdefault((size, key), []).append(t)
                        if who == "torch" or name in ROWS:
                            print(f"{r + 1} {size:>4} {'gradsync' if gs_first else 'torch':8} {key:22} {t:.4f}",
                                  flush=True)
            except (RuntimeError, OSError) as e:
                print(e, file=sys.stderr)
                return 1
    print(f"# load after: {uptime()}")
    for e in sorted(errors):
        print(f"# {e}: PyTorch refused it (see the peer's error line)")
    print(f"\n# optimizer step, one flat float32 tensor, one thread; median of {a.rounds} interleaved rounds "
          f"(each the median of {a.repeats} repeats), [min-max] over rounds; GB = 1e9 at the median; "
          f"gradsync/X: X's ms over gradsync's, round by round")
    head = "| params | optimizer | B/p | gradsync ms | GB/s |"
    rule = "|---:|---|---:|---:|---:|"
    for m in modes:
        head += f" PyTorch {m} ms | GB/s |"
        rule += "---:|---:|"
    head += "".join(f" gradsync/{m} |" for m in modes)
    rule += "---:|" * len(modes)
    print(head)
    print(rule)
    bpp = {"sgd_momentum": 20, "adam": 28, "adamw": 28}
    for size in sizes:
        for name in ROWS:
            gs = ms.get((size, f"gradsync/{name}"))
            if not gs:
                continue
            n = int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1].upper()] if size[-1].isalpha() else int(size)
            g, glo, ghi = summary(gs)
            line = f"| {size} | {name} | {bpp[name]} | {g:.3f} [{glo:.3f}-{ghi:.3f}] | {bpp[name] * n / g / 1e6:.1f} |"
            ratios = ""
            for m in modes:
                t = ms.get((size, f"{name}/{m}"))
                if not t:
                    line += " error | - |"
                    ratios += " - |"
                    continue
                tm, tlo, thi = summary(t)
                line += f" {tm:.3f} [{tlo:.3f}-{thi:.3f}] | {bpp[name] * n / tm / 1e6:.1f} |"
                ratios += f" {paired_ratio(t, gs)} |"
            print(line + ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""bench/plot.py: PNG charts from the JSON the gradsync bench tools write.

  bench/plot.py OUTDIR FILE.json...

Each file is recognised by its "benchmark" field:
  compare          (bench/compare.py -J)  -> compare_busbw_N<n>.png: busbw against size,
                   log-log, one line per gradsync algorithm and peer, memcpy ceiling
                   dashed, memcpy*(N-1)/N^2 (out of cache, one thread's memcpy) dotted, the
                   ring/tree crossover (threads) marked.
  all_reduce_perf  (all_reduce_perf -J) -> perf_<backend>_N<n>.png: busbw per algorithm,
                   crossover marked; perf_<backend>_N<n>_model.png: measured time
                   against the cost model's prediction per algorithm.
  reduce_scatter_perf, all_gather_perf, broadcast_perf  the same charts from those
                   tools' -J, out of place (broadcast: in place, its only placement).
  all_reduce_model (all_reduce_perf --model -J) -> model_scaling.png: predicted
                   busbw of each algorithm against size, one panel per world size,
                   winner bold.
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def crossover(sizes, ring, tree):
    """First size at which ring's busbw reaches tree's after being below it (or the reverse)."""
    prev = None
    for s, r, t in zip(sizes, ring, tree):
        if r is None or t is None:
            continue
        ahead = r >= t
        if prev is not None and ahead != prev:
            return s
        prev = ahead
    return None


def mark_crossover(ax, x, label):
    if x:
        ax.axvline(x, color="grey", linestyle=":", linewidth=1)
        ax.text(x, ax.get_ylim()[0], f" {label}\n {x} B", fontsize=7, color="grey", va="bottom")


def style(ax, title, ylabel="busbw (GB/s, 1e9)", xlabel="size per rank (bytes)"):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def plot_compare(doc, outdir):
    out = []
    for n in doc["ranks"]:
        rows = [r for r in doc["results"] if r["N"] == n]
        fig, ax = plt.subplots(figsize=(8, 5))
        names = []
        for r in rows:
            if r["contender"] not in names:
                names.append(r["contender"])
        series = {}
        colors = plt.cm.tab20.colors
        for i, c in enumerate(names):
            pts = sorted((r["size"], r["busbw_GBps"]) for r in rows if r["contender"] == c and r["busbw_GBps"] > 0)
            if not pts:
                continue
            series[c] = dict(pts)
            ls = "-" if c.startswith("threads/") else "--" if c.startswith("mpi/") else "-."
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker="o", markersize=3, label=c,
                    color=colors[i % len(colors)])
        ax.axhline(doc["memcpy_GBps"], color="black", linestyle="--", linewidth=1,
                   label=f"memcpy ceiling {doc['memcpy_GBps']:.1f}")
        # Once the buffers no longer fit in cache, an all-reduce among N ranks
        # of one machine must read N inputs and write N outputs of S bytes
        # through memory: at the single-thread memcpy rate that takes
        # 2*N*S / memcpy(read+write), so busbw (S/t * 2(N-1)/N) is
        # memcpy * (N-1)/N^2. Several cores copying at once can beat it, so it
        # is a reference line, not a ceiling.
        dram = doc["memcpy_GBps"] * (n - 1) / (n * n)
        ax.axhline(dram, color="black", linestyle=":", linewidth=1,
                   label=f"out of cache at 1-thread memcpy: {dram:.2f} = memcpy(N-1)/N²")
        sizes = sorted(doc["sizes"])
        r_, t_ = series.get("threads/ring", {}), series.get("threads/tree", {})
        style(ax, f"all-reduce busbw, N={n} (load avg {min(doc['load_average']):.1f}-{max(doc['load_average']):.1f})")
        mark_crossover(ax, crossover(sizes, [r_.get(s) for s in sizes], [t_.get(s) for s in sizes]), "ring/tree")
        path = os.path.join(outdir, f"compare_busbw_N{n}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        out.append(path)
    return out


def primary(row):
    """The placement the tool's footer reports: out of place, else in place (broadcast)."""
    return row["out_of_place"] or row["in_place"]


def plot_perf(doc, outdir, stem):
    n, factor = doc["world_size"], doc["busbw_factor"]
    # Reduce-scatter and all-gather count the whole array, as nccl-tests does.
    xlabel = "size, N x per rank (bytes)" if doc["benchmark"] in ("reduce_scatter_perf", "all_gather_perf") else "size per rank (bytes)"
    fig, ax = plt.subplots(figsize=(8, 5))
    bw = {}
    for t in doc["tables"]:
        xs = [r["size"] for r in t["rows"]]
        ys = [primary(r)["busbw_GBps"] or None for r in t["rows"]]
        bw[t["algorithm"]] = dict(zip(xs, ys))
        ax.plot(xs, ys, marker="o", markersize=3, label=t["algorithm"])
    ax.axhline(doc["memcpy_GBps"], color="black", linestyle="--", linewidth=1, label="memcpy ceiling")
    style(ax, f"gradsync {doc['benchmark']}, {doc['backend']} backend, N={n}", xlabel=xlabel)
    sizes = sorted({s for v in bw.values() for s in v})
    if "ring" in bw and "tree" in bw:
        mark_crossover(ax, crossover(sizes, [bw["ring"].get(s) for s in sizes], [bw["tree"].get(s) for s in sizes]),
                       "ring/tree")
    p1 = os.path.join(outdir, f"{stem}_{doc['backend']}_N{n}.png")
    fig.tight_layout()
    fig.savefig(p1, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, t in enumerate(doc["tables"]):
        xs = [r["size"] for r in t["rows"]]
        color = f"C{i}"
        ax.plot(xs, [primary(r)["time_us"] for r in t["rows"]], "-", marker="o", markersize=3, color=color,
                label=f"{t['algorithm']} measured")
        ax.plot(xs, [r["predicted_us"] for r in t["rows"]], ":", color=color, label=f"{t['algorithm']} model")
    style(ax, f"measured vs cost model, {doc['backend']} backend, N={n} (busbw factor {factor:.2f})", "time per call (us)",
          xlabel)
    p2 = os.path.join(outdir, f"{stem}_{doc['backend']}_N{n}_model.png")
    fig.tight_layout()
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [p1, p2]


def plot_model(doc, outdir):
    tables = doc["tables"]
    cols = min(2, len(tables))
    rows = (len(tables) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, t in zip(axes.flat, tables):
        p = t["world_size"]
        factor = 2 * (p - 1) / p
        xs = [r["size"] for r in t["rows"]]
        algos = [k[:-3] for k in t["rows"][0] if k.endswith("_us")]
        for a in algos:
            ax.plot(xs, [x / (r[a + "_us"] * 1e-6) / 1e9 * factor for x, r in zip(xs, t["rows"])], marker=".", label=a)
        ring = [r.get("ring_us") for r in t["rows"]]
        tree = [r.get("tree_us") for r in t["rows"]]
        style(ax, f"model: N={p}, alpha={doc['alpha']:g}s beta={doc['beta']:g}s/B")
        x = crossover(xs, [1 / v if v else None for v in ring], [1 / v if v else None for v in tree])
        mark_crossover(ax, x, "ring/tree")
    for ax in list(axes.flat)[len(tables):]:
        ax.axis("off")
    fig.suptitle(f"gradsync cost model, predicted busbw ({doc.get('preset') or 'custom link'})")
    path = os.path.join(outdir, "model_scaling.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    outdir = argv[1]
    os.makedirs(outdir, exist_ok=True)
    for f in argv[2:]:
        with open(f) as fh:
            doc = json.load(fh)
        kind = doc.get("benchmark")
        stem = os.path.splitext(os.path.basename(f))[0]
        if kind == "compare":
            made = plot_compare(doc, outdir)
        elif kind in ("all_reduce_perf", "reduce_scatter_perf", "all_gather_perf", "broadcast_perf"):
            made = plot_perf(doc, outdir, stem)
        elif kind == "all_reduce_model":
            made = plot_model(doc, outdir)
        else:
            sys.exit(f"plot.py: {f}: unknown benchmark {kind!r}")
        for m in made:
            print(m)


if __name__ == "__main__":
    main(sys.argv)

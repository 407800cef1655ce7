#!/usr/bin/python3
"""bench/compare.py: gradsync against its peers, in one run, interleaved per size.

For every size (outer loop) and world size N (inner loop) it runs, one after
the other so that each sees the machine in the same state:
  threads/{ring,tree,rhd,native,auto}  all_reduce_perf -t N --algo all
  mpi/{ring,tree,rhd,native,auto}      mpirun -np N all_reduce_perf_mpi --backend mpi --algo all
  MPI_Allreduce                        mpirun -np N mpi_allreduce_peer (Open MPI's default tuning)
  MPI_Allreduce/ring                   the same with coll_tuned_allreduce_algorithm 4 (Open MPI's ring)
  gloo/{ring,ring_chunked,halving_doubling}  N gloo_allreduce_peer processes, TCP on 127.0.0.1
and the memcpy bandwidth (read+write, as all_reduce_perf measures it, in each
of its runs; the best is the ceiling). Every contender is timed the same way:
per-call mean of back-to-back calls, max over ranks, median over repeats,
float sum. gradsync figures are out of place, Gloo's in place (its only mode).
busbw = S/t * 2(N-1)/N, GB = 1e9 bytes (nccl-tests).

  bench/compare.py [-B BUILDDIR] [--sizes 8,64K,1M,16M,256M] [--ranks 2,4]
                [-r REPEATS] [-w WARMUP] [--quick] [-J out.json]

A contender whose binary is not built (no MPI, no Gloo) is skipped.
Exits 1 if any gradsync result was wrong, 2 on a run error.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
OMPI_RING = ["--mca", "coll_tuned_use_dynamic_rules", "1", "--mca", "coll_tuned_allreduce_algorithm", "4"]
ALGOS = ["ring", "tree", "rhd", "native", "auto"]
GLOO = ["ring", "ring_chunked", "halving_doubling"]


def parse_size(text):
    text = text.strip()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def human(n):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B" if n < 1024 else str(n)


def run(cmd, timeout):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    return p.stdout


def busbw(size, t_us, n):
    return size / (t_us * 1e-6) / 1e9 * 2 * (n - 1) / n if t_us > 0 else 0.0


def gradsync_run(cmd, json_path, timeout):
    run(cmd + ["-J", json_path], timeout)
    with open(json_path) as f:
        doc = json.load(f)
    out = {}
    for t in doc["tables"]:
        r = t["rows"][0]
        o = r["out_of_place"]
        out[t["algorithm"]] = {"time_us": o["time_us"], "wrong": (o["wrong"] or 0) + (r["in_place"]["wrong"] or 0),
                               "predicted_us": r["predicted_us"], "auto_pick": r["auto_pick"]}
    return out, doc.get("memcpy_GBps", 0.0)


def peer_lines(text):
    for line in text.splitlines():
        if line and not line.startswith("#"):
            size, t_us, _ = line.split()
            yield int(size), float(t_us)


def gloo_run(exe, n, algo, size, args, timeout):
    store = tempfile.mkdtemp(prefix="gloo-store-")
    try:
        procs = [subprocess.Popen([exe, str(r), str(n), store, algo, "-r", str(args.repeats), "-w", str(args.warmup),
                                   str(size)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(n)]
        outs = []
        for p in procs:
            try:
                o, e = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"gloo {algo} N={n} size={size} timed out")
            if p.returncode != 0:
                raise RuntimeError(f"gloo {algo} exited {p.returncode}: {e[-2000:]}")
            outs.append(o)
        return next(peer_lines(outs[0]))[1]
    finally:
        shutil.rmtree(store, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-B", "--builddir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
    ap.add_argument("--sizes", default="8,64K,1M,16M,256M")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("-r", "--repeats", type=int, default=3)
    ap.add_argument("-w", "--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny run for tests: 8 B and 64 KiB, N=2, 1 repeat")
    ap.add_argument("-J", "--json", help="write the table as JSON")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per contender run")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.ranks, args.repeats, args.warmup = "8,64K", "2", 1, 1
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ranks = [int(n) for n in args.ranks.split(",")]
    bench = os.path.join(args.builddir, "bench")
    exe = {k: os.path.join(bench, k) for k in
           ("all_reduce_perf", "all_reduce_perf_mpi", "mpi_allreduce_peer", "gloo_allreduce_peer")}
    have = {k: os.access(v, os.X_OK) for k, v in exe.items()}
    if not have["all_reduce_perf"]:
        sys.exit(f"compare: {exe['all_reduce_perf']} is not built")
    have_mpirun = shutil.which("mpirun") is not None
    for k in ("all_reduce_perf_mpi", "mpi_allreduce_peer", "gloo_allreduce_peer"):
        if not have[k] or (k != "gloo_allreduce_peer" and not have_mpirun):
            have[k] = False
            print(f"# skipping {k}: not built or no mpirun", file=sys.stderr)
    common = ["-r", str(args.repeats), "-w", str(args.warmup), "-c", "1", "-d", "float", "-o", "sum"]
    tmp = tempfile.mkdtemp(prefix="gradsync-compare-")
    results = []  # {N, size, contender, time_us, busbw_GBps}
    memcpy = []
    wrong = 0
    loads = [os.getloadavg()[0]]
    try:
        for size in sizes:
            for n in ranks:
                sz = ["-b", str(size), "-e", str(size)]
                print(f"# size {human(size)} N={n} ...", file=sys.stderr, flush=True)
                rows = {}
                r, mc = gradsync_run([exe["all_reduce_perf"], "-t", str(n), "--algo", "all"] + sz + common,
                                     os.path.join(tmp, "t.json"), args.timeout)
                memcpy.append(mc)
                for a, v in r.items():
                    rows["threads/" + a] = v
                if have["all_reduce_perf_mpi"]:
                    r, _ = gradsync_run(MPIRUN + ["-np", str(n), exe["all_reduce_perf_mpi"], "--backend", "mpi",
                                                  "--algo", "all"] + sz + common,
                                        os.path.join(tmp, "m.json"), args.timeout)
                    for a, v in r.items():
                        rows["mpi/" + a] = v
                if have["mpi_allreduce_peer"]:
                    for name, extra in (("MPI_Allreduce", []), ("MPI_Allreduce/ring", OMPI_RING)):
                        out = run(MPIRUN + extra + ["-np", str(n), exe["mpi_allreduce_peer"], "-r", str(args.repeats),
                                                    "-w", str(args.warmup), str(size)], args.timeout)
                        rows[name] = {"time_us": next(peer_lines(out))[1]}
                if have["gloo_allreduce_peer"]:
                    for g in GLOO:
                        rows["gloo/" + g] = {"time_us": gloo_run(exe["gloo_allreduce_peer"], n, g, size, args,
                                                                 args.timeout)}
                for name, v in rows.items():
                    wrong += v.get("wrong", 0) or 0
                    results.append(dict(N=n, size=size, contender=name, busbw_GBps=busbw(size, v["time_us"], n), **v))
                loads.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    ceiling = max(memcpy)
    contenders = []
    for r in results:
        if r["contender"] not in contenders:
            contenders.append(r["contender"])
    get = {(r["N"], r["size"], r["contender"]): r for r in results}
    ratios = []
    print(f"# gradsync compare: float sum, busbw GB/s (GB = 1e9) = S/t * 2(N-1)/N; (x%) = busbw / memcpy ceiling")
    print(f"# memcpy ceiling (read+write, best of {len(memcpy)} in-run measurements): {ceiling:.2f} GB/s; "
          f"load average during the run: {min(loads):.2f}-{max(loads):.2f} on {os.cpu_count()} CPUs")
    for n in ranks:
        print(f"#\n# N = {n}")
        print(f"{'contender':<22}" + "".join(f"{human(s):>16}" for s in sizes))
        for c in contenders:
            cells = []
            for s in sizes:
                r = get.get((n, s, c))
                cells.append(f"{r['busbw_GBps']:7.3f} ({100 * r['busbw_GBps'] / ceiling:4.1f}%)" if r else "-")
            print(f"{c:<22}" + "".join(f"{x:>16}" for x in cells))
        print(f"# time at {human(sizes[0])} (us): " + ", ".join(
            f"{c} {get[(n, sizes[0], c)]['time_us']:.2f}" for c in contenders if (n, sizes[0], c) in get))
        lines = []
        for s in sizes:
            def bw(c):
                r = get.get((n, s, c))
                return r["busbw_GBps"] if r else None
            gs = [c for c in contenders if c.startswith(("threads/", "mpi/"))]
            best_gs = max(gs, key=lambda c: bw(c) or 0) if gs else None
            gl = [c for c in contenders if c.startswith("gloo/")]
            best_gl = max(gl, key=lambda c: bw(c) or 0) if gl else None
            q = {"N": n, "size": s, "best_gradsync": best_gs, "best_gloo": best_gl}
            if bw("threads/native") and bw("MPI_Allreduce"):
                q["native_threads_over_MPI_Allreduce"] = bw("threads/native") / bw("MPI_Allreduce")
            if bw("mpi/native") and bw("MPI_Allreduce"):
                q["native_mpi_over_MPI_Allreduce"] = bw("mpi/native") / bw("MPI_Allreduce")
            if bw("mpi/ring") and bw("MPI_Allreduce/ring"):
                q["mpi_ring_over_ompi_ring"] = bw("mpi/ring") / bw("MPI_Allreduce/ring")
            if best_gs and best_gl and bw(best_gl):
                q["best_gradsync_over_best_gloo"] = bw(best_gs) / bw(best_gl)
            ratios.append(q)
            lines.append(q)
        for key, label in (("native_threads_over_MPI_Allreduce", "native(thr)/MPI_Ar"),
                           ("native_mpi_over_MPI_Allreduce", "native(mpi)/MPI_Ar"),
                           ("mpi_ring_over_ompi_ring", "mpi/ring/OMPI ring"),
                           ("best_gradsync_over_best_gloo", "best gs/best gloo")):
            if any(key in q for q in lines):
                print(f"{label:<22}" + "".join(f"{q[key]:>15.2f}x" if key in q else f"{'-':>16}" for q in lines))
        print(f"{'best gradsync':<22}" + "".join(f"{(q['best_gradsync'] or '-'):>16}" for q in lines))
    if wrong:
        print(f"# FAILED: {wrong} wrong elements in gradsync results")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "compare", "memcpy_GBps": ceiling, "memcpy_samples_GBps": memcpy,
                       "load_average": loads, "cpus": os.cpu_count(), "sizes": sizes, "ranks": ranks,
                       "repeats": args.repeats, "warmup": args.warmup, "results": results, "ratios": ratios},
                      f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"compare: {e}", file=sys.stderr)
        sys.exit(2)

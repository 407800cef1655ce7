// gloo_allreduce_peer: one rank of Gloo's all-reduce (float sum, in place) over
// the TCP transport on 127.0.0.1, for bench/compare.py, timed the way
// all_reduce_perf times gradsync. Launch SIZE processes, one per rank:
//   gloo_allreduce_peer RANK SIZE STORE_DIR ring|ring_chunked|halving_doubling [-r R] [-w W] BYTES...
// STORE_DIR is an empty directory shared by the ranks (a gloo FileStore).
// Rank 0 prints one line per size: <bytes> <time_us> <busbw_GBps>, where time is
// the per-call mean of back-to-back calls, max over ranks, median over repeats.

#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/barrier_all_to_all.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

std::unique_ptr<gloo::Algorithm> make(const std::string& algo, const std::shared_ptr<gloo::Context>& ctx,
                                      float* data, int count) {
  const std::vector<float*> ptrs{data};
  if (algo == "ring") return std::make_unique<gloo::AllreduceRing<float>>(ctx, ptrs, count);
  if (algo == "ring_chunked") return std::make_unique<gloo::AllreduceRingChunked<float>>(ctx, ptrs, count);
  if (algo == "halving_doubling") return std::make_unique<gloo::AllreduceHalvingDoubling<float>>(ctx, ptrs, count);
  throw std::runtime_error("unknown algorithm " + algo);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 5) {
      std::fprintf(stderr, "usage: %s RANK SIZE STORE_DIR ring|ring_chunked|halving_doubling [-r R] [-w W] BYTES...\n",
                   argv[0]);
      return 2;
    }
    const int rank = std::atoi(argv[1]);
    const int world = std::atoi(argv[2]);
    const std::string dir = argv[3], algo = argv[4];
    int repeats = 5, warmup = 5;
    std::vector<std::size_t> sizes;
    for (int i = 5; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "-r" && i + 1 < argc) repeats = std::max(1, std::atoi(argv[++i]));
      else if (a == "-w" && i + 1 < argc) warmup = std::max(0, std::atoi(argv[++i]));
      else sizes.push_back(static_cast<std::size_t>(std::strtoull(a.c_str(), nullptr, 10)));
    }
    gloo::transport::tcp::attr attr("127.0.0.1");
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore store(dir);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, world);
    ctx->connectFullMesh(store, dev);
    const std::shared_ptr<gloo::Context> base = ctx;

    double shared_value = 0;  // max over ranks, through a separate small all-reduce
    gloo::AllreduceRing<double> max_op(base, {&shared_value}, 1, gloo::ReductionFunction<double>::max);
    gloo::BarrierAllToAll barrier(base);

    const std::size_t max_bytes = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
    std::vector<float> data(std::max<std::size_t>(max_bytes / sizeof(float), 1), 0.0f);  // zeros: sums stay finite
    if (rank == 0) std::printf("# gloo_allreduce_peer: %s, world %d, tcp 127.0.0.1, float sum, in place\n", algo.c_str(), world);
    for (const std::size_t bytes : sizes) {
      const int count = static_cast<int>(std::max<std::size_t>(bytes / sizeof(float), 1));
      auto op = make(algo, base, data.data(), count);
      for (int i = 0; i < warmup; ++i) op->run();
      auto batch = [&](int n) {
        barrier.run();
        const auto t0 = Clock::now();
        for (int i = 0; i < n; ++i) op->run();
        shared_value = std::chrono::duration<double>(Clock::now() - t0).count() / n;
        max_op.run();
        return shared_value;
      };
      double per_call = 0;
      for (int n = 1;; n *= 2) {
        per_call = batch(n);
        if (per_call * n >= 0.01 || n >= 100000) break;
      }
      const int iters = static_cast<int>(std::clamp(0.2 / repeats / std::max(per_call, 1e-9), 3.0, 100000.0));
      std::vector<double> t;
      for (int r = 0; r < repeats; ++r) t.push_back(batch(iters));
      std::sort(t.begin(), t.end());
      const double median = t.size() % 2 ? t[t.size() / 2] : (t[t.size() / 2 - 1] + t[t.size() / 2]) / 2;
      const double b = static_cast<double>(count) * sizeof(float);
      if (rank == 0) {
        std::printf("%zu %.3f %.4f\n", static_cast<std::size_t>(b), median * 1e6,
                    b / median / 1e9 * 2.0 * (world - 1) / world);
        std::fflush(stdout);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gloo_allreduce_peer: %s\n", e.what());
    return 1;
  }
}

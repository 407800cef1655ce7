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

#include "peer/timing.hpp"

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
    const bench::peer::Args args = bench::peer::parse_args(argc, argv, 5);
    gloo::transport::tcp::attr attr("127.0.0.1");
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore store(dir);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, world);
    ctx->connectFullMesh(store, dev);
    const std::shared_ptr<gloo::Context> base = ctx;

    double shared_value = 0;  // max over ranks, through a separate small all-reduce
    gloo::AllreduceRing<double> max_op(base, {&shared_value}, 1, gloo::ReductionFunction<double>::max);
    gloo::BarrierAllToAll barrier(base);

    std::vector<float> data(std::max<std::size_t>(args.max_bytes() / sizeof(float), 1), 0.0f);  // zeros: sums stay finite
    if (rank == 0) std::printf("# gloo_allreduce_peer: %s, world %d, tcp 127.0.0.1, float sum, in place\n", algo.c_str(), world);
    for (const std::size_t bytes : args.sizes) {
      const int count = bench::peer::float_count(bytes);
      auto op = make(algo, base, data.data(), count);
      for (int i = 0; i < args.warmup; ++i) op->run();
      auto batch = [&](int n) {
        barrier.run();
        const auto t0 = Clock::now();
        for (int i = 0; i < n; ++i) op->run();
        shared_value = std::chrono::duration<double>(Clock::now() - t0).count() / n;
        max_op.run();
        return shared_value;
      };
      const double t = bench::peer::median_per_call(batch, args.repeats);
      // The timed calls sum zeros; one more on rank + 1 each checks what moved
      // (the sum of 1..world, exact in float), then the zeros are put back.
      std::fill(data.begin(), data.begin() + count, static_cast<float>(rank + 1));
      op->run();
      if (!bench::peer::check_result("gloo_allreduce_peer", data.data(), count,
                                     static_cast<float>(world * (world + 1) / 2), rank)) {
        return 1;
      }
      std::fill(data.begin(), data.begin() + count, 0.0f);
      if (rank == 0) bench::peer::print_row(count, t, world);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gloo_allreduce_peer: %s\n", e.what());
    return 1;
  }
}

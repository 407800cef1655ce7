// all_reduce_demo: four in-process ranks average a gradient, as data-parallel
// training does after every backward pass, then time the same call at 64 MiB.

#include <gradsync/collectives.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

namespace {

constexpr int world_size = 4;
constexpr std::size_t grad_count = std::size_t{1} << 20;  // 1M floats, a small model
constexpr std::size_t bench_count = std::size_t{16} << 20;  // 64 MiB of floats
constexpr int bench_iters = 20;

// Rank r's gradient: the same shape on every rank, scaled by r + 1, so the
// average is a known 2.5x the shape.
float shape(std::size_t i) { return 0.01f * static_cast<float>(i % 97) - 0.5f; }
float gradient(int rank, std::size_t i) { return shape(i) * static_cast<float>(rank + 1); }
double expected(std::size_t i) { return shape(i) * (1 + 2 + 3 + 4) / 4.0; }

// A hash of the exact bits: equal on all ranks only if the buffers are equal.
std::int64_t checksum(std::span<const float> x) {
  std::uint64_t h = 14695981039346656037ull;  // FNV-1a
  for (float v : x) h = (h ^ std::bit_cast<std::uint32_t>(v)) * 1099511628211ull;
  return static_cast<std::int64_t>(h);
}

/// Returns, on rank 0, whether the result is right and the same everywhere.
bool average_gradient(gradsync::Communicator<gradsync::Threads>& comm) {
  std::vector<float> grad(grad_count);
  for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = gradient(comm.rank(), i);

  gradsync::AllReduce<>{}(comm, std::span<float>(grad), gradsync::Avg{});

  // Agreement check through the library itself: if the max and the min of
  // the checksums over ranks are equal, every rank holds the same bits.
  std::int64_t hi = checksum(grad), lo = hi;
  gradsync::AllReduce<>{}(comm, std::span<std::int64_t>(&hi, 1), gradsync::Max{});
  gradsync::AllReduce<>{}(comm, std::span<std::int64_t>(&lo, 1), gradsync::Min{});

  if (comm.rank() != 0) return true;
  double max_error = 0;
  for (std::size_t i = 0; i < grad.size(); ++i) max_error = std::max(max_error, std::abs(grad[i] - expected(i)));
  std::printf("averaged gradient over %d ranks, %zu floats\n", comm.size(), grad.size());
  for (std::size_t i = 0; i < 5; ++i) std::printf("  g[%zu] = %+.6f   expected %+.6f\n", i, grad[i], expected(i));
  std::printf("max |error| = %.2g (float rounding)\n", max_error);
  std::printf("all ranks agree: %s\n", hi == lo ? "yes" : "NO");
  const auto why = gradsync::explain(comm, gradsync::Collective::all_reduce, grad.size() * sizeof(float));
  std::printf("auto chose %s for this %zu-byte call\n", std::string(why.chosen).c_str(), grad.size() * sizeof(float));
  return hi == lo && max_error < 1e-5;
}

void measure_bandwidth(gradsync::Communicator<gradsync::Threads>& comm) {
  // Allocated and touched before timing: first touch of fresh pages costs
  // more than the all-reduce itself.
  std::vector<float> buf(bench_count, 1.0f);
  const std::size_t bytes = buf.size() * sizeof(float);
  gradsync::AllReduce<>{}(comm, std::span<float>(buf), gradsync::Avg{});  // warm-up
  comm.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < bench_iters; ++i) gradsync::AllReduce<>{}(comm, std::span<float>(buf), gradsync::Avg{});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / bench_iters;

  if (comm.rank() != 0) return;
  const auto why = gradsync::explain(comm, gradsync::Collective::all_reduce, bytes);
  const double busbw = bytes / seconds / 1e9 * 2.0 * (comm.size() - 1) / comm.size();
  std::printf("auto chose %s for %zu bytes (predicted %.0f us)\n", std::string(why.chosen).c_str(), bytes,
              std::ranges::min(why.candidates, {}, &gradsync::Prediction::seconds).seconds * 1e6);
  std::printf("%d x all-reduce of %zu MiB: %.1f ms each, busbw %.2f GB/s (GB = 1e9 B)\n", bench_iters, bytes >> 20,
              seconds * 1e3, busbw);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) {
    std::fprintf(stderr, "usage: %s (it takes no options; got %s)\n", argv[0], argv[1]);
    return 2;
  }
  bool ok = true;
  gradsync::run_threads(world_size, [&](gradsync::Communicator<gradsync::Threads>& comm) {
    const bool good = average_gradient(comm);
    if (comm.rank() == 0) ok = good;
    measure_bandwidth(comm);
  });
  return ok ? 0 : 1;
}

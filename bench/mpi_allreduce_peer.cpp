// mpi_allreduce_peer: plain MPI_Allreduce (float sum, out of place), timed the
// way all_reduce_perf times gradsync, for bench/compare.py. Run under mpirun:
//   mpirun -np N mpi_allreduce_peer [-r REPEATS] [-w WARMUP] SIZE...
// Each SIZE is in bytes. Rank 0 prints one line per size:
//   <bytes> <time_us> <busbw_GBps>
// time = per-call mean of back-to-back calls (iterations sized to fill about
// 0.2 s over all repeats), max over ranks, median over repeats.

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double max_over_ranks(double v) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

double time_batch(const float* send, float* recv, int count, int n) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  return max_over_ranks(std::chrono::duration<double>(Clock::now() - t0).count() / n);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  int repeats = 5, warmup = 5;
  std::vector<std::size_t> sizes;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-r" && i + 1 < argc) repeats = std::max(1, std::atoi(argv[++i]));
    else if (a == "-w" && i + 1 < argc) warmup = std::max(0, std::atoi(argv[++i]));
    else sizes.push_back(static_cast<std::size_t>(std::strtoull(a.c_str(), nullptr, 10)));
  }
  const std::size_t max_bytes = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
  std::vector<float> send(std::max<std::size_t>(max_bytes / sizeof(float), 1), 1.0f);
  std::vector<float> recv(send.size(), 0.0f);  // touched up front: first touch is slow
  if (rank == 0) std::printf("# mpi_allreduce_peer: world %d, float sum, out of place\n", world);
  for (const std::size_t bytes : sizes) {
    const int count = static_cast<int>(std::max<std::size_t>(bytes / sizeof(float), 1));
    for (int i = 0; i < warmup; ++i) MPI_Allreduce(send.data(), recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double per_call = 0;
    for (int n = 1;; n *= 2) {
      per_call = time_batch(send.data(), recv.data(), count, n);
      if (per_call * n >= 0.01 || n >= 100000) break;
    }
    const int iters = static_cast<int>(std::clamp(0.2 / repeats / std::max(per_call, 1e-9), 3.0, 100000.0));
    std::vector<double> t;
    for (int r = 0; r < repeats; ++r) t.push_back(time_batch(send.data(), recv.data(), count, iters));
    std::sort(t.begin(), t.end());
    const double median = t.size() % 2 ? t[t.size() / 2] : (t[t.size() / 2 - 1] + t[t.size() / 2]) / 2;
    const double b = static_cast<double>(count) * sizeof(float);
    if (rank == 0) {
      std::printf("%zu %.3f %.4f\n", static_cast<std::size_t>(b), median * 1e6,
                  b / median / 1e9 * 2.0 * (world - 1) / world);
      std::fflush(stdout);
    }
  }
  MPI_Finalize();
  return 0;
}

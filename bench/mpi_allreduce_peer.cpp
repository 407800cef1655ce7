// mpi_allreduce_peer: plain MPI_Allreduce (float sum, out of place), timed the
// way all_reduce_perf times gradsync, for bench/compare.py. Run under mpirun:
//   mpirun -np N mpi_allreduce_peer [-r REPEATS] [-w WARMUP] SIZE...
// Each SIZE is in bytes. Rank 0 prints one line per size:
//   <bytes> <time_us> <busbw_GBps>
// time = per-call mean of back-to-back calls (iterations sized to fill about
// 0.2 s over all repeats), max over ranks, median over repeats.

#include <mpi.h>

#include "peer/timing.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
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
  const bench::peer::Args args = bench::peer::parse_args(argc, argv, 1);
  std::vector<float> send(std::max<std::size_t>(args.max_bytes() / sizeof(float), 1), 1.0f);
  std::vector<float> recv(send.size(), 0.0f);  // touched up front: first touch is slow
  if (rank == 0) std::printf("# mpi_allreduce_peer: world %d, float sum, out of place\n", world);
  for (const std::size_t bytes : args.sizes) {
    const int count = bench::peer::float_count(bytes);
    for (int i = 0; i < args.warmup; ++i) MPI_Allreduce(send.data(), recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    const double t = bench::peer::median_per_call(
        [&](int n) { return time_batch(send.data(), recv.data(), count, n); }, args.repeats);
    // Every rank sends ones: the last call's sum is the world size, exactly.
    if (!bench::peer::check_result("mpi_allreduce_peer", recv.data(), count, static_cast<float>(world), rank)) {
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (rank == 0) bench::peer::print_row(count, t, world);
  }
  MPI_Finalize();
  return 0;
}

// mpi_exchange: the MPI transport's cost of one message by size, where the
// Mpi backend's cost model (backend/mpi.hpp) takes eager_bytes and
// rendezvous_alpha from. Two ranks post a receive and a send to each other
// and wait for both, as every step of gradsync's algorithms does; the time
// per exchange is the best of 7 batches. The jump between two sizes a few
// bytes apart is the eager limit (Open MPI's shared memory: 4 KiB including
// its header), and its height the rendezvous handshake.
//
//   mpirun -np 2 --bind-to none mpi_exchange [SIZE...]   (bytes; K, M suffixes)

#include <mpi.h>

#include "perf/args.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<std::size_t> sizes;
  try {
    for (int i = 1; i < argc; ++i) sizes.push_back(bench::parse_bytes("size", argv[i]));
  } catch (const std::invalid_argument& e) {
    if (rank == 0) std::fprintf(stderr, "mpi_exchange: %s\nusage: mpirun -np 2 mpi_exchange [SIZE...]\n", e.what());
    MPI_Finalize();
    return 2;
  }
  if (size != 2) {
    if (rank == 0) std::fprintf(stderr, "mpi_exchange: run it with mpirun -np 2\n");
    MPI_Finalize();
    return 2;
  }
  if (sizes.empty()) sizes = {8, 1024, 2048, 4000, 4032, 4048, 4096, 8192, 16384, 65536};
  const std::size_t largest = *std::max_element(sizes.begin(), sizes.end());
  std::vector<char> out(std::max<std::size_t>(largest, 1)), in(out.size());
  if (rank == 0) std::printf("# mpi_exchange: 2 ranks, isend + irecv + waitall, best of 7 batches\n# %10s %12s\n", "bytes", "us");
  for (const std::size_t n : sizes) {
    const int count = static_cast<int>(n);
    double best = 1e30;
    for (int batch = 0; batch < 7; ++batch) {
      const int iters = 2000;
      MPI_Barrier(MPI_COMM_WORLD);
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) {
        MPI_Request req[2];
        MPI_Irecv(in.data(), count, MPI_BYTE, 1 - rank, 0, MPI_COMM_WORLD, &req[0]);
        MPI_Isend(out.data(), count, MPI_BYTE, 1 - rank, 0, MPI_COMM_WORLD, &req[1]);
        MPI_Waitall(2, req, MPI_STATUSES_IGNORE);
      }
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters);
    }
    if (rank == 0) std::printf("  %10zu %12.2f\n", n, best * 1e6);
  }
  MPI_Finalize();
  return 0;
}

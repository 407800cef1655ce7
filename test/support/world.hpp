#pragma once
// Runs one test body on every backend it is compiled for. Built plainly, a
// world of n ranks is n threads (run_threads) and this process sees every
// rank; built with GRADSYNC_TEST_MPI, the world is the mpirun job, a case
// runs only when n equals its size, and each process sees its own rank.
// Test bodies hold data for all n ranks, fill it identically everywhere
// (one seed for the job), and check the ranks listed by local_ranks(n).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/gradsync.hpp"
#ifdef GRADSYNC_TEST_MPI
#include "gradsync/backend/mpi.hpp"
#endif

namespace test {

#ifdef GRADSYNC_TEST_MPI

inline int mpi_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
inline int mpi_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline constexpr const char* backend_name = "mpi";
using Backend = gradsync::Mpi;
inline bool world_has(int n) { return n == mpi_size(); }
inline std::vector<std::size_t> local_ranks(int) { return {static_cast<std::size_t>(mpi_rank())}; }

template <class F>
void run_world(int n, F&& body) {
  if (!world_has(n)) return;
  gradsync::Communicator<gradsync::Mpi> comm(MPI_COMM_WORLD);
  comm.set_timeout(std::chrono::seconds(120));
  body(comm);
}

/// Every rank's value of x, in rank order.
inline std::vector<std::uint64_t> all_values(int n, const std::vector<std::uint64_t>& mine_by_rank) {
  std::vector<std::uint64_t> all(static_cast<std::size_t>(n));
  const std::uint64_t mine = mine_by_rank[static_cast<std::size_t>(mpi_rank())];
  MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
  return all;
}

#else

inline constexpr const char* backend_name = "threads";
using Backend = gradsync::Threads;
inline bool world_has(int) { return true; }
inline std::vector<std::size_t> local_ranks(int n) {
  std::vector<std::size_t> r(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < r.size(); ++i) r[i] = i;
  return r;
}

template <class F>
void run_world(int n, F&& body) {
  gradsync::run_threads(n, std::forward<F>(body));
}

inline std::vector<std::uint64_t> all_values(int, const std::vector<std::uint64_t>& by_rank) { return by_rank; }

#endif

/// FNV-1a of a buffer's bytes: equal bits, equal hash.
inline std::uint64_t hash_bytes(const void* p, std::size_t bytes) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

}  // namespace test

#ifdef GRADSYNC_TEST_MPI
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

// One seed for the whole job (rank 0's), so every process draws the same
// inputs; a failure on any rank fails the job, and each rank prints its own
// summary line.
int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  std::uint64_t seed = 0;
  if (const char* env = std::getenv("GRADSYNC_TEST_SEED")) {
    seed = std::strtoull(env, nullptr, 0);
  } else {
    std::random_device rd;
    seed = (std::uint64_t{rd()} << 32) ^ std::uint64_t{rd()};
  }
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  setenv("GRADSYNC_TEST_SEED", std::to_string(seed).c_str(), 1);
  doctest::Context ctx(argc, argv);
  int rc = ctx.run();
  std::printf("rank %d of %d (mpi): %s, seed %llu\n", test::mpi_rank(), test::mpi_size(), rc ? "FAILED" : "passed",
              static_cast<unsigned long long>(seed));
  int worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
#else
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
#endif

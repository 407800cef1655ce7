#pragma once
// Runs one test body on every backend it is compiled for. Built plainly, a
// world of n ranks is n threads (run_threads) and this process sees every
// rank; built with GRADSYNC_TEST_MPI, the world is the mpirun job, a case
// runs only when n equals its size, and each process sees its own rank.
// Test bodies hold data for all n ranks, fill it identically everywhere
// (one seed for the job: support/main.cpp), and check the ranks listed by
// local_ranks(n).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "gradsync/collectives.hpp"
#ifdef GRADSYNC_TEST_MPI
#include "gradsync/backend/mpi.hpp"
#include "idle_mpi.hpp"
#endif
#include "instances.hpp"

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

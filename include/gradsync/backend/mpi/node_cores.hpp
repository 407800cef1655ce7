#pragma once
/// \file node_cores: how many cores the ranks on one host may use together,
/// which decides whether a waiting rank may spin (Spinner).

#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <thread>

#include "gradsync/core/spinner.hpp"

namespace gradsync::detail::mpi {

/// The union of the affinity masks of the ranks of `node` (one host's
/// ranks), since a rank bound to one core sees only that one. Collective
/// over `node`, so every rank takes part even where its mask cannot be
/// read. `rc` is MPI's code for the exchange.
inline int node_cores(MPI_Comm node, int& rc) {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) {
    const int n = static_cast<int>(std::thread::hardware_concurrency());
    for (int c = 0; c < n && c < CPU_SETSIZE; ++c) CPU_SET(c, &set);
  }
  rc = MPI_Allreduce(MPI_IN_PLACE, &set, static_cast<int>(sizeof(set)), MPI_BYTE, MPI_BOR, node);
  return std::max(1, CPU_COUNT(&set));
#else
  (void)node;
  rc = MPI_SUCCESS;
  return usable_cores();
#endif
}

}  // namespace gradsync::detail::mpi

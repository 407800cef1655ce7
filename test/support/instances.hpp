#pragma once
// The collectives every test runs, compiled once per build rather than in
// every test file: each primitive goes through detail::launch<Collective,
// Algo, Backend> (collective/launch.hpp), and everything below it (the
// algorithms, Auto's table, the backend's endpoint calls) is instantiated
// there. The declarations below keep a test file from instantiating it;
// support/instances.cpp (built with the test support library) holds the one
// instantiation of each, for Threads and, in the Mpi suites, for Mpi. The
// bench tools link them too (bench/perf/shared_launches.hpp), where
// bench/meson.build says.

#include <cstddef>

#include "gradsync/collectives.hpp"
#ifdef GRADSYNC_TEST_MPI
#include "gradsync/backend/mpi.hpp"
#endif

/// X(collective, algorithm) for every collective and algorithm.
#define GRADSYNC_TEST_FOR_EACH_LAUNCH(X, B)                                                       \
  X(all_reduce, Ring, B) X(all_reduce, Tree, B) X(all_reduce, RecursiveHalvingDoubling, B)        \
  X(all_reduce, Native, B) X(all_reduce, Auto, B)                                                  \
  X(reduce_scatter, Ring, B) X(reduce_scatter, Tree, B) X(reduce_scatter, RecursiveHalvingDoubling, B) \
  X(reduce_scatter, Native, B) X(reduce_scatter, Auto, B)                                          \
  X(all_gather, Ring, B) X(all_gather, Tree, B) X(all_gather, RecursiveHalvingDoubling, B)        \
  X(all_gather, Native, B) X(all_gather, Auto, B)                                                  \
  X(broadcast, Ring, B) X(broadcast, Tree, B) X(broadcast, RecursiveHalvingDoubling, B)           \
  X(broadcast, Native, B) X(broadcast, Auto, B)

#define GRADSYNC_TEST_EXTERN_LAUNCH(C, A, B)                                                        \
  extern template void gradsync::detail::launch<gradsync::Collective::C, gradsync::A, gradsync::B>( \
      gradsync::Communicator<gradsync::B>&, const gradsync::detail::Operands&, std::size_t);

GRADSYNC_TEST_FOR_EACH_LAUNCH(GRADSYNC_TEST_EXTERN_LAUNCH, Threads)
#ifdef GRADSYNC_TEST_MPI
GRADSYNC_TEST_FOR_EACH_LAUNCH(GRADSYNC_TEST_EXTERN_LAUNCH, Mpi)
#endif

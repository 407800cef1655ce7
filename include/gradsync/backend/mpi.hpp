#pragma once
/// \file The Mpi backend: ranks as MPI processes, on one host or many.
///
/// Opt-in: include this header (it includes <mpi.h>) and build with MPI.
/// `gradsync::Communicator<gradsync::Mpi> comm(MPI_COMM_WORLD);` duplicates
/// the communicator, initialising MPI first if the program has not.

#include <mpi.h>

#include "gradsync/backend/mpi/endpoint.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/cost_model.hpp"

namespace gradsync {

/// Backend policy: one rank per MPI process.
struct Mpi {
  using Endpoint = detail::mpi::Endpoint;

  /// Cost-model constants for Auto over Open MPI 4.1 shared memory (vader),
  /// set by hand for the 2-core development VM, not yet fitted: run
  /// `mpirun -np 2 all_reduce_perf_mpi --backend mpi --calibrate` and pass its
  /// line as GRADSYNC_COST_MODEL. Native is MPI's own collective, whose
  /// synchronisation cost is native_alpha.
  static constexpr CostModel cost_model{
      .alpha = 1.0e-6,
      .beta = 1.0 / 6.0e9,
      .gamma = 1.0 / 9.0e9,
      .native_alpha = 0.5e-6,
  };
};

}  // namespace gradsync

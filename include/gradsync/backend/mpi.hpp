#pragma once
/// \file The Mpi backend: ranks as MPI processes, on one host or many.
///
/// Opt-in: include this header (it includes <mpi.h>) and build with MPI.
/// `gradsync::Communicator<gradsync::Mpi> comm(MPI_COMM_WORLD);` duplicates
/// the communicator, initialising MPI first if the program has not.
/// `Communicator<Mpi> comm(MPI_COMM_WORLD, MpiOptions{.check_calls = false});`
/// sets options (MpiOptions); every rank must pass the same ones.
///
/// Ranks agree or fail together: every call is checked against the other
/// ranks' (a mismatch throws InvalidArgument on every rank, naming both
/// calls), and a rank that fails, or destroys its communicator while others
/// still wait for it, tells them so, and they fail at once naming it.

#include <mpi.h>

#include "gradsync/backend/mpi/endpoint.hpp"
#include "gradsync/backend/mpi/mpi_options.hpp"
#include "gradsync/core/backend_traits.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/cost_model.hpp"

namespace gradsync {

/// Backend policy: one rank per MPI process.
struct Mpi {
  using Endpoint = detail::mpi::Endpoint;

  /// Host memory; Native is MPI's own collective, whose order is MPI's
  /// business; ranks know their host (MPI_COMM_TYPE_SHARED); split is
  /// MPI_Comm_split.
  static constexpr Capabilities capabilities{
      .native_collectives = true,
      .native_rank_ordered = false,
      .knows_hosts = true,
      .split = true,
  };

  /// Cost-model constants for Auto over Open MPI 4.1 shared memory (vader),
  /// fitted by `mpirun -np 2 all_reduce_perf_mpi --backend mpi --calibrate`
  /// on the 2-core development VM (2026-11-29, rounded). Native is MPI's own
  /// collective: native_alpha is its synchronisation cost and native_beta its
  /// per-byte cost, fitted apart from gradsync's point-to-point beta because
  /// Open MPI picks its own algorithm (its default all-reduce took 3.7x the
  /// time of gradsync's ring at 64 MiB here). On another machine or network,
  /// rerun it and export its line as GRADSYNC_COST_MODEL.
  ///
  /// eager_bytes and rendezvous_alpha are Open MPI's shared-memory transport
  /// (btl vader, eager limit 4096 B including its header): `mpirun -np 2
  /// mpi_exchange` on the same VM (2026-11-30) jumps between 4032 and 4048 B
  /// by 1.6-2.5 us over runs (0.73 -> 2.53 us per exchange in one, 1.00 ->
  /// 3.48 in bench/results/mpi_exchange.txt); rendezvous_alpha is the
  /// smallest jump seen, 1.6 us.
  static constexpr CostModel cost_model{
      .alpha = 0.5e-6,
      .beta = 3.3e-10,
      .gamma = 1.6e-10,
      .native_alpha = 0.6e-6,
      .native_beta = 1.4e-9,
      .eager_bytes = 4032,
      .rendezvous_alpha = 1.6e-6,
  };
};

}  // namespace gradsync

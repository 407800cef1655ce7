#pragma once
/// \file MpiOptions: how an Mpi communicator behaves, fixed at construction.

#include <cstdint>

namespace gradsync {

/// What an Mpi communicator does when a collective fails on this rank.
enum class MpiFailurePolicy : std::uint8_t {
  /// Throw (Timeout, InvalidArgument, Aborted, ...) and leave the job to the
  /// caller. The other ranks are told and fail fast; the communicator is
  /// unusable from then on.
  throw_error,
  /// Print the error to stderr and MPI_Abort the whole job, so that no
  /// process anywhere is left waiting.
  abort_job,
};

/// Options of an Mpi communicator:
/// `Communicator<Mpi> comm(MPI_COMM_WORLD, MpiOptions{.check_calls = false});`
/// Every rank must pass the same options.
struct MpiOptions {
  MpiFailurePolicy failure_policy = MpiFailurePolicy::throw_error;
  /// Check on every call that all ranks called the same collective with the
  /// same arguments (count, type, op, root, algorithm, chunking,
  /// deterministic, sequence number), so that a mismatch throws
  /// InvalidArgument on every rank instead of corrupting data or crashing in
  /// MPI. It costs a 16-byte MPI_Iallreduce per call, overlapped with the
  /// call's own messages except under Native, which must wait for it before
  /// starting MPI's collective. That is felt only on tiny calls: at 8 B an
  /// all-reduce takes 1.4-2.6x as long (Auto, N=2: 1.6 us against 0.7 us
  /// unchecked; N=4 on 2 cores: 29-79 us against 21-41 us); from 64 KiB the
  /// two are within noise (0.95-1.13). `mpirun -np N mpi_interleaved -r 21 8
  /// 64K` on the 2-core development VM (2026-12-01, machine loaded), columns
  /// auto and auto/nc. Turn it off for latency-bound loops once the program
  /// is known to call collectives alike on every rank.
  bool check_calls = true;
};

}  // namespace gradsync

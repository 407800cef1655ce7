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
  /// starting MPI's collective (see bench/mpi_interleaved.cpp for figures).
  bool check_calls = true;
};

}  // namespace gradsync

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
  /// process anywhere is left waiting. Since a failed call then never
  /// returns, Native hands MPI the caller's buffers directly; under
  /// throw_error it stages them through the endpoint's own (MPI cannot
  /// cancel a collective that a throw left behind), which made a 16 MiB
  /// out-of-place Native all-reduce 1.5-1.7x slower on one host.
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
  /// MPI. When every rank runs on one host it costs no message: each rank
  /// writes its call's hash to shared memory and reads the others'. Across
  /// hosts it costs a 16-byte recursive-doubling exchange per call (lg p
  /// rounds), overlapped with the call's own messages. Native waits for the
  /// verdict before starting MPI's collective either way. On one host, 8 B
  /// Auto all-reduce, checked / unchecked: N=2 1.1-1.45 (run medians; e.g.
  /// 0.85-1.04 us against 0.61-0.80 us), N=4 0.88-1.03; by messages
  /// (GRADSYNC_MPI_AGREEMENT=messages) N=2 1.6 (0.9 us against 0.55 us); an
  /// MPI_Iallreduce of the 16 bytes costs 2.4-3.7 at N=2, 1.1-2.4 at N=4. From
  /// 64 KiB all are within noise (0.85-1.08). `mpirun -np N mpi_interleaved
  /// -r 21 8 8 64K`, column check/nc, on the 2-core development VM
  /// (2026-12-01, load 5-12 from other builds). Turn it off for a
  /// latency-bound loop of your own collectives across hosts once the
  /// program is known to call them alike on every rank. A call that carries
  /// a label (Options::label: every collective of the trainers and GradSync)
  /// is checked even so, with its label: ranks that would train different
  /// models still fail on every rank, naming both, so the trainers' calls
  /// cost the check either way.
  bool check_calls = true;
};

}  // namespace gradsync

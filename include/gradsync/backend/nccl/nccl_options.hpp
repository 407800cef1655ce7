#pragma once
/// \file NcclOptions: what a Nccl communicator is told at construction.

namespace gradsync {

/// Options of a Nccl communicator (nccl_communicator, nccl_communicators).
struct NcclOptions {
  /// Before each call, check that every rank makes the same call (collective,
  /// sequence number, count, type, op, root, algorithm, chunking,
  /// deterministic flag) and throw InvalidArgument naming both calls if not.
  /// Costs a second NCCL communicator (made by ncclCommSplit at construction)
  /// and, per call, a 64-byte all-gather on it plus a host wait for that
  /// gather alone: the host waits until every rank has started the call, not
  /// until earlier work is done (see backend/nccl/agreement.hpp). Off, a
  /// disagreement is undefined behaviour inside NCCL (garbage or a hang that
  /// only the deadline of the next host wait ends), and calls' labels are
  /// not compared either (unlike Mpi's, whose labelled calls are checked
  /// regardless): ranks that would train different models go unseen.
  bool check_calls = true;
};

}  // namespace gradsync

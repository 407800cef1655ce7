#pragma once
/// \file detail::FailAccess: fails a communicator for a failure on another
/// one, for code inside gradsync that runs several over the same ranks.
///
/// A trainer under HybridShard calls on three communicators (the world, its
/// shard group, its replica group). A disagreement found in one group fails
/// only that group; without this, ranks in the other groups would see this
/// rank's communicators destroyed and report that it left, not why.

#include <string>

#include "gradsync/core/backend.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"

namespace gradsync::detail {

struct FailAccess {
  /// Fails `comm` (idle, owned by the caller's thread) with `what` and
  /// `kind`, unless it has failed already.
  template <Backend B>
  static void fail(Communicator<B>& comm, FailureKind kind, const std::string& what) noexcept {
    comm.fail_because(kind, what);
  }
};

}  // namespace gradsync::detail

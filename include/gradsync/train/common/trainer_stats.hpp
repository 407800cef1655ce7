#pragma once
/// \file TrainerStats: what a trainer measured over its steps. Both trainers
/// report it, so it lives apart from either and neither includes the other.

#include <cstddef>

namespace gradsync {

/// What a trainer measured, summed over its steps.
struct TrainerStats {
  std::size_t steps = 0;
  /// Of those, steps whose update OnNonfinite::skip_step skipped.
  std::size_t skipped_steps = 0;
  /// forward + backward on this rank's thread.
  double compute_seconds = 0;
  double optimizer_seconds = 0;
  /// Gradient communication (the progress worker's time in bucket collectives).
  double comm_seconds = 0;
  /// How long the rank's thread waited for its gradient collectives after
  /// backward (finish()): the communication backward did not hide. It is
  /// measured on the rank's thread, not the worker's, so where threads
  /// outnumber cores it also holds the worker's wait for a core, and can
  /// exceed comm_seconds.
  double exposed_comm_seconds = 0;
};

}  // namespace gradsync

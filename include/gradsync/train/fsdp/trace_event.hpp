#pragma once
/// \file ShardedTraceEvent: one collective ShardedTrainer issued in a step, what
/// ShardedTrainer::trace() lists so tests and users can see the schedule.

#include <cstddef>

#include "gradsync/core/collective.hpp"

namespace gradsync {

/// One collective a ShardedTrainer issued in a step, in issue order.
struct ShardedTraceEvent {
  Collective collective;
  /// The wrapped unit (ShardedTrainer::plan()), the model unit under the default per-unit wrapping.
  std::size_t unit;
  /// Gathers: wrapped units gathered and not yet freed once this one was
  /// issued (it included), what ShardedTrainerOptions::limit_all_gathers bounds.
  std::size_t gathered = 0;
  /// Bytes of the collective's whole (unsharded, padded) buffer in the
  /// element type it travels in: N·c·sizeof(param or reduce dtype) for a
  /// gather or reduce-scatter, P·sizeof for NoShard's all-reduce, c·sizeof
  /// for HybridShard's across replicas. A ring moves (N−1)/N of it per rank.
  std::size_t bytes = 0;
};

}  // namespace gradsync

#pragma once
/// \file BackwardPrefetch: when ShardedTrainer gathers the next unit of backward (PyTorch FSDP's names).

#include <cstdint>

namespace gradsync {

/// When, in backward, ShardedTrainer starts gathering the unit that comes
/// next (the one before in forward order), so that its gather overlaps the
/// current unit's gradient computation or reduction.
enum class BackwardPrefetch : std::uint8_t {
  /// Gather each unit when the model asks for it: the gather queues behind
  /// the reductions issued before it, and nothing overlaps it.
  None,
  /// FSDP's BACKWARD_PRE: when the model asks for unit i in backward, right
  /// after i is gathered and before its gradient is computed. Most overlap;
  /// peak: parameters of i and i−1 and the gradient of i.
  BackwardPre,
  /// FSDP's BACKWARD_POST: when unit i's gradient is ready, just before its
  /// reduction is issued. Overlaps the reduction of i and what follows it.
  BackwardPost,
};

}  // namespace gradsync

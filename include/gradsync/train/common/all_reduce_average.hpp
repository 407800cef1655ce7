#pragma once
/// \file AllReduceAverage: every rank ends with the whole averaged bucket (DDP).

#include <cstddef>
#include <span>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/train/common/reduction_policy.hpp"

namespace gradsync {

/// The reduction policy of replicated training: an in-place AllReduce of the
/// bucket. A mean is AllReduce's Avg: a sum, then one division by N done by
/// whichever rank owns each block, so every rank receives the same bits.
///
/// \tparam Algo  the AllReduce algorithm.
template <class Algo = Auto>
struct AllReduceAverage {
  using algorithm = Algo;
  /// The AllReduce every bucket runs; `P{options}` sets its Options
  /// (`deterministic`, chunking).
  AllReduce<Algo> all_reduce{};

  static constexpr bool in_place = true;
  static constexpr std::size_t storage(std::size_t count, int /*world*/) noexcept { return count; }
  static constexpr ReducedPart result(std::size_t count, int /*world*/, int /*rank*/) noexcept {
    return {0, 0, count};
  }

  template <class B, Element E>
  void reduce(Communicator<B>& comm, std::span<E> storage, std::size_t count, bool mean) const {
    // One rank's sum and mean are its own values: skip a pass over the bucket.
    if (comm.size() == 1) return;
    if (mean) {
      all_reduce(comm, storage.first(count), Avg{});
    } else {
      all_reduce(comm, storage.first(count), Sum{});
    }
  }
};

}  // namespace gradsync

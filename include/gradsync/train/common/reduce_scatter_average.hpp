#pragma once
/// \file ReduceScatterAverage: each rank ends with the mean of its 1/N shard of the bucket (FSDP).

#include <algorithm>
#include <cstddef>
#include <span>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/collective/reduce_scatter.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/train/common/reduction_policy.hpp"

namespace gradsync {

/// The reduction policy of sharded training: a ReduceScatter of the bucket,
/// after which rank r holds elements [r·m, r·m + m) of the averaged bucket,
/// m = ⌈count / N⌉ (the last ranks' shards are shorter or empty when N does
/// not divide count, as FSDP pads). A mean is ReduceScatter's Avg: the sum,
/// then a division by N on the rank that owns the shard.
///
/// ReduceScatter needs N equal blocks and an output apart from its input,
/// so the storage is the bucket padded with zeros to N·m, then m elements
/// that receive the shard: never in place.
///
/// \tparam Algo  the ReduceScatter algorithm.
template <class Algo = Auto>
struct ReduceScatterAverage {
  using algorithm = Algo;
  /// The ReduceScatter every bucket runs; `P{options}` sets its Options
  /// (`deterministic`, chunking).
  ReduceScatter<Algo> reduce_scatter{};

  static constexpr bool in_place = false;

  /// Elements of each rank's shard.
  static constexpr std::size_t shard_size(std::size_t count, int world) noexcept {
    const auto n = static_cast<std::size_t>(world);
    return (count + n - 1) / n;
  }
  static constexpr std::size_t storage(std::size_t count, int world) noexcept {
    if (world == 1) return count;
    return shard_size(count, world) * (static_cast<std::size_t>(world) + 1);
  }
  static constexpr ReducedPart result(std::size_t count, int world, int rank) noexcept {
    if (world == 1) return {0, 0, count};
    const std::size_t m = shard_size(count, world);
    const std::size_t first = std::min(count, static_cast<std::size_t>(rank) * m);
    return {m * static_cast<std::size_t>(world), first, std::min(m, count - first)};
  }

  template <class B, Element E>
  void reduce(Communicator<B>& comm, std::span<E> storage, std::size_t count, bool mean) const {
    // One rank's shard is the whole bucket, and its sum and mean its own values.
    if (comm.size() == 1) return;
    const std::size_t m = shard_size(count, comm.size());
    const std::size_t padded = m * static_cast<std::size_t>(comm.size());
    const std::span<const E> in = storage.first(padded);
    const std::span<E> out = storage.subspan(padded, m);
    if (mean) {
      reduce_scatter(comm, in, out, Avg{});
    } else {
      reduce_scatter(comm, in, out, Sum{});
    }
  }
};

}  // namespace gradsync

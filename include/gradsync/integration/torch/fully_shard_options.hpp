#pragma once
/// \file FullyShardOptions: how gradsync::fully_shard shards one LibTorch unit and when it frees it.

#include "gradsync/core/options.hpp"
#include "gradsync/train/fsdp/sharding_strategy.hpp"

namespace gradsync {

/// Options of gradsync::fully_shard, with PyTorch FSDP's defaults. Every rank
/// must pass the same values for a unit (checked when it is wrapped).
struct FullyShardOptions {
  /// FullShard frees the gathered parameters after the unit's forward and
  /// gathers them again before its backward; ShardGradOp keeps them from
  /// forward until its gradients are reduce-scattered; NoShard keeps a full
  /// copy on every rank and all-reduces gradients. HybridShard frees as
  /// FullShard does, within groups of shard_size ranks.
  ShardingStrategy strategy = ShardingStrategy::FullShard;
  /// HybridShard: ranks per shard group (ranks [g·s, g·s + s) form group
  /// g, split from the communicator); it must divide the world size. Each
  /// group holds a copy of the unit; gradients are summed in the group and
  /// across the copies, then divided by the world size. 0: the whole world.
  int shard_size = 0;
  /// Broadcast rank 0's parameters and buffers of the unit when it is
  /// wrapped (FSDP's sync_module_states), so every rank starts alike.
  bool sync_module_states = true;
  /// Passed to every collective; `deterministic` sums in rank order.
  Options collective{};
};

}  // namespace gradsync

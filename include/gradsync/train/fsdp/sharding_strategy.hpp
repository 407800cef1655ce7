#pragma once
/// \file ShardingStrategy: when a gathered unit is freed (FSDP's sharding strategies), and its
/// name. Apart from the options so that the plan, the trace and errors can name it alone.

#include <cstdint>

namespace gradsync {

/// When a gathered unit is freed, with the names PyTorch FSDP users know.
enum class ShardingStrategy : std::uint8_t {
  /// ZeRO-3: gather for forward, free after it, gather again for backward.
  FullShard,
  /// ZeRO-2: gather for forward and keep it until that unit's backward is done.
  ShardGradOp,
  /// DDP through the same class: every rank keeps everything, gradients are all-reduced.
  NoShard,
  /// FullShard within groups of `shard_size` consecutive ranks (a host),
  /// replicated across the groups: gradients are reduce-scattered (sum) in
  /// the group, all-reduced (sum) across replicas, and divided by
  /// shards × replicas on the owner.
  HybridShard,
};

/// The strategy's name as PyTorch users know it ("FullShard", ...).
constexpr const char* name(ShardingStrategy s) noexcept {
  switch (s) {
    case ShardingStrategy::FullShard: return "FullShard";
    case ShardingStrategy::ShardGradOp: return "ShardGradOp";
    case ShardingStrategy::NoShard: return "NoShard";
    case ShardingStrategy::HybridShard: return "HybridShard";
  }
  return "?";
}

}  // namespace gradsync

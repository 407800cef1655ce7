#pragma once
/// \file FullyShardOptions: how gradsync::fully_shard shards one LibTorch unit and when it frees it.

#include <cstddef>
#include <optional>

#include <c10/core/ScalarType.h>

#include "gradsync/core/options.hpp"
#include "gradsync/train/fsdp/sharding_strategy.hpp"

namespace gradsync {

/// Options of gradsync::fully_shard, with PyTorch FSDP's defaults but
/// sync_module_states, which is on (FSDP1's is off; FSDP2 has none), so that
/// every rank starts alike. Every rank must pass the same values for a unit
/// (checked when it is wrapped).
struct FullyShardOptions {
  /// FullShard frees the gathered parameters after the unit's forward and
  /// gathers them again before its backward; ShardGradOp keeps them from
  /// forward until its gradients are reduce-scattered (between the two the
  /// parameters are their shard pieces, so a step or a forward no backward
  /// follows never sees the copy, which the next forward or the end of a
  /// backward that did not reach the unit frees); NoShard keeps a full copy
  /// on every rank and all-reduces gradients. HybridShard frees as FullShard
  /// does, within groups of shard_size ranks.
  ShardingStrategy strategy = ShardingStrategy::FullShard;
  /// HybridShard: ranks per shard group (ranks [g·s, g·s + s) form group
  /// g, split from the communicator); it must divide the world size. Each
  /// group holds a copy of the unit; gradients are summed in the group and
  /// across the copies, then divided by the world size. 0: the whole world.
  int shard_size = 0;
  /// Broadcast rank 0's parameters and buffers of the unit when it is
  /// wrapped (FSDP's sync_module_states), so every rank starts alike.
  bool sync_module_states = true;
  /// Mixed precision (FSDP's MixedPrecisionPolicy): the dtype the unit is
  /// gathered in, so its forward and backward compute in it (e.g.
  /// torch::kBFloat16); the shards the optimizer steps and their gradients
  /// keep the parameters' dtype (the float masters). Floating inputs of the
  /// unit must be of this dtype (cast the root's: `net(x.to(torch::kBFloat16))`).
  /// Unset: the parameters' dtype. Not with NoShard.
  std::optional<c10::ScalarType> param_dtype;
  /// The dtype gradients are reduced in. Unset: the parameters' dtype, the
  /// gradients cast to it before the reduce-scatter.
  std::optional<c10::ScalarType> reduce_dtype;
  /// Gathers ahead (FSDP's forward and backward prefetch) and their limit
  /// (FSDP's limit_all_gathers, which allows 2): when a unit's forward
  /// starts, the unit that came after it in the previous forward is gathered
  /// meanwhile on a ProgressWorker of the units' own; when its backward
  /// starts, the unit whose backward comes next (this forward's order,
  /// reversed). A prefetch waits, or is skipped, while this many units of
  /// the communicator hold gathered parameters, the running one included;
  /// not counted are units whose module holds other units (the root,
  /// gathered through their forwards) and ShardGradOp's units kept from
  /// forward to backward. A unit's own gather when it runs is never held
  /// back, so the units it counts hold at most max(this, 2) times the
  /// largest one's gathered bytes (in backward a unit gathers just before
  /// the one whose backward ends frees). 0 or 1: no prefetch, each unit
  /// gathered on the caller's thread when it runs. The bytes of freed
  /// gathers, and of the flat gradient backward reduce-scatters from, are
  /// kept for the next ones (within this bound and one gradient more) until
  /// the module's last ShardedModule holder goes. Wrap the root too (as
  /// FSDP2 does, fully_shard on it last): then what a forward gathered
  /// ahead and did not use is freed as it ends. Without an enclosing unit,
  /// a unit gathered ahead by a block called alone stays gathered, and a
  /// forward that reaches that unit first after an optimizer step would
  /// use the values from before the step (LibTorch's optimizers step through
  /// .data(), which no version counter sees); there, set this to 0 or 1.
  std::size_t max_gathered_units = 2;
  /// Passed to every collective; `deterministic` sums in rank order. Its
  /// `label` is replaced by each call's own (unit, phase, backward).
  Options collective{};
};

}  // namespace gradsync

#pragma once
/// \file ShardedTrainer's memory accounting: what a rank keeps between
/// steps, its options and layout turned into the shape
/// detail::sharded_memory_need computes with, what construction holds, the
/// budget check with its advice, and the high-water mark of what a step
/// really held. The formula itself is memory_need.hpp's, shared with the
/// documentation and the tests.

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>

#include "gradsync/core/bfloat16.hpp"
#include "gradsync/train/fsdp/accumulation_mode.hpp"
#include "gradsync/train/fsdp/backward_prefetch.hpp"
#include "gradsync/train/fsdp/flat_shard.hpp"
#include "gradsync/train/fsdp/options.hpp"
#include "gradsync/train/fsdp/sharding_strategy.hpp"
#include "gradsync/train/common/memory_need.hpp"

namespace gradsync::detail::fsdp {

/// What the trainer knows besides its options and layout that decides its
/// memory: the ranks a unit is sharded over, where the state lives, and the
/// element types.
struct MemoryFacts {
  std::size_t shards = 1;
  /// Shards in an offload space; with `state_in_space`, the optimizer's state too.
  bool offload = false;
  bool state_in_space = false;
  std::size_t state_per_element = 0;
  /// Bytes of the master type.
  std::size_t element_bytes = 4;
  /// ShardGradOp keeps its gathered units in bfloat16 (ReleaseRules::keeps_bf16).
  bool keeps_bf16 = false;
  /// The model computes in bfloat16, and reduces its gradient from it.
  bool computes_bf16 = false;
  bool reduces_bf16_grad = false;
  /// The model writes its initial values one unit at a time (init_unit).
  bool inits_units = false;
};

/// What construction holds besides the persistent part under `strategy`:
/// the model's initial values in full before they are sharded (one wrapped
/// unit with init_unit, every parameter with bind only; nothing under
/// NoShard, whose shard is the model).
inline std::size_t construction_need(ShardingStrategy strategy, const FlatShard& flat, const MemoryFacts& f) {
  if (strategy == ShardingStrategy::NoShard) return 0;
  const std::size_t elements = f.inits_units ? std::ranges::max(flat.sizes) : flat.total;
  return elements * f.element_bytes;
}

/// Bytes a rank keeps between steps (ShardedTrainer::persistent_bytes), from
/// what it holds: its parameter and gradient shards of `shard_elements`
/// each and the optimizer's state on them, (2 + S)·e·Σ_u c_u, S being the
/// optimizer's state elements per parameter (0 for SGD, 1 with momentum, 2
/// for Adam and AdamW; 0 for an optimizer that does not say, through
/// `state_per_element()`). Buffers are replicated and left out. With
/// offload these are in the offload space, and this is 0 (the optimizer's
/// state if it cannot be lent storage, see bind_state). NoShard with a
/// bfloat16 model adds its `bf16_copies` of the parameters and gradients,
/// 2·2·Ψ.
inline std::size_t persistent_bytes(std::size_t shard_elements, std::size_t bf16_copies,
                                    const MemoryFacts& f) noexcept {
  const std::size_t state = f.state_per_element * f.element_bytes * shard_elements;
  if (f.offload) return f.state_in_space ? 0 : state;
  return 2 * f.element_bytes * shard_elements + state + bf16_copies * sizeof(bfloat16);
}

/// What a trainer with options `o` would need per rank under `strategy`.
inline MemoryNeed trainer_need(const ShardedTrainerOptions& o, ShardingStrategy strategy, const FlatShard& flat,
                               const MemoryFacts& f) {
  const bool full = strategy == ShardingStrategy::FullShard || strategy == ShardingStrategy::HybridShard;
  // A prefetch adds a second gathered unit unless the limit allows only one.
  const bool prefetch =
      (o.forward_prefetch || o.backward_prefetch != BackwardPrefetch::None) && o.limit_all_gathers != 1;
  MemoryNeed n = sharded_memory_need(std::span<const std::size_t>(flat.sizes), f.shards,
                                     {.sharded = strategy != ShardingStrategy::NoShard,
                                      .keeps_forward_gathers = !full,
                                      .prefetch = full && prefetch,
                                      .keeps_unsharded_grads = o.accumulation == AccumulationMode::NoSync,
                                      .offload = f.offload,
                                      .state_per_element = f.state_per_element,
                                      .element_bytes = f.element_bytes,
                                      .kept_element_bytes = f.keeps_bf16 ? sizeof(bfloat16) : 0,
                                      .compute_element_bytes = f.computes_bf16 ? sizeof(bfloat16) : 0,
                                      .reduces_in_compute_type = f.reduces_bf16_grad});
  if (f.offload && !f.state_in_space) {
    // An optimizer that cannot be lent storage keeps its state itself, beside the compute side's buffers.
    n.optimizer_state = f.state_per_element * f.element_bytes * flat.shard_elements;
    n.offloaded -= n.optimizer_state;
  }
  if (f.computes_bf16 && strategy == ShardingStrategy::NoShard) {
    // The bfloat16 copies of every parameter and gradient the model sees.
    n.params += sizeof(bfloat16) * flat.total;
    n.grads += sizeof(bfloat16) * flat.total;
  }
  n.construction = construction_need(strategy, flat, f);
  return n;
}

/// Refuses a configuration whose need exceeds ShardedTrainerOptions::memory_budget,
/// saying what FullShard would need, or what would lower the need.
inline void check_budget(const std::string& where, const ShardedTrainerOptions& o, const FlatShard& flat,
                         const MemoryFacts& f) {
  if (o.memory_budget == 0) return;
  const MemoryNeed full = trainer_need(o, ShardingStrategy::FullShard, flat, f);
  const MemoryNeed mine = trainer_need(o, o.strategy, flat, f);
  const bool full_shard = o.strategy == ShardingStrategy::FullShard || o.strategy == ShardingStrategy::HybridShard;
  std::string advice = full_shard
                           ? "Smaller (wrapped) units lower the transient part, more ranks the persistent part."
                           : "FullShard would need " + full.describe() + ".";
  if (!f.inits_units && mine.construction > mine.transient()) {
    advice += " The model writes its initial values with bind(), every parameter at once: with "
              "init_unit(u, view) construction would hold one wrapped unit at a time.";
  }
  check_memory_budget(where, mine, o.memory_budget, advice);
}

/// The most transient bytes (gathered units, gradient buffers) held at once.
class TransientPeak {
 public:
  /// After each allocation, where what is held can only have grown.
  void track(std::size_t held) noexcept { peak_ = std::max(peak_, held); }
  std::size_t bytes() const noexcept { return peak_; }
  void reset() noexcept { peak_ = 0; }

 private:
  std::size_t peak_ = 0;
};

}  // namespace gradsync::detail::fsdp

#pragma once
/// \file ShardedTrainerOptions: every choice ShardedTrainer is given, in one struct with
/// defaults (house style: an options struct over more template parameters).

#include <cstddef>
#include <memory>
#include <optional>

#include "gradsync/core/offload_space.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/train/accumulation_mode.hpp"
#include "gradsync/train/backward_prefetch.hpp"
#include "gradsync/train/fsdp/sharding_strategy.hpp"
#include "gradsync/train/wrap_policy.hpp"

namespace gradsync {

/// Options of ShardedTrainer.
struct ShardedTrainerOptions {
  ShardingStrategy strategy = ShardingStrategy::FullShard;
  /// Passed to every gather and reduction (`deterministic`: sums in rank
  /// order, so the result is bitwise that of ReplicatedTrainer with the same
  /// option; not under HybridShard, which sums within groups first).
  Options collective{};
  /// Broadcast rank 0's buffers before every step, as ReplicatedTrainer does.
  bool broadcast_buffers = true;
  /// FullShard and HybridShard: the unit released last in forward stays gathered until the
  /// next ask of another unit, so a backward that starts with it (FSDP's
  /// root unit) gathers it once, not twice. Peak memory is unchanged: it is
  /// freed before the next unit is gathered.
  bool keep_last_forward_unit = true;
  /// HybridShard: ranks per shard group (ranks [g·s, g·s + s) form group g);
  /// it must divide the world size. 0: the whole world (one replica).
  int shard_size = 0;
  /// How accumulate() keeps micro-steps' gradients: reduce-scatter each
  /// into the shard (Sharded, memory 1/N), or keep them unsharded until
  /// step() (NoSync: +Ψ gradient elements per rank, one reduction per step;
  /// ShardGradOp then also keeps its gathered units, one gather a window).
  AccumulationMode accumulation = AccumulationMode::Sharded;
  /// How model units group into wrapped units, each gathered and reduced
  /// as one flat buffer (see WrapPolicy). Default: one per model unit.
  WrapPolicy wrap = WrapPolicy::per_unit();
  /// Forward: when a unit is asked for, start gathering the next one in
  /// declaration (forward) order (FSDP's forward_prefetch).
  bool forward_prefetch = false;
  /// Backward: when to start gathering the next unit of backward (FSDP's
  /// backward_prefetch; its default is BackwardPre, ours None so that a step's
  /// memory is that of no prefetch unless asked for).
  BackwardPrefetch backward_prefetch = BackwardPrefetch::None;
  /// A prefetch is issued only while fewer wrapped units than this are
  /// gathered and not yet freed (FSDP's limit_all_gathers, which allows 2);
  /// 0: no limit. Gathers the model asks for are never held back. Under
  /// ShardGradOp, whose forward keeps every unit gathered until its
  /// backward, forward prefetch stops once this many are kept.
  std::size_t limit_all_gathers = 2;
  /// The element type parameters are gathered in: the master type
  /// (value_type; unset, the default) or DataType::bfloat16, which rounds
  /// the master shard once per gather and halves the gather's bytes.
  /// - A model that computes in bfloat16 (`using compute_type =
  ///   gradsync::bfloat16;`) sees the gathered bfloat16 unit itself and
  ///   writes bfloat16 gradients: gathered units and the gradient it fills
  ///   take half the bytes, and with reduce_dtype bfloat16 the gradient is
  ///   reduced from there, with no master-type copy. Unset, param_dtype is
  ///   then bfloat16.
  /// - A model that computes in value_type sees value_type views holding
  ///   the rounded values; a unit kept gathered while the model does not
  ///   hold it (ShardGradOp's, from forward to backward) is kept in
  ///   bfloat16 where that holds less.
  std::optional<DataType> param_dtype{};
  /// The element type gradients are reduced in: the master type unless set
  /// (DataType::bfloat16 halves the bytes and rounds each rank's gradient
  /// and the reduced sums). Unlike PyTorch FSDP, it does not follow
  /// param_dtype: reducing in low precision is never silent.
  std::optional<DataType> reduce_dtype{};
  /// Bytes per rank this trainer may hold (persistent + transient, see
  /// ShardedTrainer::memory_need); 0: no limit. A configuration that needs
  /// more is refused at construction, before the parameters are broadcast.
  /// Ranks given different values all throw at construction.
  std::size_t memory_budget = 0;
  /// Where the master parameter shard, the gradient shard and the optimizer
  /// state live (FSDP's CPU offload): null, the compute side with the rest;
  /// else this space (HostOffloadSpace on a host backend). A gather copies
  /// the unit's chunk in from it, a reduction copies the reduced shard out
  /// to it, both on the progress worker, and the optimizer steps there (its
  /// state allocated from the space and lent to it by `bind_state`, which
  /// Sgd, Adam and AdamW have). Not with NoShard, nor with accumulate()
  /// under AccumulationMode::Sharded. Ranks that differ in whether they
  /// offload all throw at construction.
  std::shared_ptr<OffloadSpace> offload{};
};

}  // namespace gradsync

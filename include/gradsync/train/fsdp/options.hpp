#pragma once
/// \file ShardedTrainerOptions: every choice ShardedTrainer is given, in one struct with
/// defaults (house style: an options struct over more template parameters),
/// and its validation: what each rank checks alone (the precisions, offload,
/// the shard group's size) and what every rank must have been given alike.
/// Kept beside the struct so that a new option and its checks change together.

#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "gradsync/core/error.hpp"
#include "gradsync/core/offload_space.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/train/fsdp/accumulation_mode.hpp"
#include "gradsync/train/common/agreed_settings.hpp"
#include "gradsync/train/fsdp/backward_prefetch.hpp"
#include "gradsync/train/common/bfloat16_copies.hpp"
#include "gradsync/train/fsdp/sharding_strategy.hpp"
#include "gradsync/train/common/model.hpp"
#include "gradsync/train/common/on_nonfinite.hpp"
#include "gradsync/train/common/unit_agreement.hpp"
#include "gradsync/train/fsdp/wrap_policy.hpp"

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
  /// it must divide the world size. 0: the whole world (one replica). Read
  /// only under HybridShard.
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
  /// A step whose averaged gradient or loss holds a NaN or an Inf: throw
  /// before the optimizer runs (the default), skip its update, or ignore it
  /// (see OnNonfinite). Each rank checks its part of each unit's reduced
  /// gradient as the reduction's copy-out writes it (where the result lands
  /// in place, by one more read of its shard on the worker); unless
  /// `ignore`, one 16-byte all-reduce over every rank after the step's
  /// reductions agrees on the verdict and on the first wrapped unit to name
  /// (under `ignore`, an 8-byte one on the micro-batch count).
  OnNonfinite on_nonfinite = OnNonfinite::throw_error;
};

namespace detail::fsdp {

/// param_dtype and reduce_dtype, read: bfloat16 (true) or the master type.
struct Precision {
  bool params_bf16 = false;
  bool grads_bf16 = false;
};

/// Reads param_dtype and reduce_dtype for master type T: the master type or
/// bfloat16 (param_dtype bfloat16, whether set or not, for a model that
/// computes in bfloat16, which may then have no buffers). Every rank has the
/// same model type, units and options, so every rank throws alike, before
/// anything is allocated.
template <class T, bool ComputesBf16>
Precision read_precision(const ShardedTrainerOptions& o, const std::string& where, std::span<const UnitSpec> units) {
  auto is_bf16 = [&](const std::optional<DataType>& d, const char* what) {
    if (!d || *d == data_type_v<T>) return false;
    if (*d == DataType::bfloat16) return true;
    throw InvalidArgument(where + ": " + what + " must be the master type (" + std::string(name(data_type_v<T>)) +
                          ") or bfloat16, got " + std::string(name(*d)));
  };
  Precision p{is_bf16(o.param_dtype, "ShardedTrainerOptions::param_dtype"),
              is_bf16(o.reduce_dtype, "ShardedTrainerOptions::reduce_dtype")};
  if constexpr (ComputesBf16) {
    if (o.param_dtype && !p.params_bf16) {
      throw InvalidArgument(where +
                            ": the model computes in bfloat16 (its compute_type), so its units are gathered in "
                            "bfloat16: leave ShardedTrainerOptions::param_dtype unset or make it bfloat16, not " +
                            std::string(name(*o.param_dtype)));
    }
    p.params_bf16 = true;
    refuse_buffers_of_bf16_model(where, units, data_type_v<T>);
  }
  return p;
}

/// Offload applies to the sharded strategies only.
inline void check_offload(const ShardedTrainerOptions& o, const std::string& where) {
  if (o.offload != nullptr && o.strategy == ShardingStrategy::NoShard) {
    throw InvalidArgument(where +
                          ": ShardedTrainerOptions::offload needs a sharded strategy (FullShard, ShardGradOp or "
                          "HybridShard); NoShard keeps every unit whole where the model uses it in place");
  }
}

/// accumulate() under offload needs NoSync.
inline void check_accumulate(const ShardedTrainerOptions& o, const std::string& where) {
  if (o.offload != nullptr && o.accumulation == AccumulationMode::Sharded) {
    throw InvalidArgument(where +
                          ": accumulate() with ShardedTrainerOptions::offload needs AccumulationMode::NoSync; "
                          "sharded accumulation would add every micro-step's reduced shard into the offloaded "
                          "gradient shard, which only copies reach (PyTorch FSDP refuses it with CPU offload too)");
  }
}

/// HybridShard's ranks per shard group out of `world`: shard_size, or the
/// whole world for 0; it must divide the world.
inline int shard_group_size(const ShardedTrainerOptions& o, int world, const std::string& where) {
  const int s = o.shard_size == 0 ? world : o.shard_size;
  if (s < 1 || world % s != 0) {
    throw InvalidArgument(where + ": HybridShard needs a shard_size that divides the world size " +
                          std::to_string(world) + ", got " + std::to_string(o.shard_size));
  }
  return s;
}

/// What every rank must have been given alike besides its units, the
/// model's types and the optimizer (TrainerBase::agree adds those): the
/// options that decide which collectives run, in which order and precision.
inline std::vector<AgreedValue> agreed_options(const ShardedTrainerOptions& o) {
  const std::string same = "Give every rank the same ShardedTrainerOptions.";
  auto dtype = [](const std::optional<DataType>& d) { return d ? std::string(name(*d)) : std::string("unset"); };
  static constexpr const char* accumulation[] = {"Sharded", "NoSync"};
  static constexpr const char* prefetch[] = {"None", "BackwardPre", "BackwardPost"};
  std::vector<AgreedValue> v{
      {"ShardedTrainerOptions::strategy", name(o.strategy), same},
      setting("ShardedTrainerOptions::shard_size", static_cast<std::size_t>(o.shard_size),
              "Give every rank the same shard_size: the shard groups are made from it."),
      {"ShardedTrainerOptions::wrap", o.wrap.describe(), same},
      {"ShardedTrainerOptions::accumulation", accumulation[static_cast<int>(o.accumulation)], same},
      flag("ShardedTrainerOptions::collective.deterministic", o.collective.deterministic, same),
      setting("ShardedTrainerOptions::collective.chunk_bytes", chunk_bytes(o.collective), same),
      flag("ShardedTrainerOptions::broadcast_buffers", o.broadcast_buffers, same),
      flag("ShardedTrainerOptions::keep_last_forward_unit", o.keep_last_forward_unit, same),
      flag("ShardedTrainerOptions::forward_prefetch", o.forward_prefetch, same),
      {"ShardedTrainerOptions::backward_prefetch", prefetch[static_cast<int>(o.backward_prefetch)], same},
      setting("ShardedTrainerOptions::limit_all_gathers", o.limit_all_gathers, same),
      {"ShardedTrainerOptions::param_dtype", dtype(o.param_dtype), same},
      {"ShardedTrainerOptions::reduce_dtype", dtype(o.reduce_dtype), same},
      {"ShardedTrainerOptions::offload", o.offload != nullptr ? "a space" : "none",
       "Give every rank an offload space, or none: ranks that differ would hold and budget different memory."},
      {"ShardedTrainerOptions::on_nonfinite", name(o.on_nonfinite), same},
  };
  return v;
}

}  // namespace detail::fsdp

}  // namespace gradsync

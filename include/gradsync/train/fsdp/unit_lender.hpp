#pragma once
/// \file detail::fsdp::UnitLender: what the model's StepContext reaches in a
/// sharded step. It turns the model's asks, releases and readies into the
/// moves of each wrapped unit (unit_group.hpp) and the collectives they
/// need (collective_issuer.hpp), decides the prefetches, and ends the step.
/// The model protocol gives the trainer control at exactly these calls, so
/// this is the one place that knows the order of a step; the trainer
/// around it only starts and ends steps.

#include <algorithm>
#include <cstddef>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/train/fsdp/accumulation_mode.hpp"
#include "gradsync/train/fsdp/backward_prefetch.hpp"
#include "gradsync/train/common/bfloat16_copies.hpp"
#include "gradsync/train/fsdp/buffer_pool.hpp"
#include "gradsync/train/fsdp/collective_issuer.hpp"
#include "gradsync/train/fsdp/hybrid_groups.hpp"
#include "gradsync/train/fsdp/memory.hpp"
#include "gradsync/train/fsdp/options.hpp"
#include "gradsync/train/fsdp/sharded_state.hpp"
#include "gradsync/train/fsdp/unit_group.hpp"
#include "gradsync/train/common/memory_need.hpp"
#include "gradsync/train/common/model.hpp"
#include "gradsync/train/common/on_nonfinite.hpp"
#include "gradsync/train/common/step_labels.hpp"
#include "gradsync/train/common/step_stats.hpp"

namespace gradsync::detail::fsdp {

/// Lends the model its units in a step: gathers on demand, frees on release,
/// reduces on ready. T the master type, C the compute type.
template <class T, class C, class Algo, class Comm>
class UnitLender final : public UnitProvider<C> {
  using Unit = UnitGroup<T, C>;
  static constexpr bool computes_bf16 = !std::is_same_v<C, T>;

 public:
  /// The options labelled for a collective of the coming step (phase, wrapped unit).
  using Labeller = std::function<Options(LabelPhase, std::size_t)>;

  UnitLender(const ShardedTrainerOptions& o, HybridGroups<Comm>& comms, ShardedState<T, C>& state, StepStats& step,
             std::string where)
      : o_(o), comms_(comms), state_(state), where_(std::move(where)), issuer_(units_, comms, step, sharded()),
        step_(step) {}

  /// One UnitGroup per wrapped unit of the state's layout; `precision`:
  /// what param_dtype and reduce_dtype say.
  void lay_out(Precision precision, Labeller labelled) {
    precision_ = precision;
    labelled_ = std::move(labelled);
    // param_dtype bfloat16 under ShardGradOp: a unit kept gathered from its
    // forward to its backward keeps only the bfloat16 copy its gather
    // received, where that holds less in all (keeping_bf16_pays).
    keep_bf16_ = !computes_bf16 && precision.params_bf16 && o_.strategy == ShardingStrategy::ShardGradOp &&
                 keeping_bf16_pays(state_.flat.sizes, static_cast<std::size_t>(comms_.shard().size()), sizeof(T),
                                   sizeof(bfloat16));
    for (std::size_t w = 0; w < state_.flat.groups.size(); ++w) {
      units_.emplace_back(w, state_.plan.units[w].name, state_.flat.first_member(w), state_.flat.last_member(w),
                          o_.strategy);
    }
  }
  /// The pool's spares, with what is in use, stay within `transient_limit` bytes, the transient need.
  void reserve(std::size_t transient_limit) { pool_.reserve(2 * units_.size(), transient_limit); }
  /// The collectives run on the worker from here on.
  void start() { issuer_.start(); }

  /// A step (`evaluating`: an evaluation) starts.
  void begin_step(bool evaluating) {
    evaluating_ = evaluating;
    for (Unit& unit : units_) unit.begin_step();
  }
  /// A training step's forward and backward starts: `sync`, the step that
  /// reduces (forward_backward), else a micro-step of accumulate(), after
  /// `earlier` micro-steps of this step. ShardedTrainerOptions::accumulation
  /// says how it reduces.
  void begin_training_step(bool sync, std::size_t earlier) {
    issuer_.trace.clear();
    // A step's search for NaN and Inf covers all its micro-steps.
    if (earlier == 0) {
      for (Unit& unit : units_) unit.nonfinite = false;
    }
    begin_step(false);
    issuer_.spans.begin(trace_recorder(comms_.world()), state_.specs.size());
    const bool sharded_accumulation = o_.accumulation == AccumulationMode::Sharded;
    reducing_ = sync || sharded_accumulation;
    // NoSync scales the local sum by 1/K before the mean, as ReplicatedTrainer;
    // sharded accumulation adds every micro-step's mean into the shard, and
    // finish() takes the mean of the K.
    local_scale_ = sync && !sharded_accumulation ? static_cast<T>(1.0 / static_cast<double>(earlier + 1)) : T(1);
    add_ = sharded_accumulation && earlier > 0;
    summed_means_ = sync && sharded_accumulation ? earlier + 1 : 1;
  }
  bool evaluating() const noexcept { return evaluating_; }
  bool keeps_bf16() const noexcept { return keep_bf16_; }
  /// No unit is kept gathered past its use (between steps).
  bool idle() const noexcept { return lingering_.empty(); }

  /// A model computing in bfloat16 with reduce_dtype bfloat16: each unit's
  /// gradient is reduce-scattered from the bfloat16 buffer the model wrote,
  /// with no master-type buffer at all (FSDP's param_dtype = reduce_dtype =
  /// bfloat16). Not where the gradient must outlive the step in the master
  /// type (NoSync) or be copied out to an offload space, nor on one rank,
  /// which rounds nothing for a wire: there it is folded (fold_bf16_grad).
  bool reduces_bf16_grad() const noexcept {
    return computes_bf16 && sharded() && precision_.grads_bf16 && comms_.world().size() > 1 && !o_.offload &&
           o_.accumulation != AccumulationMode::NoSync;
  }

  const std::vector<ShardedTraceEvent>& trace() const noexcept { return issuer_.trace; }
  std::size_t peak_transient_bytes() const noexcept { return peak_.bytes(); }
  void reset_peak_transient() noexcept { peak_.reset(); }
  std::string describe(std::size_t w) const { return units_.at(w).describe(); }

  /// After finish(): the first wrapped unit whose reduced gradient on this
  /// rank held a NaN or an Inf in this step (its micro-steps included).
  std::optional<std::size_t> first_nonfinite() const noexcept {
    for (const Unit& unit : units_) {
      if (unit.nonfinite) return unit.index();
    }
    return std::nullopt;
  }

  /// Model unit `layer`'s views; the first ask of any member of a wrapped
  /// unit gathers the whole wrapped unit, which its other members then share.
  const UnitView<C>& acquire(std::size_t layer) override {
    issuer_.spans.switch_to(layer);
    check_layer(layer, "asked for");
    Unit& unit = unit_of(layer);
    const std::size_t w = unit.index();
    const bool backward = unit.ask(layer, evaluating_, where_, layer_name(layer));
    if (prefetched_ == w) prefetched_.reset();
    if (!sharded()) {
      unit.members().hold(layer);
      return state_.resident_views[layer];
    }
    // A unit whose forward ended goes once another is asked for.
    free_lingering(w);
    if (unit.params() == ParamPhase::sharded) {
      gather(w);
    } else if (unit.params() == ParamPhase::kept_bf16) {
      unit.widen(take(unit.bf16.size(), false));
      track_transient();
    }
    // The next unit's gather overlaps this one's use: decided from the
    // model's asks alone, so every rank issues the same gathers in one order.
    if (!evaluating_ && !backward && o_.forward_prefetch && w + 1 < units_.size()) prefetch(w + 1, 1);
    if (backward && o_.backward_prefetch == BackwardPrefetch::BackwardPre && w > 0) prefetch(w - 1, 2);
    issuer_.wait_gathered(unit);
    const std::size_t at = state_.flat.member_offset[layer], size = state_.flat.model_sizes[layer];
    if constexpr (computes_bf16) {
      std::span<bfloat16> grads;
      if (backward) {
        // Zeroed per backward: the model adds into it; NoSync's sum is in `grad`.
        if (unit.bf16_grad.empty()) {
          // Reduced from itself: FullShard holds one at a time, as a master-type buffer.
          if (reduces_bf16_grad()) issuer_.retire_reductions(full_shard() ? 0 : 1, giver());
          unit.take_bf16_grad(std::vector<bfloat16>(unit.bf16.size(), bfloat16(0.0f)));
          track_transient();
        }
        grads = std::span<bfloat16>(unit.bf16_grad).subspan(at, size);
      }
      return unit.members().hand_out(
          layer, state_.make_view(layer, std::span<bfloat16>(unit.bf16).subspan(at, size), grads));
    } else {
      std::span<T> grads;
      if (backward) {
        // Under NoSync the gradient of earlier micro-steps is still there.
        if (unit.grad.empty()) take_grad(unit);
        grads = std::span<T>(unit.grad).subspan(at, size);
      }
      return unit.members().hand_out(layer, state_.make_view(layer, std::span<T>(unit.full).subspan(at, size), grads));
    }
  }

  /// The model let go of model unit `layer`; its wrapped unit decides what
  /// its parameters do (UnitGroup::release).
  void release(std::size_t layer) noexcept override {
    // A handle kept past the end of its step was already let go of.
    if (layer >= state_.specs.size()) return;
    const ReleaseRules rules{.evaluating = evaluating_,
                             .keep_last_forward_unit = o_.keep_last_forward_unit,
                             .keeps_gathered = keeps_gathered(),
                             .keeps_bf16 = keep_bf16_};
    Unit& unit = unit_of(layer);
    if (unit.release(layer, rules, giver())) lingering_.push_back(unit.index());
  }

  /// Model unit `layer`'s gradient is final; once every member of its
  /// wrapped unit is, the wrapped unit's gradient is reduced.
  void ready(std::size_t layer) override {
    check_layer(layer, "reported ready");
    Unit& unit = unit_of(layer);
    if (!unit.members().report_ready(layer, evaluating_, where_, layer_name(layer))) return;
    const std::size_t w = unit.index();
    if constexpr (computes_bf16) {
      if (!reduces_bf16_grad()) fold_bf16_grad(unit);
    }
    if (sharded() && o_.backward_prefetch == BackwardPrefetch::BackwardPost && w > 0) prefetch(w - 1, 2);
    if (!reducing_) return;
    const std::size_t count = state_.flat.sizes[w];
    issuer_.reduce(unit, {.opts = labelled_(LabelPhase::reduce, w),
                          .replica_opts = labelled_(LabelPhase::replica_reduce, w),
                          .count = count,
                          .home = state_.grad_shard().subspan(state_.flat.offsets[w],
                                                              sharded() ? state_.flat.chunks[w] : count),
                          // One rank reduces nothing: its gradient is not rounded for a wire.
                          .bf16_wire = precision_.grads_bf16 && comms_.world().size() > 1,
                          .from_bf16 = reduces_bf16_grad(),
                          .add = add_,
                          .scale = local_scale_,
                          .space = o_.offload.get(),
                          .check_finite = o_.on_nonfinite != OnNonfinite::ignore});
  }

  /// The end of a backward: waits for every gather and reduction, frees
  /// units and buffers (a NoSync micro-step's unsharded gradients stay),
  /// and throws the first failure, or names the units that reported no
  /// gradient. Sharded accumulation then turns the shard's sum of K means
  /// into their mean.
  void finish() {
    issuer_.spans.end();
    const bool keep_grads = !reducing_;
    std::string missing;
    for (std::size_t layer = 0; layer < state_.specs.size(); ++layer) {
      if (!unit_of(layer).members().ready(layer)) missing += (missing.empty() ? "" : ", ") + layer_name(layer);
    }
    std::exception_ptr first;
    {
      const Stopwatch waiting(&step_.exposed_comm_seconds);
      first = issuer_.drain();
    }
    // A micro-step that failed keeps no gather: what follows may be anything (a checkpoint load).
    release_all(keep_grads, keep_grads && keeps_gathered() && !first && missing.empty());
    if (first) std::rethrow_exception(first);
    if (!missing.empty()) {
      throw InvalidArgument(where_ + ": backward reported no gradient for " + missing +
                            ". Every unit must call ctx.ready(u) in every step");
    }
    if (summed_means_ > 1) {
      const auto k = static_cast<T>(1.0 / static_cast<double>(summed_means_));
      for (T& x : state_.grad_shard()) x *= k;
    }
  }

  /// Lets whatever is in flight end: its jobs use the units' buffers.
  void settle_all() noexcept { issuer_.settle_all(); }

  /// After a step that threw, or an evaluation: what is in flight ends and
  /// every gathered unit is freed (an evaluation keeps the gradients).
  void abandon() noexcept {
    issuer_.spans.end();
    issuer_.settle_all();
    release_all(evaluating_);
    evaluating_ = false;
  }

 private:
  bool sharded() const noexcept { return o_.strategy != ShardingStrategy::NoShard; }
  bool full_shard() const noexcept {
    return o_.strategy == ShardingStrategy::FullShard || o_.strategy == ShardingStrategy::HybridShard;
  }
  /// ShardGradOp in a NoSync micro-step keeps each unit gathered until the
  /// synced step's backward, as FSDP's SHARD_GRAD_OP inside no_sync: the
  /// parameters cannot change before the optimizer step, so a gather per
  /// micro-step would move the same bytes K times.
  bool keeps_gathered() const noexcept { return sharded() && !full_shard() && !reducing_; }

  std::string layer_name(std::size_t layer) const {
    return "unit " + std::to_string(layer) + " ('" + state_.specs[layer].name + "')";
  }
  Unit& unit_of(std::size_t layer) { return units_[state_.flat.member_of[layer]]; }
  void check_layer(std::size_t layer, const char* what) const {
    if (layer >= state_.specs.size()) {
      throw InvalidArgument(where_ + ": the model " + what + " unit " + std::to_string(layer) +
                            ", which does not exist (" + std::to_string(state_.specs.size()) + " units)");
    }
  }

  /// Storage for a gathered unit or a gradient buffer of n elements, from
  /// the pool (see BufferPool); `zero`: a gradient buffer, which the model adds into.
  Storage<T> take(std::size_t n, bool zero) {
    return pool_.take(n, zero, [this]() noexcept { return transient_held(units_); });
  }
  /// What returns a buffer's storage to the pool (then empties it).
  auto giver() noexcept {
    return [this](Storage<T>& v) noexcept { pool_.give(v, [this]() noexcept { return transient_held(units_); }); };
  }
  /// Records the high-water mark of what gathered units and gradient
  /// buffers hold; called after each allocation, where the sum can only have grown.
  void track_transient() noexcept { peak_.track(transient_held(units_)); }

  /// A gradient buffer for `unit`'s backward: the padded unit, N·c, from
  /// which the reduce-scatter reads (offloaded, c more, where its result
  /// lands before it is copied out). FullShard holds one at a time (the
  /// previous unit's reduction is waited for); ShardGradOp gathers nothing
  /// in backward, so one reduction may run while the next gradient is filled.
  void take_grad(Unit& unit) {
    issuer_.retire_reductions(full_shard() ? 0 : 1, giver());
    const std::size_t n = static_cast<std::size_t>(comms_.shard().size()) + (o_.offload ? 1 : 0);
    unit.take_grad(take(state_.flat.chunks[unit.index()] * n, true));
    track_transient();
  }

  /// Starts gathering wrapped unit w on the worker, behind what is queued there.
  void gather(std::size_t w) {
    Unit& unit = units_[w];
    const std::size_t padded = state_.flat.chunks[w] * static_cast<std::size_t>(comms_.shard().size());
    if constexpr (computes_bf16) {
      // The model's views point into what the gather receives.
      unit.start_gather({}, std::vector<bfloat16>(padded, bfloat16(0.0f)));
    } else {
      // A unit kept in bfloat16 keeps the copy it receives; otherwise that copy is the worker's scratch.
      unit.start_gather(take(padded, false),
                        keep_bf16_ ? std::vector<bfloat16>(padded) : std::vector<bfloat16>());
    }
    track_transient();
    issuer_.gather(unit, labelled_(LabelPhase::gather, w), state_.chunk(w), precision_.params_bf16, o_.offload.get());
  }

  /// Gathers w ahead of its `asks`-th ask (1: forward, 2: backward),
  /// unless it is gathered, the limit is reached, or it was asked for that
  /// often already (a model whose order is not the one assumed: it would
  /// stay gathered, never asked for again, to the step's end), or another
  /// unit gathered ahead still waits for its ask: at most one does, as
  /// memory_need() counts, whatever the order and limit_all_gathers.
  void prefetch(std::size_t w, int asks) {
    if (units_[w].gathered() || prefetched_ || units_[w].members().all_asked(asks)) return;
    if (o_.limit_all_gathers != 0 && gathered_units(units_) >= o_.limit_all_gathers) return;
    gather(w);
    prefetched_ = w;
  }

  /// Frees the units whose forward use ended (FullShard) but were kept in
  /// case the model came back to them, other than `except`.
  void free_lingering(std::size_t except) {
    std::erase_if(lingering_, [&](std::size_t w) {
      if (w == except) return false;
      units_[w].free_if_unheld(giver());
      return true;
    });
  }

  /// A model computing in bfloat16: `unit`'s gradient, final in its
  /// bfloat16 buffer, is added into the master-type buffer that is reduced
  /// (under NoSync, the one kept across micro-steps), and the bfloat16 one
  /// goes. Each rank's gradient is rounded once, by the model's arithmetic;
  /// the reduction and the accumulation are in reduce_dtype and the master type.
  void fold_bf16_grad(Unit& unit) {
    const std::size_t w = unit.index(), at = state_.flat.offsets[w], count = state_.flat.sizes[w];
    if (!sharded()) {
      // NoShard: into the whole unit's gradient in the shard, reduced in place
      // (the trainer zeroes the bfloat16 ones before each backward).
      add_widened(std::span<T>(state_.shard_grads).subspan(at, count),
                  std::span<const bfloat16>(state_.bf16_grads).subspan(at, count));
      return;
    }
    if (unit.grad.empty()) take_grad(unit);
    add_widened(std::span<T>(unit.grad).first(unit.bf16_grad.size()), std::span<const bfloat16>(unit.bf16_grad));
    unit.drop_bf16_grad();
  }

  /// `keep_gathered`: the gathered units stay too (keeps_gathered()).
  void release_all(bool keep_grads, bool keep_gathered = false) noexcept {
    lingering_.clear();
    prefetched_.reset();
    issuer_.forget_reductions();
    for (Unit& unit : units_) unit.end_step(keep_grads, keep_gathered, giver());
  }

  const ShardedTrainerOptions& o_;
  HybridGroups<Comm>& comms_;
  ShardedState<T, C>& state_;
  std::string where_;
  /// Each wrapped unit's lifecycle and buffers.
  std::vector<Unit> units_;
  CollectiveIssuer<T, C, Algo, Comm> issuer_;
  StepStats& step_;
  Labeller labelled_;
  Precision precision_;
  /// Kept units keep only their bfloat16 copy (ShardGradOp, where it pays).
  bool keep_bf16_ = false;
  bool evaluating_ = false;
  /// This backward reduces each ready unit (false: a NoSync micro-step).
  bool reducing_ = true;
  /// Applied to each unit's local gradient before its reduction.
  T local_scale_ = T(1);
  /// Sharded accumulation after the first micro-step: reductions add into the shard.
  bool add_ = false;
  /// Sharded accumulation's synced step: the means of this many micro-steps are summed in the shard.
  std::size_t summed_means_ = 1;
  /// Wrapped units kept gathered after their forward until another is asked
  /// for (keep_last_forward_unit, or members not yet asked).
  std::vector<std::size_t> lingering_;
  /// The unit prefetch() gathered that has not been asked for since.
  std::optional<std::size_t> prefetched_;
  TransientPeak peak_;
  /// Storage of freed gathered units and gradient buffers, kept for the
  /// next of the same size; with what is in use, at most the transient need.
  BufferPool<T> pool_;
};

}  // namespace gradsync::detail::fsdp

#pragma once
/// \file detail::fsdp::UnitGroup: one wrapped unit through a step. Its
/// parameters and its gradient each move through a few phases, every move
/// is a named method that checks the phase it starts from, and the rules
/// that decide when a released unit is freed, kept or left to linger (the
/// sharding strategies' difference) are here and nowhere else. Which
/// collective runs for a move is collective_issuer.hpp's business, when a
/// move happens the trainer's (it follows the model's asks), and whether
/// the model keeps to its protocol unit_members.hpp's.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/request.hpp"
#include "gradsync/train/fsdp/buffer_pool.hpp"
#include "gradsync/train/fsdp/sharding_strategy.hpp"
#include "gradsync/train/fsdp/unit_members.hpp"

namespace gradsync::detail::fsdp {

/// Where a wrapped unit's parameters are. Parameters and gradient move
/// separately: a unit is still gathered while its gradient is reduced.
enum class ParamPhase : std::uint8_t {
  sharded,    ///< only this rank's chunk, in the flat shard
  gathering,  ///< a gather into its buffers is queued on the worker
  gathered,   ///< whole, for the model
  lingering,  ///< whole, released in forward; freed once another unit is asked for
  kept_bf16,  ///< ShardGradOp: only the bfloat16 copy its gather received is kept
};

/// Where a wrapped unit's unsharded gradient is.
enum class GradPhase : std::uint8_t {
  none,      ///< no gradient buffer
  filling,   ///< the model adds into it (kept across NoSync micro-steps)
  reducing,  ///< a reduction on the worker reads it (or, unsharded, the shard)
};

constexpr const char* name(ParamPhase p) noexcept {
  constexpr const char* names[] = {"sharded", "gathering", "gathered", "lingering", "kept in bfloat16"};
  return names[static_cast<int>(p)];
}
constexpr const char* name(GradPhase p) noexcept {
  constexpr const char* names[] = {"without a gradient buffer", "filling its gradient", "reducing its gradient"};
  return names[static_cast<int>(p)];
}

/// What decides, besides the strategy, what a release does in this step.
struct ReleaseRules {
  bool evaluating = false;
  /// FullShard: the unit released last in forward stays until another is asked for.
  bool keep_last_forward_unit = true;
  /// ShardGradOp in a NoSync micro-step: units stay gathered to the synced backward.
  bool keeps_gathered = false;
  /// ShardGradOp with param_dtype bfloat16: a kept unit keeps its bfloat16 copy only.
  bool keeps_bf16 = false;
};

/// One wrapped unit: model units [first, last] gathered and reduced as one
/// buffer. T is the master type, C the model's compute type.
template <class T, class C>
class UnitGroup {
 public:
  UnitGroup(std::size_t index, std::string name, std::size_t first, std::size_t last, ShardingStrategy strategy)
      : index_(index), name_(std::move(name)), strategy_(strategy), members_(first, last) {}

  std::size_t index() const noexcept { return index_; }
  /// "wrapped unit 2 ('layer2..layer3')", for messages.
  std::string describe() const { return "wrapped unit " + std::to_string(index_) + " ('" + name_ + "')"; }
  ParamPhase params() const noexcept { return params_; }
  GradPhase grads() const noexcept { return grads_; }
  /// Its parameters are gathered or being gathered: what limit_all_gathers counts.
  bool gathered() const noexcept { return params_ != ParamPhase::sharded; }
  /// Bytes its gathered and gradient buffers hold now.
  std::size_t held_bytes() const noexcept {
    return (full.capacity() + grad.capacity()) * sizeof(T) + (bf16.capacity() + bf16_grad.capacity()) * sizeof(bfloat16);
  }

  /// A step (or evaluation) starts: no member asked, held or ready.
  void begin_step() noexcept { members_.begin_step(); }
  /// The model protocol of its model units; an ask goes through ask().
  UnitMembers<C>& members() noexcept { return members_; }

  /// The model asks for member `layer` (`layer_name` for messages); returns
  /// whether it is the backward ask. A lingering unit is taken back.
  bool ask(std::size_t layer, bool evaluating, const std::string& where, const std::string& layer_name) {
    const bool backward = members_.ask(layer, evaluating, where, layer_name);
    if (params_ == ParamPhase::lingering) params_ = ParamPhase::gathered;
    return backward;
  }

  /// The model lets go of member `layer`. Once it holds no member, the
  /// strategy decides: FullShard frees the unit after its forward (or lets
  /// it linger: the last one in forward under keep_last_forward_unit, one
  /// whose members are not all asked for yet); ShardGradOp keeps it to its
  /// backward; every strategy frees it after its backward, but ShardGradOp
  /// in a NoSync micro-step. Returns true when it lingers, for the caller
  /// to free it once another unit is asked for.
  template <class Give>
  bool release(std::size_t layer, const ReleaseRules& rules, Give&& give) {
    const int asks = members_.let_go(layer);
    if (asks == 0) return false;
    if (strategy_ == ShardingStrategy::NoShard || members_.held() > 0) return false;
    if (rules.evaluating) {
      if (!members_.all_asked(1)) {
        linger(true);
        return true;
      }
      reshard(give);
      return false;
    }
    if (asks == 1) {
      if (!frees_after_forward()) {
        if (rules.keeps_bf16) keep_bf16_only(give);
        return false;
      }
      if (members_.all_asked(1) && !rules.keep_last_forward_unit) {
        reshard(give);
        return false;
      }
      linger(false);
      return true;
    }
    if (!members_.all_asked(2)) return false;
    if (!rules.keeps_gathered) {
      reshard(give);
    } else if (rules.keeps_bf16) {
      keep_bf16_only(give);
    }
    return false;
  }
  /// Frees a lingering unit the model does not hold (false: it holds one).
  template <class Give>
  void free_if_unheld(Give&& give) {
    if (members_.held() == 0) reshard(give);
  }

  /// A gather into `into` (N·c, the master type; empty for a bfloat16
  /// model) and `into_bf16` (the bfloat16 copy kept, or empty) is queued.
  void start_gather(Storage<T> into, std::vector<bfloat16> into_bf16) {
    expect(params_ == ParamPhase::sharded, "start a gather");
    full = std::move(into);
    bf16 = std::move(into_bf16);
    params_ = ParamPhase::gathering;
  }
  /// The queued gather is over (`gathering` waited for, or settled).
  void gather_done() noexcept {
    gathering = Request();
    if (params_ == ParamPhase::gathering) params_ = ParamPhase::gathered;
  }
  /// The value_type copy of a unit kept in bfloat16, widened into `into`.
  void widen(Storage<T> into) {
    expect(params_ == ParamPhase::kept_bf16, "widen its bfloat16 copy");
    full = std::move(into);
    for (std::size_t i = 0; i < bf16.size(); ++i) full[i] = static_cast<T>(static_cast<float>(bf16[i]));
    params_ = ParamPhase::gathered;
  }
  /// Frees the gathered parameters; not while a gather writes them.
  template <class Give>
  void reshard(Give&& give) {
    expect(params_ != ParamPhase::gathering, "free its parameters");
    give(full);
    std::vector<bfloat16>().swap(bf16);
    params_ = ParamPhase::sharded;
  }

  /// A gradient buffer for this backward (or, NoSync, for every micro-step up to the synced one).
  void take_grad(Storage<T> buffer) {
    expect(grad.empty(), "take a gradient buffer");
    grad = std::move(buffer);
    grads_ = GradPhase::filling;
  }
  /// A bfloat16 model's gradient buffer for this backward.
  void take_bf16_grad(std::vector<bfloat16> buffer) {
    expect(bf16_grad.empty(), "take a bfloat16 gradient buffer");
    bf16_grad = std::move(buffer);
    grads_ = GradPhase::filling;
  }
  /// The bfloat16 gradient has been added into `grad` and goes.
  void drop_bf16_grad() noexcept { std::vector<bfloat16>().swap(bf16_grad); }
  /// `r` reduces the gradient on the worker.
  void start_reduction(Request r) {
    expect(grads_ != GradPhase::reducing, "start a reduction");
    reduction = std::move(r);
    grads_ = GradPhase::reducing;
  }
  /// Its reduction is over (or failed, which drain rethrows): the buffers go.
  template <class Give>
  void retire(Give&& give) {
    expect(grads_ == GradPhase::reducing, "retire its reduction");
    give(grad);
    drop_bf16_grad();
    grads_ = GradPhase::none;
  }

  /// The step ends with nothing in flight (waited for or settled): the
  /// gradient buffer stays with `keep_grads` (a NoSync micro-step), the
  /// gathered parameters with `keep_gathered` (keeps_gathered), else both go.
  template <class Give>
  void end_step(bool keep_grads, bool keep_gathered, Give&& give) noexcept {
    reduction = Request();
    gather_done();
    if (!keep_grads) give(grad);
    // Folded at ready; one is left only by a backward that failed part-way.
    drop_bf16_grad();
    grads_ = grad.empty() ? GradPhase::none : GradPhase::filling;
    if (strategy_ != ShardingStrategy::NoShard && !keep_gathered) reshard(give);
    members_.drop_holds();
  }

  /// The buffers, which the collectives read and write on the worker; the
  /// phases above say which exist.
  Storage<T> full;  ///< gathered parameters, N·c (empty when sharded)
  /// param_dtype bfloat16 under ShardGradOp (keeps_bf16): the unit as it
  /// was gathered, kept from its forward to its backward while `full`
  /// exists only while the model holds it. A model computing in bfloat16:
  /// the gathered unit itself (no `full`).
  std::vector<bfloat16> bf16;
  Storage<T> grad;  ///< unsharded gradient, the padded unit N·c (NoSync keeps it)
  /// A model computing in bfloat16: its gradient of this backward, N·c.
  std::vector<bfloat16> bf16_grad;
  Request reduction;  ///< the gradient's reduction
  /// A reduction of this step found a NaN or Inf in this rank's part of the
  /// result; written on the worker, read once the reduction has been waited for.
  bool nonfinite = false;
  Request gathering;  ///< the gather into `full` or `bf16`, until an ask waits for it

 private:
  bool frees_after_forward() const noexcept {
    return strategy_ == ShardingStrategy::FullShard || strategy_ == ShardingStrategy::HybridShard;
  }
  /// Lingering is FullShard's, after forward, and any sharded strategy's in evaluation.
  void linger(bool evaluating) {
    expect(params_ == ParamPhase::gathered && (evaluating || frees_after_forward()), "linger");
    params_ = ParamPhase::lingering;
  }
  template <class Give>
  void keep_bf16_only(Give&& give) {
    expect(params_ == ParamPhase::gathered && strategy_ == ShardingStrategy::ShardGradOp,
           "keep only its bfloat16 copy");
    give(full);
    params_ = ParamPhase::kept_bf16;
  }
  /// A move from the wrong phase is the trainer's error, never the model's.
  void expect(bool allowed, const char* move) const {
    if (allowed) return;
    throw Error("gradsync: ShardedTrainer's " + describe() + " under " + name(strategy_) + " was " + name(params_) +
                " and " + name(grads_) + " when asked to " + move);
  }

  std::size_t index_;
  std::string name_;
  ShardingStrategy strategy_;
  UnitMembers<C> members_;
  ParamPhase params_ = ParamPhase::sharded;
  GradPhase grads_ = GradPhase::none;
};

/// Wrapped units whose parameters are gathered (or being gathered) now:
/// what ShardedTrainerOptions::limit_all_gathers bounds.
template <class T, class C>
std::size_t gathered_units(const std::vector<UnitGroup<T, C>>& units) noexcept {
  std::size_t n = 0;
  for (const UnitGroup<T, C>& u : units) n += u.gathered() ? 1 : 0;
  return n;
}

/// Bytes of gathered units and gradient buffers held now.
template <class T, class C>
std::size_t transient_held(const std::vector<UnitGroup<T, C>>& units) noexcept {
  std::size_t held = 0;
  for (const UnitGroup<T, C>& u : units) held += u.held_bytes();
  return held;
}

}  // namespace gradsync::detail::fsdp

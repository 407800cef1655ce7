#pragma once
/// \file ShardedTrainer: parameters, gradients and optimizer state 1/N per rank (PyTorch FSDP, ZeRO-3 semantics).
///
/// The façade: the public class, its step and the order of its calls. Its
/// parts are in train/fsdp/: the persistent state, its construction and
/// its gathers between steps (sharded_state.hpp), the communicators
/// (hybrid_groups.hpp), the model's asks (unit_lender.hpp), one wrapped
/// unit's lifecycle (unit_group.hpp), the collectives it queues
/// (collective_issuer.hpp, collectives.hpp), clipping over the shards
/// (clip_grad_norm.hpp) and the memory accounting (memory.hpp).

#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/collective/broadcast.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/trace_scope.hpp"
#include "gradsync/train/common/memory_need.hpp"
#include "gradsync/train/common/model.hpp"
#include "gradsync/train/common/step_labels.hpp"
#include "gradsync/train/common/step_stats.hpp"
#include "gradsync/train/common/trainer_base.hpp"
#include "gradsync/train/common/trainer_requirements.hpp"
#include "gradsync/train/common/trainer_stats.hpp"
#include "gradsync/train/fsdp/accumulation_mode.hpp"
#include "gradsync/train/fsdp/backward_prefetch.hpp"
#include "gradsync/train/fsdp/clip_grad_norm.hpp"
#include "gradsync/train/fsdp/hybrid_groups.hpp"
#include "gradsync/train/fsdp/memory.hpp"
#include "gradsync/train/fsdp/options.hpp"
#include "gradsync/train/fsdp/shard_plan.hpp"
#include "gradsync/train/fsdp/sharded_state.hpp"
#include "gradsync/train/fsdp/sharding_strategy.hpp"
#include "gradsync/train/fsdp/trace_event.hpp"
#include "gradsync/train/fsdp/unit_lender.hpp"
#include "gradsync/train/fsdp/wrap_policy.hpp"
#include "gradsync/train/optim/optimizer.hpp"

namespace gradsync {

/// Trains `Model` with 1/N of every unit's parameters, gradients and
/// optimizer state on each rank of `Comm`: each wrapped unit is gathered
/// when the model asks for it and its gradient reduce-scattered to its
/// owners when ready, every collective on the communicator's ProgressWorker
/// in the order the model asks, the same on every rank. step() is
/// forward_backward() then optimizer_step(); clip_grad_norm() may run
/// between them, accumulate() runs a micro-step. ShardedTrainerOptions picks
/// the strategy, wrapping, prefetch, mixed precision, offload and the
/// memory budget. docs/FSDP.md states the semantics in full (layout,
/// strategies, prefetch, accumulation, clipping, memory), with their sources.
///
/// \tparam M     the model (see gradsync::Model); its forward_backward must use StepContext.
/// \tparam Opt   an optimizer on flat spans of M::value_type (Sgd, Adam, AdamW, ...).
/// \tparam Comm  gradsync::Communicator<Backend>.
/// \tparam Algo  the algorithm of every collective.
template <class M, class Opt, class Comm, class Algo = Auto>
class ShardedTrainer : public detail::TrainerBase<ShardedTrainer<M, Opt, Comm, Algo>, M, Opt, Comm, Algo> {
  using Base = detail::TrainerBase<ShardedTrainer, M, Opt, Comm, Algo>;

 public:
  ShardedTrainer(Comm& comm, M model, Opt optimizer, ShardedTrainerOptions options = {})
      : Base("ShardedTrainer", comm, std::move(model), std::move(optimizer)), o_(options), specs_(model_.units()) {
    // Offload decides where the shards live and so the compute side's need:
    // it must agree too, as the budget does.
    this->agree(specs_, o_.memory_budget, detail::fsdp::agreed_options(o_));
    const auto precision = detail::fsdp::read_precision<value_type, computes_bf16>(o_, where(), specs_);
    detail::fsdp::check_offload(o_, where());
    comms_.split(o_, where());
    lay_out(precision);
    if (state_.flat.total == 0) {
      // Every rank declared the same units, so every rank throws this.
      throw InvalidArgument(where() + ": the model declares no parameters (" + std::to_string(specs_.size()) +
                            " units, 0 elements); there is nothing to shard or train");
    }
    detail::fsdp::check_budget(where(), o_, state_.flat, memory_facts());
    lender_.reserve(memory_need().transient());
    state_.template initialise<Algo>(model_, comm_, o_.collective, static_cast<std::size_t>(shard_rank()));
    lender_.start();
  }
  ShardedTrainer(const ShardedTrainer&) = delete;
  ShardedTrainer& operator=(const ShardedTrainer&) = delete;
  /// What is in flight uses this trainer's buffers: let it end first.
  ~ShardedTrainer() { lender_.settle_all(); }

  using typename Base::backend_type, typename Base::value_type, typename Base::compute_type;

  /// The first half of step(): forward and backward, each unit gathered
  /// when asked for and its gradient reduced to its owner as soon as it is
  /// ready, without the optimizer step. Then clip_grad_norm() if you like,
  /// and optimizer_step().
  /// Returns this rank's loss on `batch`.
  template <class Batch>
  double forward_backward(const Batch& batch) {
    static_assert(detail::TrainerRequirements<M, Opt>::template batch<Batch>());
    this->check_no_pending("forward_backward");
    const double loss = failing_together([&] {
      enter(detail::TrainerEntry::forward_backward);
      if (o_.broadcast_buffers && !state_.buffers.empty()) {
        Broadcast<Algo>{labelled(detail::LabelPhase::buffers, 0)}(comm_, std::span<value_type>(state_.buffers), 0);
      }
      return run_model(batch, true);
    });
    check_finite();
    this->mark_pending();
    return loss;
  }

  /// A micro-step: forward and backward on `batch`, its gradient kept for
  /// the next step() (ShardedTrainerOptions::accumulation says how). K−1
  /// calls of accumulate() and one step() equal one step on K times the
  /// samples with the loss scaled by 1/K: the mean over micro-batches, which
  /// is the mean over their samples when micro-batches are of equal size.
  /// A micro-step that throws drops what was accumulated.
  template <class Batch>
  double accumulate(const Batch& batch) {
    static_assert(detail::TrainerRequirements<M, Opt>::template batch<Batch>());
    this->check_no_pending("accumulate");
    detail::fsdp::check_accumulate(o_, where());
    const double loss = failing_together([&] {
      enter(detail::TrainerEntry::accumulate);
      return run_model(batch, false);
    });
    ++micro_steps_;
    return loss;
  }

  /// Between forward_backward() and optimizer_step(): the global norm of
  /// order p of the averaged gradient (infinity: the largest magnitude).
  /// Each rank takes Σ|g|^p (or max|g|) over its shard, an AllReduce Sum (or
  /// Max) combines them, so every rank returns the same value; under NoShard
  /// every rank holds the whole gradient (each element counted once). If the
  /// norm exceeds max_norm, the gradient is scaled by max_norm / (norm +
  /// 1e-6), as PyTorch's clip_grad_norm_.
  /// Collective, labelled with max_norm and p: ranks that clip differently
  /// fail here on every rank, naming both (NoShard pays one 8-byte
  /// all-reduce over all ranks for it, HybridShard one of 4 bytes).
  double clip_grad_norm(double max_norm, double p = 2.0) {
    detail::check_norm_order("ShardedTrainer", max_norm, p);
    this->check_pending("clip_grad_norm");
    Options opts = o_.collective;
    opts.label = this->clip_label(max_norm, p);
    const detail::TraceScope span(this->timeline(), detail::TraceKind::clip, this->stats_.steps + 1);
    return failing_together([&] {
      return detail::fsdp::clip_grad_norm<Algo>(comms_, sharded(), state_.grad_shard(), max_norm, p, opts);
    });
  }

  /// The second half of step(): the optimizer step on this rank's shard;
  /// the gradient shard is then zeroed.
  void optimizer_step() {
    this->begin_optimizer_step(comms_.shard_is_world(), [this](const std::string& what) {
      lender_.settle_all();
      comms_.fail_all(what);
    });
    micro_steps_ = 0;
    // Offloaded, both shards are in the offload space: the optimizer steps there.
    this->step_optimizer(state_.master(), state_.grad_shard());
    state_.zero_padding(static_cast<std::size_t>(shard_rank()));
  }

  /// Runs `f(ctx)` with a StepContext for a forward without backward
  /// (evaluation): each ask gathers the unit and its release frees it;
  /// ctx.ready throws. Returns what f returns. Collective: every rank must
  /// ask for the same units in the same order.
  template <class F>
  decltype(auto) evaluate(F&& f) {
    failing_together([&] { enter(detail::TrainerEntry::evaluate); });
    lender_.begin_step(true);
    // An evaluation's gathers are not the last step's.
    struct End {
      ShardedTrainer& t;
      StepStats step;
      ~End() {
        t.abandon_step();
        t.step_ = step;
      }
    } end{*this, step_};
    state_.round_copies(false);
    const StepContext<compute_type> ctx(lender_);
    try {
      return failing_together([&]() -> decltype(auto) { return std::forward<F>(f)(ctx); });
    } catch (...) {
      lender_.settle_all();
      abandon_groups("evaluate()");
      throw;
    }
  }

  const ShardedTrainerOptions& options() const noexcept { return o_; }
  const std::vector<UnitSpec>& units() const noexcept { return specs_; }

  /// The wrapping plan: wrapped units, their model units, sizes and bytes
  /// per rank (print it with to_string or <<).
  const ShardPlan& plan() const noexcept { return state_.plan; }
  /// The wrapped unit that holds model unit `model_unit`.
  std::size_t wrapped_unit_of(std::size_t model_unit) const { return state_.flat.member_of.at(model_unit); }

  /// Below, `u` is a wrapped unit (the model unit itself under the default
  /// WrapPolicy::per_unit()).
  ///
  /// This rank's shard of every unit, padded chunks one after the other.
  std::span<const value_type> shard() const noexcept { return state_.master(); }
  /// Unit u's elements (unpadded).
  std::size_t unit_size(std::size_t u) const { return state_.flat.sizes.at(u); }
  /// Elements of each rank's chunk of unit u (padding included): ⌈P/N⌉, or P under NoShard.
  std::size_t chunk_size(std::size_t u) const { return state_.flat.chunks.at(u); }
  /// Unit u's elements this rank owns, [first, first + count) of the unit;
  /// the rest of its chunk is zero padding. Under NoShard: all of them.
  std::pair<std::size_t, std::size_t> owned_range(std::size_t u) const {
    return state_.flat.owned_range(u, static_cast<std::size_t>(comms_.shard().rank()));
  }
  /// This rank's chunk of unit u, padding included.
  std::span<const value_type> unit_shard(std::size_t u) const { return state_.chunk(u); }

  /// Gathers every unit's parameters, unpadded, units in declaration order
  /// (what ReplicatedTrainer::parameters() holds). Collective.
  std::vector<value_type> full_parameters() {
    failing_together([&] { enter(detail::TrainerEntry::full_parameters); });
    return state_.template gather_all<Algo>(comms_.shard(), [this](std::size_t w) {
      return labelled(detail::LabelPhase::gather, w);
    });
  }

  std::span<value_type> buffers() noexcept { return state_.buffers; }

  /// Bytes this rank keeps between steps: its parameter and gradient shards
  /// and the optimizer's state on them (the formula, with what offload and a
  /// bfloat16 model change: detail::fsdp::persistent_bytes, memory.hpp).
  std::size_t persistent_bytes() const noexcept {
    return detail::fsdp::persistent_bytes(state_.master().size(), state_.bf16_params.size() + state_.bf16_grads.size(),
                                          memory_facts());
  }

  /// What this rank needs, by the formula (detail::sharded_memory_need):
  /// persistent bytes exactly, transient bytes as the most a step holds at
  /// once (an upper bound; exact for FullShard without prefetch).
  MemoryNeed memory_need() const {
    return detail::fsdp::trainer_need(o_, o_.strategy, state_.flat, memory_facts());
  }
  /// The most transient bytes (gathered wrapped units, gradient buffers)
  /// this rank really held at once since construction or reset_peak_transient().
  std::size_t peak_transient_bytes() const noexcept { return lender_.peak_transient_bytes(); }
  void reset_peak_transient() noexcept { lender_.reset_peak_transient(); }
  /// What construction held beside the persistent part: the model's
  /// initial values in full before they were sharded (one wrapped unit if
  /// the model has init_unit, every parameter if it has only bind, nothing
  /// under NoShard). memory_need().construction is its formula.
  std::size_t construction_bytes() const noexcept { return state_.construction_bytes; }

  /// The collectives of the last step, in the order this rank issued them.
  /// last_step() counts their elements and bytes as Ring sends them; with
  /// param_dtype or reduce_dtype bfloat16 the bytes are 2 per element.
  const std::vector<ShardedTraceEvent>& trace() const noexcept { return lender_.trace(); }

  // Checkpoint access
  /// No forward_backward() waits for its optimizer_step() and nothing is
  /// accumulated: the only moments a checkpoint can be taken or loaded.
  /// Nothing is gathered then either (a step ends by freeing every unit,
  /// the one keep_last_forward_unit kept included).
  bool between_steps() const noexcept { return !pending_ && micro_steps_ == 0 && lender_.idle(); }
  /// This rank's master shard, writable (a checkpoint load writes it
  /// between steps; keep the padding zero).
  std::span<value_type> shard() noexcept { return state_.master(); }
  /// Wrapped units, for unit_size, chunk_size, chunk_offset, owned_range.
  std::size_t unit_count() const noexcept { return state_.flat.sizes.size(); }
  /// Where unit u's chunk starts in shard() (and in the optimizer's state).
  std::size_t chunk_offset(std::size_t u) const { return state_.flat.offsets.at(u); }
  /// This rank's place in its shard group, and the group's size: the
  /// chunk it owns and how many there are (NoShard: 0 of 1).
  int shard_rank() const noexcept { return sharded() ? comms_.shard().rank() : 0; }
  int shard_count() const noexcept { return sharded() ? comms_.shard().size() : 1; }
  /// Which copy of the shards this rank holds: HybridShard's group index,
  /// NoShard's rank, else 0. Replica 0 writes a checkpoint.
  int replica() const noexcept { return sharded() ? comm_.rank() / comms_.shard().size() : comm_.rank(); }
  /// Gathers a shard-shaped buffer's unit u, `chunk` (chunk_size(u)
  /// elements: the parameters' or an optimizer moment's), into `full`
  /// (shard_count()·chunk_size(u) elements, padding last). Collective over
  /// the shard group, between steps; under HybridShard without a world
  /// agreement first (a full save calls it on replica 0 alone, after its own).
  void gather_chunk(std::size_t u, std::span<const value_type> chunk, std::span<value_type> full) {
    const std::size_t c = state_.flat.chunks.at(u), n = static_cast<std::size_t>(shard_count());
    if (chunk.size() != c || full.size() != chunk.size() * n) {
      throw InvalidArgument(where() + ": gather_chunk of " + lender_.describe(u) + " takes " + std::to_string(c) +
                            " elements into " + std::to_string(c * n) + ", got " + std::to_string(chunk.size()) +
                            " into " + std::to_string(full.size()));
    }
    state_.template gather_chunk<Algo>(comms_.shard(), chunk, full, labelled(detail::LabelPhase::gather, u));
  }

 private:
  using Base::comm_, Base::model_, Base::opt_, Base::step_, Base::pending_, Base::micro_steps_, Base::labels_,
      Base::where;
  using Lender = detail::fsdp::UnitLender<value_type, compute_type, Algo, Comm>;

  /// The model computes in bfloat16 (compute_type): its units are gathered
  /// into bfloat16 storage that its views point into, and it writes its
  /// gradients in bfloat16.
  static constexpr bool computes_bf16 = !std::is_same_v<compute_type, value_type>;
  /// The optimizer can keep its state in storage the trainer lends it.
  static constexpr bool bindable = requires(Opt& o, std::span<value_type> s, std::size_t n) { o.bind_state(s, n); };

  std::size_t optimizer_state_per_element() const noexcept { return detail::optimizer_state_per_element(opt_); }
  bool sharded() const noexcept { return o_.strategy != ShardingStrategy::NoShard; }
  bool offloaded() const noexcept { return o_.offload != nullptr; }
  /// Offloaded, the optimizer's state is in the space too (else in the optimizer).
  bool state_in_space() const noexcept { return offloaded() && bindable; }

  /// Lays out the wrapped units, their plan, their lifecycles and the labels
  /// of their collectives; a custom wrapping predicate's grouping is agreed.
  void lay_out(detail::fsdp::Precision precision) {
    const auto shards = static_cast<std::size_t>(comms_.shard().size());
    state_.lay_out(o_, shards, static_cast<std::size_t>(comm_.size()) / shards, opt_, optimizer_state_per_element());
    lender_.lay_out(precision, [this](detail::LabelPhase phase, std::size_t w) { return labelled(phase, w); });
    labels_.emplace("step", "wrapped unit", state_.label_names(), "optimizer lr");
    labels_->set_ordinal(this->ordinal_);
    if (o_.wrap.is_custom()) state_.check_plan_agrees(comm_);
  }

  /// Runs f; a failure of one of HybridShard's communicators fails the others alike.
  template <class F>
  decltype(auto) failing_together(F&& f) {
    return comms_.failing_together(std::forward<F>(f), [this]() noexcept { lender_.settle_all(); });
  }
  Options labelled(detail::LabelPhase phase, std::size_t index) const {
    return Base::labelled(o_.collective, phase, index);
  }
  /// HybridShard's world agreement on the public call `e` (hybrid_groups.hpp).
  void enter(detail::TrainerEntry e) {
    comms_.template enter<Algo>(labelled(detail::LabelPhase::entry, static_cast<std::size_t>(e)));
  }
  /// Inside a catch block, after the model threw in `call` (under
  /// HybridShard, with the communicators sound): fails them all, naming
  /// this rank, the step and what the model threw (hybrid_groups.hpp says why).
  void abandon_groups(const char* call) noexcept {
    if (comms_.shard_is_world()) return;
    const char* what = detail::current_exception_what("an exception");
    try {
      comms_.abandon(where() + ": rank " + std::to_string(comm_.rank()) + "'s model threw in " + call + " of step " +
                     std::to_string(this->stats_.steps + 1) + " (" + what +
                     "); under HybridShard a step abandoned on one rank ends the trainer on every rank");
    } catch (...) {
      comms_.abandon("a rank's model threw under HybridShard");
    }
  }

  /// Forward and backward; `sync`: the step that reduces (forward_backward),
  /// else a micro-step of accumulate().
  template <class Batch>
  double run_model(const Batch& batch, bool sync) {
    // A step's figures cover all its micro-steps.
    if (micro_steps_ == 0) step_ = {};
    this->mark_step_begin();
    lender_.begin_training_step(sync, micro_steps_);
    const auto t0 = std::chrono::steady_clock::now();
    const double exposed_before = step_.exposed_comm_seconds;
    double loss = 0;
    try {
      state_.round_copies(true);
      const StepContext<compute_type> ctx(lender_);
      loss = static_cast<double>(model_.forward_backward(batch, ctx));
      this->note_loss(loss);
    } catch (...) {
      abandon_step();
      abandon_groups(sync ? "forward_backward()" : "accumulate()");
      throw;
    }
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    this->stats_.compute_seconds += wall;
    step_.compute_seconds += wall - (step_.exposed_comm_seconds - exposed_before);
    lender_.finish();
    return loss;
  }

  /// The step's reduced gradient and losses, checked (OnNonfinite); a
  /// step that throws drops what its micro-steps accumulated too.
  void check_finite() {
    try {
      failing_together([&] {
        this->check_nonfinite(
            o_.on_nonfinite, lender_.first_nonfinite(), o_.collective,
            [this](std::size_t w) { return lender_.describe(w); }, state_.grad_shard(), micro_steps_ + 1);
      });
    } catch (...) {
      micro_steps_ = 0;
      throw;
    }
  }

  /// After a step that threw, or an evaluation: let what is in flight end
  /// and free every gathered unit.
  void abandon_step() noexcept {
    lender_.settle_all();
    // Gradients accumulated before a failed training step are dropped, and
    // with them the losses noted for them. The shard is zeroed even after a
    // failed first micro-step: under NoShard the model's backward writes
    // into it, so a backward that threw part-way has left gradient there.
    if (!lender_.evaluating()) {
      this->forget_losses();
      micro_steps_ = 0;
      std::ranges::fill(state_.grad_shard(), value_type(0));
    }
    lender_.abandon();
  }

  /// What decides memory_need() besides the options and the layout.
  detail::fsdp::MemoryFacts memory_facts() const noexcept {
    return {.shards = static_cast<std::size_t>(comms_.shard().size()),
            .offload = offloaded(),
            .state_in_space = state_in_space(),
            .state_per_element = optimizer_state_per_element(),
            .element_bytes = sizeof(value_type),
            .keeps_bf16 = lender_.keeps_bf16(),
            .computes_bf16 = computes_bf16,
            .reduces_bf16_grad = lender_.reduces_bf16_grad(),
            .inits_units = detail::ModelInitsUnits<M>};
  }

  ShardedTrainerOptions o_;
  std::vector<UnitSpec> specs_;
  /// The world, and HybridShard's groups; declared before lender_, whose worker runs on the shard group.
  detail::fsdp::HybridGroups<Comm> comms_{comm_};
  detail::fsdp::ShardedState<value_type, compute_type> state_{specs_};
  /// The model's StepContext reaches it: each wrapped unit's lifecycle and collectives.
  Lender lender_{o_, comms_, state_, step_, where()};
};

}  // namespace gradsync

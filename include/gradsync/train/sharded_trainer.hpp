#pragma once
/// \file ShardedTrainer: parameters, gradients and optimizer state 1/N per rank (PyTorch FSDP, ZeRO-3 semantics).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/collective/all_gather.hpp"
#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/collective/broadcast.hpp"
#include "gradsync/collective/progress_worker.hpp"
#include "gradsync/collective/reduce_scatter.hpp"
#include "gradsync/core/aligned_allocator.hpp"
#include "gradsync/core/backend_traits.hpp"
#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/collective.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/fail_access.hpp"
#include "gradsync/core/offload_space.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/request.hpp"
#include "gradsync/train/accumulation_mode.hpp"
#include "gradsync/train/backward_prefetch.hpp"
#include "gradsync/train/bfloat16_copies.hpp"
#include "gradsync/train/clip_grad_norm.hpp"
#include "gradsync/train/communicates_host_memory.hpp"
#include "gradsync/train/fsdp/buffer_pool.hpp"
#include "gradsync/train/fsdp/collectives.hpp"
#include "gradsync/train/fsdp/flat_shard.hpp"
#include "gradsync/train/fsdp/memory.hpp"
#include "gradsync/train/fsdp/offloaded.hpp"
#include "gradsync/train/fsdp/options.hpp"
#include "gradsync/train/fsdp/sharding_strategy.hpp"
#include "gradsync/train/fsdp/trace_event.hpp"
#include "gradsync/train/fsdp/unit_state.hpp"
#include "gradsync/train/memory_need.hpp"
#include "gradsync/train/model.hpp"
#include "gradsync/train/optimizer.hpp"
#include "gradsync/train/shard_plan.hpp"
#include "gradsync/train/step_labels.hpp"
#include "gradsync/train/step_stats.hpp"
#include "gradsync/train/trainer_base.hpp"
#include "gradsync/train/trainer_requirements.hpp"
#include "gradsync/train/trainer_stats.hpp"
#include "gradsync/train/unit_agreement.hpp"
#include "gradsync/train/wrap_policy.hpp"

namespace gradsync {

/// Trains `Model` with 1/N of every unit's parameters, gradients and
/// optimizer state on each rank of `Comm`.
///
/// Layout: unit u of P elements is padded with zeros to N·c, c = ⌈P/N⌉, and
/// rank r owns elements [r·c, r·c + c) of it (P = 5, N = 4 gives 2, 2, 1, 0
/// real elements). The owned chunks of all units lie one after the other in
/// one flat array, which the optimizer steps (the fp32 master shard when
/// value_type is float); the padding stays zero, since its gradient is zero.
///
/// A step: the model asks for unit u (StepContext::params); the first ask
/// in a step is u's forward and gathers it (AllGather), the second is its
/// backward, which gathers it again unless the strategy kept it, and gives
/// gradient views. `ctx.ready(u)` reduce-scatters u's gradient with a sum
/// and divides on the owning rank (as ReduceScatterAverage). Gathers and
/// reductions all run on the communicator's ProgressWorker, in the order the
/// model asks, which is the same on every rank; an ask waits for its gather
/// (started earlier under prefetch), reductions overlap the rest of backward.
/// Under NoShard nothing is gathered and each unit is all-reduced (Avg).
///
/// Construction checks that every rank declared the same units, broadcasts
/// rank 0's parameters and buffers, then keeps only this rank's shard.
///
/// step() is forward_backward() then optimizer_step(); between the two,
/// clip_grad_norm() may scale the gradient shards by the global norm.
///
/// Under FullShard (and HybridShard) the unit released last in forward stays gathered until
/// another unit is asked for, so the backward's first unit (FSDP's root)
/// gathers once (ShardedTrainerOptions::keep_last_forward_unit).
///
/// HybridShard shards within groups of ShardedTrainerOptions::shard_size
/// ranks (split from the communicator) and all-reduces each gradient shard
/// across the groups.
///
/// Wrapping: ShardedTrainerOptions::wrap groups consecutive model units into
/// wrapped units (WrapPolicy: per unit, the default; size-based; a
/// predicate). A wrapped unit is the flat concatenation of its model units
/// and is what the layout above, the gathers and the reductions are about:
/// `ctx.params(u)` on any of its members gathers the whole wrapped unit
/// once, which stays gathered while any member is held or still to come in
/// this phase, and its gradient is reduced once every member is ready.
/// plan() describes it (a ShardPlan; print it with to_string or <<).
///
/// accumulate() runs a micro-step whose gradient the next step() includes
/// (K−1 calls and a step: the mean over K micro-batches). Under
/// AccumulationMode::Sharded each micro-step reduce-scatters and adds the
/// averaged shard into the gradient shard (memory stays 1/N); under NoSync
/// (FSDP's no_sync) micro-steps communicate no gradient and every unit keeps
/// its unsharded gradient, the padded unit, N·c elements (≈ +Ψ per rank), from
/// the first micro-step's backward to step()'s, which scales the local sum by
/// 1/K and reduces it once: bitwise ReplicatedTrainer::accumulate under the
/// deterministic option. ShardGradOp under NoSync also keeps every unit
/// gathered from the first micro-step's forward to step()'s backward (one
/// gather per unit and window, as FSDP's SHARD_GRAD_OP in no_sync);
/// FullShard gathers in every micro-step.
///
/// Prefetch (off by default): forward_prefetch gathers the next wrapped
/// unit when one is asked for in forward; backward_prefetch gathers the
/// one before it in forward order when a unit is asked for in backward
/// (BackwardPre) or when its gradient is ready (BackwardPost), while fewer
/// than limit_all_gathers units are gathered. Gathers are asynchronous on
/// the worker; which and when depend only on the model's asks, never on
/// timing, so every rank queues the same collectives in the same order.
///
/// Mixed precision: param_dtype bfloat16 gathers the fp32 master shard
/// rounded to bfloat16 (half the gather's bytes). A model whose
/// compute_type is bfloat16 computes on the gathered bfloat16 unit and
/// writes bfloat16 gradients, which are added into a master-type buffer
/// once its unit is ready and reduced from there (FSDP's param_dtype with
/// the master type as reduce_dtype), or with reduce_dtype bfloat16 are
/// reduce-scattered from the model's bfloat16 buffer itself, which halves
/// FullShard's transient bytes; under NoShard it sees bfloat16 copies of
/// the shard, as under ReplicatedTrainer; it may have no buffers. A model
/// computing in value_type sees value_type views of the
/// rounded values (and ShardGradOp keeps the units it holds on to between
/// forward and backward in bfloat16). reduce_dtype bfloat16 reduces
/// gradients in it. Both default to the master type, param_dtype to
/// bfloat16 for a bfloat16 model. NoShard gathers nothing, so param_dtype
/// does not apply to it.
///
/// Memory: memory_need() is the formula (persistent bytes exactly, the
/// transient peak as a bound), peak_transient_bytes() what was really held,
/// and memory_budget refuses at construction a configuration whose need
/// exceeds it. last_step() times each phase and counts elements sent.
///
/// Offload (ShardedTrainerOptions::offload): the master and gradient
/// shards and the optimizer's state live in an OffloadSpace and the
/// optimizer steps them there (an optimizer without `bind_state(storage,
/// elements)` keeps its state itself, counted on the compute side); each
/// gather copies its chunk in, each reduction copies its result out, on the
/// worker, so with a prefetch the next unit's copy overlaps this unit's
/// compute. last_step() counts the bytes copied, memory_need() splits the
/// offloaded bytes from the compute side's, which the budget covers.
///
/// \tparam M     the model (see gradsync::Model); its forward_backward must use StepContext.
/// \tparam Opt   an optimizer on flat spans of M::value_type (Sgd, Adam, AdamW, ...).
/// \tparam Comm  gradsync::Communicator<Backend>.
/// \tparam Algo  the algorithm of every collective.
template <class M, class Opt, class Comm, class Algo = Auto>
class ShardedTrainer : public detail::TrainerBase<ShardedTrainer<M, Opt, Comm, Algo>, M, Opt, Comm, Algo> {
  using Base = detail::TrainerBase<ShardedTrainer, M, Opt, Comm, Algo>;
  static_assert(detail::communicates_host_memory<Comm>,
                "gradsync::ShardedTrainer needs a backend whose memory space is host memory: it keeps shards and "
                "gathered units in host vectors and steps the optimizer on the host.");

 public:
  using typename Base::backend_type;
  using typename Base::value_type;
  /// The element type of the views the model sees in a step: its
  /// compute_type, value_type unless it declares bfloat16.
  using compute_type = detail::compute_t<M>;

  ShardedTrainer(Comm& comm, M model, Opt optimizer, ShardedTrainerOptions options = {})
      : comm_(comm), model_(std::move(model)), opt_(std::move(optimizer)), o_(options), specs_(model_.units()) {
    // Offload decides where the shards live and so the compute side's need:
    // it must agree too, as the budget does.
    detail::check_trainer_units(comm_, specs_, "ShardedTrainer", o_.memory_budget,
                                detail::fsdp::agreed_options<value_type, compute_type>(o_, opt_));
    const auto precision = detail::fsdp::read_precision<value_type, computes_low>(o_, where(), specs_);
    param_bf16_ = precision.params_low;
    reduce_bf16_ = precision.grads_low;
    detail::fsdp::check_offload(o_, where());
    split();
    layout();
    if (o_.wrap.is_custom()) {
      // A predicate may look at more than the units: its grouping must agree too.
      std::vector<std::string> groups;
      for (const ShardPlan::Unit& u : plan_.units) {
        groups.push_back("'" + u.name + "' (model units " + std::to_string(u.model_units.front()) + " to " +
                         std::to_string(u.model_units.back()) + ")");
      }
      detail::check_units_agree(comm_, groups, "ShardedTrainer wrapping plan",
                                "The custom WrapPolicy predicate must group the units alike on every rank: check "
                                "what it depends on besides its arguments (rank, configuration).");
    }
    if (flat_.total == 0) {
      // Every rank declared the same units, so every rank throws this.
      throw InvalidArgument("gradsync: ShardedTrainer on rank " + std::to_string(comm_.rank()) +
                            ": the model declares no parameters (" + std::to_string(specs_.size()) +
                            " units, 0 elements); there is nothing to shard or train");
    }
    detail::fsdp::check_budget(where(), o_, flat_, memory_facts());
    pool_.reserve(2 * wrapped_.size(), memory_need().transient());
    initialise();
    worker_ = ProgressWorker<backend_type>::shared(shard_comm());
  }
  ShardedTrainer(const ShardedTrainer&) = delete;
  ShardedTrainer& operator=(const ShardedTrainer&) = delete;
  /// What is in flight uses this trainer's buffers: let it end first.
  ~ShardedTrainer() { settle_all(); }

  /// The first half of step(): forward and backward, each unit gathered
  /// when asked for and its gradient reduced to its owner as soon as it is
  /// ready, without the optimizer step. Then clip_grad_norm() if you like,
  /// and optimizer_step().
  /// Returns this rank's loss on `batch`.
  template <class Batch>
  double forward_backward(const Batch& batch) {
    static_assert(detail::TrainerRequirements<M, Opt>::template batch<Batch>());
    check_no_pending("forward_backward");
    const double loss = failing_together([&] {
      if (o_.broadcast_buffers && !buffers_.empty()) {
        Broadcast<Algo>{labelled(detail::LabelPhase::buffers, 0)}(comm_, std::span<value_type>(buffers_), 0);
      }
      return run_model(batch, true);
    });
    pending_ = true;
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
    check_no_pending("accumulate");
    if (offloaded() && o_.accumulation == AccumulationMode::Sharded) {
      throw InvalidArgument(where() +
                            ": accumulate() with ShardedTrainerOptions::offload needs AccumulationMode::NoSync; "
                            "sharded accumulation would add every micro-step's reduced shard into the offloaded "
                            "gradient shard, which only copies reach (PyTorch FSDP refuses it with CPU offload too)");
    }
    const double loss = failing_together([&] { return run_model(batch, false); });
    ++micro_steps_;
    return loss;
  }

  /// Between forward_backward() and optimizer_step(): the global norm of
  /// order p of the averaged gradient (infinity: the largest magnitude).
  /// Each rank takes Σ|g|^p (or max|g|) over its shard, an AllReduce Sum (or
  /// Max) combines them, so every rank returns the same value; under NoShard
  /// every rank holds the whole gradient (each element counted once). If the norm exceeds max_norm, the gradient is
  /// scaled by max_norm / (norm + 1e-6), as PyTorch's clip_grad_norm_.
  /// Collective, labelled with max_norm and p: ranks that clip differently
  /// fail here on every rank, naming both (NoShard and HybridShard pay one
  /// 8-byte all-reduce over all ranks for it).
  double clip_grad_norm(double max_norm, double p = 2.0) {
    detail::check_norm_order("ShardedTrainer", max_norm, p);
    if (!pending_) {
      throw InvalidArgument(where() +
                            ": clip_grad_norm needs the reduced gradient: call it between forward_backward() and "
                            "optimizer_step()");
    }
    double partial = detail::norm_partial(std::span<const value_type>(grad_shard()), p);
    Options opts = o_.collective;
    opts.label = labels_->clip_label(stats_.steps + 1, max_norm, p);
    const AllReduce<Algo> all_reduce{opts};
    // Replicas hold the same shards: the shard group's partials are the whole.
    if (sharded() && shard_comm().size() > 1) {
      failing_together([&] {
        if (std::isinf(p)) {
          all_reduce(shard_comm(), std::span<double>(&partial, 1), Max{});
        } else {
          all_reduce(shard_comm(), std::span<double>(&partial, 1), Sum{});
        }
      });
    }
    // Where that call did not span every rank (NoShard, HybridShard), one
    // 8-byte Max of equal values over all of them is the agreement on
    // max_norm and p: ranks that clip differently would step apart silently.
    if (comm_.size() > 1 && !(sharded() && !shard_comm_)) {
      failing_together([&] { all_reduce(comm_, std::span<double>(&partial, 1), Max{}); });
    }
    const double total = detail::norm_total(partial, p);
    detail::clip_to(grad_shard(), total, max_norm);
    return total;
  }

  /// The second half of step(): the optimizer step on this rank's shard;
  /// the gradient shard is then zeroed.
  void optimizer_step() {
    if (!pending_) {
      throw InvalidArgument(where() + ": optimizer_step without a forward_backward() before it");
    }
    pending_ = false;
    micro_steps_ = 0;
    const auto t0 = std::chrono::steady_clock::now();
    // Offloaded, both shards are in the offload space: the optimizer steps there.
    opt_.step(master(), std::span<const value_type>(grad_shard()));
    std::ranges::fill(grad_shard(), value_type(0));
    step_.optimizer_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats_.optimizer_seconds += step_.optimizer_seconds;
    ++stats_.steps;
  }

  /// Runs `f(ctx)` with a StepContext for a forward without backward
  /// (evaluation): each ask gathers the unit and its release frees it;
  /// ctx.ready throws. Returns what f returns. Collective: every rank must
  /// ask for the same units in the same order.
  template <class F>
  decltype(auto) evaluate(F&& f) {
    begin_step(true);
    // An evaluation's gathers are not the last step's.
    struct End {
      ShardedTrainer& t;
      StepStats step;
      ~End() {
        t.abandon_step();
        t.step_ = step;
      }
    } end{*this, step_};
    round_parameters(false);
    const StepContext<compute_type> ctx(provider_);
    return std::forward<F>(f)(ctx);
  }

  M& model() noexcept { return model_; }
  const M& model() const noexcept { return model_; }
  Opt& optimizer() noexcept { return opt_; }
  Comm& communicator() noexcept { return comm_; }
  const ShardedTrainerOptions& options() const noexcept { return o_; }
  const std::vector<UnitSpec>& units() const noexcept { return specs_; }

  /// The wrapping plan: wrapped units, their model units, sizes and bytes
  /// per rank (print it with to_string or <<).
  const ShardPlan& plan() const noexcept { return plan_; }
  /// The wrapped unit that holds model unit `model_unit`.
  std::size_t wrapped_unit_of(std::size_t model_unit) const { return flat_.member_of.at(model_unit); }

  /// Below, `u` is a wrapped unit (the model unit itself under the default
  /// WrapPolicy::per_unit()).
  ///
  /// This rank's shard of every unit, padded chunks one after the other.
  std::span<const value_type> shard() const noexcept { return master(); }
  /// Unit u's elements (unpadded).
  std::size_t unit_size(std::size_t u) const { return flat_.sizes.at(u); }
  /// Elements of each rank's chunk of unit u (padding included): ⌈P/N⌉, or P under NoShard.
  std::size_t chunk_size(std::size_t u) const { return flat_.chunks.at(u); }
  /// Unit u's elements this rank owns, [first, first + count) of the unit;
  /// the rest of its chunk is zero padding. Under NoShard: all of them.
  std::pair<std::size_t, std::size_t> owned_range(std::size_t u) const {
    return flat_.owned_range(u, static_cast<std::size_t>(shard_comm().rank()));
  }
  /// This rank's chunk of unit u, padding included.
  std::span<const value_type> unit_shard(std::size_t u) const {
    return master().subspan(flat_.offsets.at(u), flat_.chunks.at(u));
  }

  /// Gathers every unit's parameters, unpadded, units in declaration order
  /// (what ReplicatedTrainer::parameters() holds). Collective.
  std::vector<value_type> full_parameters() {
    std::vector<value_type> all;
    all.reserve(flat_.total);
    for (std::size_t u = 0; u < flat_.groups.size(); ++u) {
      if (o_.strategy == ShardingStrategy::NoShard) {
        const auto s = unit_shard(u);
        all.insert(all.end(), s.begin(), s.end());
        continue;
      }
      std::vector<value_type> full(flat_.chunks[u] * static_cast<std::size_t>(shard_comm().size()));
      std::span<const value_type> in = unit_shard(u);
      if (offloaded()) {
        // The offloaded chunk crosses by copy, into its own block: gathered in place.
        const std::size_t c = flat_.chunks[u];
        const std::span<value_type> own =
            std::span<value_type>(full).subspan(static_cast<std::size_t>(shard_comm().rank()) * c, c);
        o_.offload->copy_in(own.data(), in.data(), own.size_bytes());
        o_.offload->wait();
        in = own;
      }
      AllGather<Algo>{labelled(detail::LabelPhase::gather, u)}(shard_comm(), in, std::span<value_type>(full));
      all.insert(all.end(), full.begin(), full.begin() + static_cast<std::ptrdiff_t>(flat_.sizes[u]));
    }
    return all;
  }

  std::span<value_type> buffers() noexcept { return buffers_; }

  /// Bytes this rank keeps between steps: its parameter and gradient shards
  /// and the optimizer's state on them, (2 + S)·sizeof(T)·Σ_u c_u, S being
  /// the optimizer's state elements per parameter (0 for SGD, 1 with
  /// momentum, 2 for Adam and AdamW; 0 for an optimizer that does not say,
  /// through `state_per_element()`). Buffers are replicated and left out.
  /// With offload these are in the offload space, and this is 0 (the
  /// optimizer's state if it cannot be lent storage, see bind_state).
  /// NoShard with a bfloat16 model adds its copies of the parameters and
  /// gradients, 2·2·Ψ.
  std::size_t persistent_bytes() const noexcept {
    const std::size_t state = optimizer_state_per_element() * sizeof(value_type) * master().size();
    if (offloaded()) return state_in_space() ? 0 : state;
    return 2 * sizeof(value_type) * shard_params_.size() + state +
           (low_params_.size() + low_grads_.size()) * sizeof(bfloat16);
  }

  /// What this rank needs, by the formula (detail::sharded_memory_need):
  /// persistent bytes exactly, transient bytes as the most a step holds at
  /// once (an upper bound; exact for FullShard without prefetch).
  MemoryNeed memory_need() const { return detail::fsdp::trainer_need(o_, o_.strategy, flat_, memory_facts()); }
  /// The most transient bytes (gathered wrapped units, gradient buffers)
  /// this rank really held at once since construction or reset_peak_transient().
  std::size_t peak_transient_bytes() const noexcept { return peak_.bytes(); }
  void reset_peak_transient() noexcept { peak_.reset(); }
  /// What construction held beside the persistent part: the model's
  /// initial values in full before they were sharded (one wrapped unit if
  /// the model has init_unit, every parameter if it has only bind, nothing
  /// under NoShard). memory_need().construction is its formula.
  std::size_t construction_bytes() const noexcept { return construction_bytes_; }

  /// The last step (forward_backward() or its micro-steps, and
  /// optimizer_step()): time per phase, and elements and bytes sent as Ring
  /// sends them (see StepStats). With param_dtype or reduce_dtype bfloat16
  /// the bytes are 2 per element of those collectives, the elements unchanged.
  const StepStats& last_step() const noexcept { return step_; }

  /// The collectives of the last step, in the order this rank issued them.
  const std::vector<ShardedTraceEvent>& trace() const noexcept { return trace_; }

  const TrainerStats& stats() const noexcept { return stats_; }

  // Checkpoint access
  /// Optimizer steps taken (what a checkpoint saves as `trainer.step`).
  std::size_t step_count() const noexcept { return stats_.steps; }
  /// Sets the step count; for loading a checkpoint.
  void set_step_count(std::size_t steps) noexcept { stats_.steps = steps; }
  /// No forward_backward() waits for its optimizer_step() and nothing is
  /// accumulated: the only moments a checkpoint can be taken or loaded.
  /// Nothing is gathered then either (a step ends by freeing every unit,
  /// the one keep_last_forward_unit kept included).
  bool between_steps() const noexcept { return !pending_ && micro_steps_ == 0 && lingering_.empty(); }
  /// This rank's master shard, writable (a checkpoint load writes it
  /// between steps; keep the padding zero).
  std::span<value_type> shard() noexcept { return master(); }
  /// Wrapped units, for unit_size, chunk_size, chunk_offset, owned_range.
  std::size_t unit_count() const noexcept { return flat_.sizes.size(); }
  /// Where unit u's chunk starts in shard() (and in the optimizer's state).
  std::size_t chunk_offset(std::size_t u) const { return flat_.offsets.at(u); }
  /// This rank's place in its shard group, and the group's size: the
  /// chunk it owns and how many there are (NoShard: 0 of 1).
  int shard_rank() const noexcept { return sharded() ? shard_comm().rank() : 0; }
  int shard_count() const noexcept { return sharded() ? shard_comm().size() : 1; }
  /// Which copy of the shards this rank holds: HybridShard's group index,
  /// NoShard's rank, else 0. Replica 0 writes a checkpoint.
  int replica() const noexcept {
    if (!sharded()) return comm_.rank();
    return comm_.rank() / shard_comm().size();
  }
  /// Gathers a shard-shaped buffer's unit u, `chunk` (chunk_size(u)
  /// elements: the parameters' or an optimizer moment's), into `full`
  /// (shard_count()·chunk_size(u) elements, padding last). Collective over
  /// the shard group, between steps.
  void gather_chunk(std::size_t u, std::span<const value_type> chunk, std::span<value_type> full) {
    if (chunk.size() != flat_.chunks.at(u) || full.size() != chunk.size() * static_cast<std::size_t>(shard_count())) {
      throw InvalidArgument(where() + ": gather_chunk of " + wrapped_name(u) + " takes " +
                            std::to_string(flat_.chunks.at(u)) + " elements into " +
                            std::to_string(flat_.chunks.at(u) * static_cast<std::size_t>(shard_count())) + ", got " +
                            std::to_string(chunk.size()) + " into " + std::to_string(full.size()));
    }
    if (!sharded()) {
      std::copy(chunk.begin(), chunk.end(), full.begin());
      return;
    }
    AllGather<Algo>{labelled(detail::LabelPhase::gather, u)}(shard_comm(), chunk, full);
  }

 private:
  using MemberState = detail::fsdp::MemberState<compute_type>;
  using WrappedState = detail::fsdp::UnitState<value_type>;
  using Storage = detail::fsdp::Storage<value_type>;
  using Offloaded = detail::fsdp::Offloaded<value_type>;

  /// Lends the model its units: gathers on demand, frees on release.
  class Provider final : public detail::UnitProvider<compute_type> {
   public:
    explicit Provider(ShardedTrainer& t) : t_(t) {}
    const UnitView<compute_type>& acquire(std::size_t u) override { return t_.acquire(u); }
    void release(std::size_t u) noexcept override { t_.release(u); }
    void ready(std::size_t u) override { t_.ready(u); }

   private:
    ShardedTrainer& t_;
  };

  std::size_t optimizer_state_per_element() const noexcept { return detail::optimizer_state_per_element(opt_); }

  /// The model computes in bfloat16 (compute_type): its units are gathered
  /// into bfloat16 storage that its views point into, and it writes its
  /// gradients in bfloat16.
  static constexpr bool computes_low = !std::is_same_v<compute_type, value_type>;

  /// A model computing in bfloat16 with reduce_dtype bfloat16: each unit's
  /// gradient is reduce-scattered from the bfloat16 buffer the model wrote,
  /// with no value_type buffer at all (FSDP's param_dtype = reduce_dtype =
  /// bfloat16). Not where the gradient must outlive the step in value_type
  /// (NoSync) or be copied out to an offload space, nor on one rank, which
  /// rounds nothing for a wire: there it is folded (fold_low_grad).
  bool reduces_low_grad() const noexcept {
    return computes_low && sharded() && reduce_bf16_ && comm_.size() > 1 && !offloaded() &&
           o_.accumulation != AccumulationMode::NoSync;
  }

  bool sharded() const noexcept { return o_.strategy != ShardingStrategy::NoShard; }
  bool full_shard() const noexcept {
    return o_.strategy == ShardingStrategy::FullShard || o_.strategy == ShardingStrategy::HybridShard;
  }

  bool offloaded() const noexcept { return o_.offload != nullptr; }
  /// The optimizer can keep its state in storage the trainer lends it.
  static constexpr bool bindable = requires(Opt& o, std::span<value_type> s, std::size_t n) { o.bind_state(s, n); };
  /// Offloaded, the optimizer's state is in the space too (else in the optimizer).
  bool state_in_space() const noexcept { return offloaded() && bindable; }
  /// The master parameter shard and the gradient shard, wherever they live
  /// (the offload space, or the compute side's vectors).
  std::span<value_type> master() noexcept { return offloaded() ? off_params_.span() : std::span(shard_params_); }
  std::span<const value_type> master() const noexcept {
    return offloaded() ? off_params_.span() : std::span<const value_type>(shard_params_);
  }
  std::span<value_type> grad_shard() noexcept { return offloaded() ? off_grads_.span() : std::span(shard_grads_); }

  /// Where units are sharded and gathered: the shard group under
  /// HybridShard, else the whole communicator.
  Comm& shard_comm() noexcept { return shard_comm_ ? *shard_comm_ : comm_; }
  const Comm& shard_comm() const noexcept { return shard_comm_ ? *shard_comm_ : comm_; }

  /// HybridShard: the shard group and the replica group of this rank, both
  /// split from the communicator (collective; every rank the same options).
  void split() {
    if (o_.strategy != ShardingStrategy::HybridShard) return;
    const int s = detail::fsdp::shard_group_size(o_, comm_.size(), where());
    if constexpr (requires(Comm& c) { c.split(0, 0); }) {
      const int r = comm_.rank();
      // Colors are never no_color, so both splits give a communicator.
      if (auto g = comm_.split(r / s, r, "shard group " + std::to_string(r / s))) shard_comm_.emplace(std::move(*g));
      if (auto g = comm_.split(r % s, r, "replica group " + std::to_string(r % s))) replica_comm_.emplace(std::move(*g));
    } else {
      throw InvalidArgument(where() + ": HybridShard needs Communicator::split, which this backend lacks");
    }
  }

  std::string where() const { return "gradsync: ShardedTrainer on rank " + std::to_string(comm_.rank()); }

  /// Runs f; if one of the trainer's communicators failed in it under
  /// HybridShard, fails the other ones with the same words first. A disagreement found in one
  /// shard or replica group would otherwise reach the other groups' ranks
  /// only as this rank leaving (its communicators destroyed), not as what
  /// went wrong.
  template <class F>
  decltype(auto) failing_together(F&& f) {
    try {
      return std::forward<F>(f)();
    } catch (...) {
      // Only a communicator's failure: a model's own exception, thrown alike
      // on every rank, leaves the communicators usable.
      if (shard_comm_ && (comm_.failed() || shard_comm_->failed() || (replica_comm_ && replica_comm_->failed()))) {
        settle_all();
        const detail::FailureKind kind = detail::current_failure_kind();
        std::string what = "a collective failed";
        try {
          throw;
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        for (Comm* c : {&comm_, &*shard_comm_, replica_comm_ ? &*replica_comm_ : nullptr}) {
          if (c) detail::FailAccess::fail(*c, kind, what);
        }
      }
      throw;
    }
  }

  /// The trainer's collective options, labelled with what the call moves in
  /// this step and with the learning rate the step will use.
  Options labelled(detail::LabelPhase phase, std::size_t index) const {
    Options o = o_.collective;
    o.label = labels_->label(phase, index, stats_.steps + 1, detail::bits_of(static_cast<double>(opt_.lr())));
    return o;
  }
  std::string unit_name(std::size_t u) const { return "unit " + std::to_string(u) + " ('" + specs_[u].name + "')"; }
  std::string wrapped_name(std::size_t w) const {
    return "wrapped unit " + std::to_string(w) + " ('" + plan_.units[w].name + "')";
  }

  /// Groups the model units into wrapped units (the policy), then lays out
  /// each wrapped unit's chunk in the flat shard.
  void layout() {
    const auto n = static_cast<std::size_t>(shard_comm().size());
    flat_ = detail::fsdp::FlatShard::make(o_.wrap.group(specs_), specs_, n, sharded());
    const std::size_t at = flat_.shard_elements;
    if (offloaded()) {
      off_params_ = Offloaded(o_.offload, at);
      off_grads_ = Offloaded(o_.offload, at);
      if constexpr (bindable) {
        // The optimizer's state is lent from the space too, so that none of it stays on the compute side.
        const std::size_t state = optimizer_state_per_element() * at;
        if (state != 0) off_state_ = Offloaded(o_.offload, state);
        opt_.bind_state(off_state_.span(), at);
      }
    } else {
      shard_params_.assign(at, value_type(0));
      shard_grads_.assign(at, value_type(0));
    }
    members_.resize(specs_.size());
    wrapped_.resize(flat_.groups.size());
    keep_low_ = !computes_low && param_bf16_ && o_.strategy == ShardingStrategy::ShardGradOp &&
                detail::keeping_low_pays(flat_.sizes, n, sizeof(value_type), sizeof(bfloat16));
    make_plan();
  }

  void make_plan() {
    plan_.policy = o_.wrap.describe();
    plan_.strategy = name(o_.strategy);
    plan_.shards = shard_comm().size();
    plan_.replicas = comm_.size() / shard_comm().size();
    plan_.element_bytes = sizeof(value_type);
    plan_.state_per_element = optimizer_state_per_element();
    const auto n = static_cast<std::size_t>(shard_comm().size());
    for (std::size_t w = 0; w < flat_.groups.size(); ++w) {
      ShardPlan::Unit u;
      const auto [first, last] = flat_.groups[w];
      u.name = first == last ? specs_[first].name : specs_[first].name + ".." + specs_[last].name;
      for (std::size_t m = first; m <= last; ++m) u.model_units.push_back(m);
      u.params = flat_.sizes[w];
      u.shard = flat_.chunks[w];
      u.padding = sharded() ? n * flat_.chunks[w] - flat_.sizes[w] : 0;
      u.bytes_per_rank = (2 + plan_.state_per_element) * sizeof(value_type) * flat_.chunks[w];
      u.gathered_bytes = sharded() ? n * flat_.chunks[w] * sizeof(compute_type) : 0;
      plan_.units.push_back(std::move(u));
    }
    std::vector<std::string> names;
    for (const ShardPlan::Unit& u : plan_.units) names.push_back("'" + u.name + "'");
    labels_.emplace("step", "wrapped unit", std::move(names), "optimizer lr");
  }

  /// Views of unit u over `params` (P elements) and `grads` (P or none),
  /// and its buffers (value_type ones: a bfloat16 model has none, read_precision).
  template <class T>
  UnitView<T> make_view(std::size_t u, std::span<T> params, std::type_identity_t<std::span<T>> grads) {
    UnitView<T> v = detail::fsdp::param_views(specs_[u], params, grads);
    if constexpr (std::is_same_v<T, value_type>) {
      detail::fsdp::add_buffer_views(v, specs_[u], std::span<value_type>(buffers_).subspan(buffer_offsets_[u]));
    }
    return v;
  }

  /// The model writes its initial values, rank 0's are broadcast, and each
  /// rank keeps its chunks. Where they are written decides construction's
  /// memory (detail::fsdp::construction_need):
  /// - NoShard: the shard is every unit whole, in order, so the model
  ///   writes into it and it is broadcast in place;
  /// - a model with init_unit: one wrapped unit at a time, into one buffer
  ///   of the largest wrapped unit, broadcast, then its chunk kept;
  /// - a model with bind only: every parameter at once, then the same.
  void initialise() {
    std::size_t nb = 0;
    for (const UnitSpec& s : specs_) {
      buffer_offsets_.push_back(nb);
      for (const TensorSpec& t : s.buffers) nb += t.count();
    }
    buffers_.assign(nb, value_type(0));
    const Broadcast<Algo> broadcast{o_.collective};
    if (!sharded()) {
      // The model sees the shard in place, in steps too (check_offload refuses NoShard with offload).
      std::vector<UnitView<value_type>> views;
      for (std::size_t u = 0; u < specs_.size(); ++u) {
        const std::size_t from = flat_.offsets[flat_.member_of[u]] + flat_.member_offset[u];
        views.push_back(make_view(u, std::span<value_type>(shard_params_).subspan(from, flat_.model_sizes[u]),
                                  std::span<value_type>(shard_grads_).subspan(from, flat_.model_sizes[u])));
        if constexpr (!computes_low) members_[u].view = views.back();
      }
      if constexpr (computes_low) {
        // A bfloat16 model sees copies of the shard (every unit whole), as under ReplicatedTrainer.
        low_params_.assign(shard_params_.size(), bfloat16(0.0f));
        low_grads_.assign(shard_grads_.size(), bfloat16(0.0f));
        for (std::size_t u = 0; u < specs_.size(); ++u) {
          const std::size_t from = flat_.offsets[flat_.member_of[u]] + flat_.member_offset[u];
          members_[u].view = make_view(u, std::span<bfloat16>(low_params_).subspan(from, flat_.model_sizes[u]),
                                       std::span<bfloat16>(low_grads_).subspan(from, flat_.model_sizes[u]));
        }
      }
      detail::write_initial_values(model_, std::span<const UnitView<value_type>>(views));
      broadcast(comm_, std::span<value_type>(shard_params_), 0);
    } else if constexpr (detail::ModelInitsUnits<M>) {
      // Rank 0 decides every value, so every rank broadcasts unit by unit alike.
      std::vector<value_type> unit(std::ranges::max(flat_.sizes));
      construction_bytes_ = unit.size() * sizeof(value_type);
      for (std::size_t w = 0; w < flat_.groups.size(); ++w) {
        const std::span<value_type> full = std::span<value_type>(unit).first(flat_.sizes[w]);
        for (std::size_t m = first_member(w); m <= last_member(w); ++m) {
          model_.init_unit(m, make_view(m, full.subspan(flat_.member_offset[m], flat_.model_sizes[m]), {}));
        }
        if (full.empty()) continue;
        broadcast(comm_, full, 0);
        keep_owned(w, full);
      }
    } else {
      std::vector<value_type> params(flat_.total, value_type(0));
      construction_bytes_ = params.size() * sizeof(value_type);
      std::vector<UnitView<value_type>> views;
      // A wrapped unit's members are consecutive, so it is one range of `params`.
      std::size_t at = 0;
      for (std::size_t u = 0; u < specs_.size(); ++u) {
        views.push_back(make_view(u, std::span<value_type>(params).subspan(at, flat_.model_sizes[u]), {}));
        at += flat_.model_sizes[u];
      }
      model_.bind(std::span<const UnitView<value_type>>(views));
      broadcast(comm_, std::span<value_type>(params), 0);
      at = 0;
      for (std::size_t w = 0; w < flat_.groups.size(); ++w) {
        keep_owned(w, std::span<const value_type>(params).subspan(at, flat_.sizes[w]));
        at += flat_.sizes[w];
      }
    }
    if (!buffers_.empty()) broadcast(comm_, std::span<value_type>(buffers_), 0);
  }

  /// Copies this rank's part of wrapped unit w (its `full` values, unpadded) into its master chunk.
  void keep_owned(std::size_t w, std::span<const value_type> full) {
    const auto [first, count] = owned_range(w);
    std::copy_n(full.begin() + static_cast<std::ptrdiff_t>(first), count,
                master().begin() + static_cast<std::ptrdiff_t>(flat_.offsets[w]));
  }

  void check_no_pending(const char* what) const {
    if (pending_) {
      throw InvalidArgument(where() + ": " + what +
                            " after a forward_backward() whose optimizer_step() has not run yet");
    }
  }

  /// Forward and backward; `sync`: the step that reduces (forward_backward),
  /// else a micro-step of accumulate().
  template <class Batch>
  double run_model(const Batch& batch, bool sync) {
    trace_.clear();
    // A step's figures cover all its micro-steps.
    if (micro_steps_ == 0) step_ = {};
    begin_step(false);
    reducing_ = sync || o_.accumulation == AccumulationMode::Sharded;
    // NoSync scales the local sum by 1/K before the mean, as ReplicatedTrainer.
    local_scale_ = sync && o_.accumulation == AccumulationMode::NoSync
                       ? static_cast<value_type>(1.0 / static_cast<double>(micro_steps_ + 1))
                       : value_type(1);
    const auto t0 = std::chrono::steady_clock::now();
    const double exposed_before = step_.exposed_comm_seconds;
    double loss = 0;
    try {
      round_parameters(true);
      const StepContext<compute_type> ctx(provider_);
      loss = static_cast<double>(model_.forward_backward(batch, ctx));
    } catch (...) {
      abandon_step();
      throw;
    }
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats_.compute_seconds += wall;
    step_.compute_seconds += wall - (step_.exposed_comm_seconds - exposed_before);
    finish_reductions(!reducing_);
    // Sharded accumulation summed K means into the shard: their mean.
    if (sync && o_.accumulation == AccumulationMode::Sharded && micro_steps_ > 0) {
      const auto k = static_cast<value_type>(1.0 / static_cast<double>(micro_steps_ + 1));
      for (value_type& x : grad_shard()) x *= k;
    }
    return loss;
  }

  void begin_step(bool evaluating) {
    evaluating_ = evaluating;
    for (MemberState& m : members_) {
      m.asks = 0;
      m.held = false;
      m.ready = false;
    }
    for (WrappedState& w : wrapped_) {
      w.held = 0;
      w.ready = 0;
    }
  }

  void check_unit(std::size_t u, const char* what) const {
    if (u >= members_.size()) {
      throw InvalidArgument(where() + ": the model " + what + " unit " + std::to_string(u) +
                            ", which does not exist (" + std::to_string(members_.size()) + " units)");
    }
  }

  /// Model units [first, last] of wrapped unit w.
  std::size_t first_member(std::size_t w) const noexcept { return flat_.first_member(w); }
  std::size_t last_member(std::size_t w) const noexcept { return flat_.last_member(w); }

  /// Every member of w has been asked for at least `asks` times in this step.
  bool members_asked(std::size_t w, int asks) const noexcept {
    for (std::size_t m = first_member(w); m <= last_member(w); ++m) {
      if (members_[m].asks < asks) return false;
    }
    return true;
  }

  /// Frees wrapped unit w's gathered parameters.
  void free_unit(std::size_t w) noexcept {
    give(wrapped_[w].full);
    std::vector<bfloat16>().swap(wrapped_[w].low);
  }

  /// NoShard with a bfloat16 model: its copy of the parameters, rounded
  /// from the shard (which the optimizer, a checkpoint's load or the user
  /// may have changed); `zero_grads`: a step's, whose gradients start at 0.
  void round_parameters(bool zero_grads) {
    if constexpr (computes_low) {
      if (sharded()) return;
      detail::round_into(std::span<const value_type>(shard_params_), std::span<bfloat16>(low_params_));
      if (zero_grads) std::ranges::fill(low_grads_, bfloat16(0.0f));
    }
  }

  /// A model computing in bfloat16: wrapped unit w's gradient, final in its
  /// bfloat16 buffer, is added into the value_type buffer that is reduced
  /// (under NoSync, the one kept across micro-steps), and the bfloat16 one
  /// goes. Each rank's gradient is rounded once, by the model's arithmetic;
  /// the reduction and the accumulation are in reduce_dtype and value_type.
  void fold_low_grad(std::size_t w) {
    WrappedState& s = wrapped_[w];
    if (!sharded()) {
      // NoShard: into the whole unit's gradient in the shard, reduced in place
      // (round_parameters zeroes the bfloat16 ones before each backward).
      detail::add_widened(std::span<value_type>(shard_grads_).subspan(flat_.offsets[w], flat_.sizes[w]),
                          std::span<const bfloat16>(low_grads_).subspan(flat_.offsets[w], flat_.sizes[w]));
      return;
    }
    if (s.grad.empty()) {
      // As acquire's buffer for a value_type model: FullShard holds one at a time.
      retire_reductions(full_shard() ? 0 : 1);
      const std::size_t n = static_cast<std::size_t>(shard_comm().size()) + (offloaded() ? 1 : 0);
      s.grad = take(flat_.chunks[w] * n, true);
      track_transient();
    }
    detail::add_widened(std::span<value_type>(s.grad).first(s.low_grad.size()), std::span<const bfloat16>(s.low_grad));
    std::vector<bfloat16>().swap(s.low_grad);
  }

  /// Bytes of gathered units and gradient buffers held now (spares aside).
  std::size_t transient_held() const noexcept {
    return detail::fsdp::transient_held<value_type>(wrapped_);
  }

  /// param_dtype bfloat16 under ShardGradOp: a unit kept gathered from its
  /// forward to its backward (and across NoSync micro-steps) keeps the
  /// bfloat16 copy its gather received (`low`); the value_type copy the
  /// model's views point into goes when the model lets go of the unit and
  /// is widened again from `low` at its next ask. Exact, since the values
  /// are bfloat16's, and a kept unit holds half the bytes; done only where
  /// it holds less in all (detail::keeping_low_pays: not where one unit is
  /// most of the model, whose two copies would outweigh the others' savings).
  bool keeps_low() const noexcept { return keep_low_; }

  /// The value_type copy of kept unit w, widened from its bfloat16 one.
  void widen(std::size_t w) {
    WrappedState& s = wrapped_[w];
    s.full = take(s.low.size(), false);
    track_transient();
    for (std::size_t i = 0; i < s.low.size(); ++i) s.full[i] = detail::fsdp::to_master<value_type>(s.low[i]);
  }

  /// Storage for a gathered unit or a gradient buffer of n elements, from
  /// the pool (see BufferPool); `zero`: a gradient buffer, which the model adds into.
  Storage take(std::size_t n, bool zero) {
    return pool_.take(n, zero, [this]() noexcept { return transient_held(); });
  }

  /// Returns `v`'s storage to the pool (then empties it).
  void give(Storage& v) noexcept {
    pool_.give(v, [this]() noexcept { return transient_held(); });
  }

  /// Frees the units whose forward use ended (FullShard) but were kept in
  /// case the model came back to them, other than `except`.
  void free_lingering(std::size_t except) noexcept {
    std::erase_if(lingering_, [&](std::size_t w) {
      if (w == except) return false;
      if (wrapped_[w].held == 0) free_unit(w);
      return true;
    });
  }

  /// Model unit u's views; the first ask of any member of a wrapped unit
  /// gathers the whole wrapped unit, which its other members then share.
  const UnitView<compute_type>& acquire(std::size_t u) {
    check_unit(u, "asked for");
    MemberState& s = members_[u];
    const std::size_t w = flat_.member_of[u];
    WrappedState& ws = wrapped_[w];
    if (s.held) {
      throw InvalidArgument(where() + ": the model asked for " + unit_name(u) +
                            " while it still holds it; ask once and keep the handle (ctx.params) while you use it");
    }
    if (!evaluating_ && s.asks == 2) {
      throw InvalidArgument(where() + ": the model asked for " + unit_name(u) +
                            " a third time in one step; a step asks once in forward and once in backward");
    }
    ++s.asks;
    const bool backward = !evaluating_ && s.asks == 2;
    if (!sharded()) {
      s.held = true;
      ++ws.held;
      return s.view;
    }
    // A unit whose forward ended goes once another is asked for.
    free_lingering(w);
    if (computes_low) {
      if (ws.low.empty()) gather(w);
    } else if (ws.full.empty()) {
      if (ws.low.empty()) {
        gather(w);
      } else {
        widen(w);
      }
    }
    // The next unit's gather overlaps this one's use: decided from the
    // model's asks alone, so every rank issues the same gathers in one order.
    if (!evaluating_ && !backward && o_.forward_prefetch && w + 1 < wrapped_.size()) prefetch(w + 1);
    if (backward && o_.backward_prefetch == BackwardPrefetch::BackwardPre && w > 0) prefetch(w - 1);
    wait_gathered(w);
    if constexpr (computes_low) {
      std::span<bfloat16> grads;
      if (backward) {
        // Zeroed per backward: the model adds into it; NoSync's sum is in `grad`.
        if (ws.low_grad.empty()) {
          // Reduced from itself: FullShard holds one at a time, as a value_type buffer below.
          if (reduces_low_grad()) retire_reductions(full_shard() ? 0 : 1);
          ws.low_grad.assign(ws.low.size(), bfloat16(0.0f));
          track_transient();
        }
        grads = std::span<bfloat16>(ws.low_grad).subspan(flat_.member_offset[u], flat_.model_sizes[u]);
      }
      s.view = make_view(u, std::span<bfloat16>(ws.low).subspan(flat_.member_offset[u], flat_.model_sizes[u]), grads);
      s.held = true;
      ++ws.held;
      return s.view;
    }
    std::span<value_type> grads;
    if (backward) {
      // Under NoSync the gradient of earlier micro-steps is still there.
      if (ws.grad.empty()) {
        // FullShard: one gradient buffer at a time (the previous unit's
        // reduction is waited for); ShardGradOp gathers nothing in backward,
        // so one reduction may run while the next gradient is filled.
        retire_reductions(full_shard() ? 0 : 1);
        // The padded unit only: the reduce-scatter writes straight into this
        // rank's gradient shard; offloaded, into c more, copied out from there.
        const std::size_t n = static_cast<std::size_t>(shard_comm().size()) + (offloaded() ? 1 : 0);
        ws.grad = take(flat_.chunks[w] * n, true);
        track_transient();
      }
      grads = std::span<value_type>(ws.grad).subspan(flat_.member_offset[u], flat_.model_sizes[u]);
    }
    if constexpr (!computes_low) {
      s.view =
          make_view(u, std::span<value_type>(ws.full).subspan(flat_.member_offset[u], flat_.model_sizes[u]), grads);
    }
    s.held = true;
    ++ws.held;
    return s.view;
  }

  /// Starts gathering wrapped unit w on the worker, behind what is queued there.
  void gather(std::size_t w) {
    WrappedState& s = wrapped_[w];
    const std::size_t g = flat_.chunks[w] * static_cast<std::size_t>(shard_comm().size());
    if (computes_low) {
      // The model's views point into what the gather receives.
      s.low.assign(g, bfloat16(0.0f));
    } else {
      s.full = take(g, false);
      // ShardGradOp keeps the bfloat16 copy it receives (keeps_low); otherwise it is the worker's scratch.
      if (keeps_low()) s.low = std::vector<bfloat16>(g);
    }
    track_transient();
    const std::span<bfloat16> kept(s.low);
    const bool low = param_bf16_;
    const std::size_t e = low ? sizeof(bfloat16) : sizeof(value_type);
    trace_.push_back({Collective::all_gather, w, gathered_units(), g * e});
    count_sent(Collective::all_gather, g, shard_comm(), e);
    const std::span<const value_type> home = unit_shard(w);
    const std::span<value_type> out(s.full);
    const AllGather<Algo> all_gather{labelled(detail::LabelPhase::gather, w)};
    // Offloaded, the chunk is copied in on the worker (behind, and so
    // overlapping, what the rank's thread does meanwhile).
    OffloadSpace* const space = o_.offload.get();
    if (space) step_.offload_in_bytes += home.size_bytes();
    // The worker's time in the gather is gather_seconds; the caller's wait for it (wait_gathered) is exposed.
    s.gathering = worker_->submit("ShardedTrainer gather of " + wrapped_name(w),
                                  detail::timed(&step_.gather_seconds,
                                                [all_gather, home, out, kept, low, space](Communicator<backend_type>& c) {
                                                  detail::fsdp::gather_unit<computes_low>(c, all_gather, home, out,
                                                                                          kept, low, space);
                                                }));
  }

  /// Gathers w ahead of its ask, unless it is gathered or the limit is reached.
  void prefetch(std::size_t w) {
    if (wrapped_[w].gathered()) return;
    if (o_.limit_all_gathers != 0 && gathered_units() >= o_.limit_all_gathers) return;
    gather(w);
  }

  void wait_gathered(std::size_t w) {
    Request& r = wrapped_[w].gathering;
    if (r.valid()) {
      const detail::Stopwatch waiting(&step_.exposed_comm_seconds);
      r.wait();
      r = Request();
    }
  }

  /// Wrapped units whose parameters are gathered (or being gathered) now.
  std::size_t gathered_units() const noexcept { return detail::fsdp::gathered_units<value_type>(wrapped_); }

  /// The model let go of model unit u. Its wrapped unit is freed once no
  /// member is held and, per strategy, its members' forward (FullShard) or
  /// backward (every strategy) is over.
  void release(std::size_t u) noexcept {
    // A handle kept past the end of its step was already let go of.
    if (u >= members_.size() || !members_[u].held) return;
    MemberState& s = members_[u];
    const std::size_t w = flat_.member_of[u];
    WrappedState& ws = wrapped_[w];
    s.held = false;
    --ws.held;
    if (!sharded() || ws.held > 0) return;
    if (evaluating_) {
      if (members_asked(w, 1)) {
        free_unit(w);
      } else {
        lingering_.push_back(w);
      }
      return;
    }
    if (s.asks == 1) {
      // ShardGradOp keeps forward's gather for the backward.
      if (!full_shard()) {
        if (keeps_low()) give(ws.full);
        return;
      }
      // FullShard reshards after forward; the unit released last in forward
      // stays until another is asked for (keep_last_forward_unit), as does
      // one some of whose members have not been asked for yet.
      if (members_asked(w, 1) && !o_.keep_last_forward_unit) {
        free_unit(w);
      } else {
        lingering_.push_back(w);
      }
      return;
    }
    if (!members_asked(w, 2)) return;
    if (!keeps_gathered()) {
      free_unit(w);
    } else if (keeps_low()) {
      give(ws.full);
    }
  }

  /// ShardGradOp in a NoSync micro-step keeps each unit gathered until the
  /// synced step's backward, as FSDP's SHARD_GRAD_OP inside no_sync: the
  /// parameters cannot change before the optimizer step, so a gather per
  /// micro-step would move the same bytes K times.
  bool keeps_gathered() const noexcept { return sharded() && !full_shard() && !reducing_; }

  /// Model unit u's gradient is final; once every member of its wrapped
  /// unit is, the wrapped unit's gradient is reduced.
  void ready(std::size_t u) {
    check_unit(u, "reported ready");
    MemberState& m = members_[u];
    if (evaluating_) {
      throw InvalidArgument(where() + ": the model reported " + unit_name(u) +
                            " ready during evaluate(), which runs no backward");
    }
    if (m.ready) {
      throw InvalidArgument(where() + ": the model reported " + unit_name(u) + " ready twice in one backward");
    }
    if (!m.held || m.asks != 2) {
      throw InvalidArgument(where() + ": the model reported " + unit_name(u) +
                            " ready without holding it from a backward ask; in backward, hold `auto p = "
                            "ctx.params(u)` (its second ask of the step), add the gradient into p's grad views, "
                            "then call ctx.ready(u)");
    }
    m.ready = true;
    const std::size_t u_w = flat_.member_of[u];
    if (++wrapped_[u_w].ready < last_member(u_w) - first_member(u_w) + 1) return;
    if constexpr (computes_low) {
      if (!reduces_low_grad()) fold_low_grad(u_w);
    }
    if (sharded() && o_.backward_prefetch == BackwardPrefetch::BackwardPost && u_w > 0) prefetch(u_w - 1);
    if (!reducing_) return;
    reduce(u_w);
  }

  /// Reduces wrapped unit u's gradient to its owners, on the worker.
  void reduce(std::size_t u) {
    WrappedState& s = wrapped_[u];
    const Options opts = labelled(detail::LabelPhase::reduce, u);
    const Options replica_opts = labelled(detail::LabelPhase::replica_reduce, u);
    // Sharded accumulation: after the first micro-step, add to the shard.
    const bool add = o_.accumulation == AccumulationMode::Sharded && micro_steps_ > 0;
    const value_type scale = local_scale_;
    // One rank reduces nothing: its gradient is not rounded for a wire.
    const bool low = reduce_bf16_ && comm_.size() > 1;
    const std::size_t e = low ? sizeof(bfloat16) : sizeof(value_type);
    if (!sharded()) {
      trace_.push_back({Collective::all_reduce, u, 0, flat_.sizes[u] * e});
      count_sent(Collective::all_reduce, flat_.sizes[u], comm_, e);
      const std::span<value_type> g = grad_shard().subspan(flat_.offsets[u], flat_.sizes[u]);
      if (scale != value_type(1)) {
        for (value_type& x : g) x *= scale;
      }
      s.request = worker_->submit("ShardedTrainer all-reduce of " + wrapped_name(u),
                                  detail::timed(&step_.reduce_seconds, [opts, g, low](Communicator<backend_type>& c) {
                                    detail::fsdp::all_reduce_unit<Algo>(c, opts, g, low);
                                  }));
      return;
    }
    const std::size_t n = static_cast<std::size_t>(shard_comm().size());
    trace_.push_back({Collective::reduce_scatter, u, 0, n * flat_.chunks[u] * e});
    count_sent(Collective::reduce_scatter, n * flat_.chunks[u], shard_comm(), e);
    // Its gradient buffer is freed once this reduction is over (retire_reductions).
    in_reduction_.push_back(u);
    const std::size_t count = flat_.sizes[u];
    // A bfloat16 model's gradient is reduced from its own buffer (reduces_low_grad), else from `grad`.
    const bool direct = reduces_low_grad();
    const std::span<value_type> storage =
        direct ? std::span<value_type>() : std::span<value_type>(s.grad).first(n * flat_.chunks[u]);
    const std::span<const bfloat16> low_in = direct ? std::span<const bfloat16>(s.low_grad) : std::span<const bfloat16>();
    // Offloaded, the result lands in the buffer's tail and is copied out to `home`.
    OffloadSpace* const space = o_.offload.get();
    const std::span<value_type> home = grad_shard().subspan(flat_.offsets[u], flat_.chunks[u]);
    const std::span<value_type> mine = space ? std::span<value_type>(s.grad).subspan(n * flat_.chunks[u]) : home;
    if (space) step_.offload_out_bytes += home.size_bytes();
    if (scale != value_type(1)) {
      // NoSync's step only, which folds into `grad` (never direct).
      for (value_type& x : storage.first(count)) x *= scale;
    }
    // The replica communicator is used only here, on the shard group's
    // worker, after construction: one thread, one order.
    Comm* replicas = replica_comm_ ? &*replica_comm_ : nullptr;
    if (replicas) {
      trace_.push_back({Collective::all_reduce, u, 0, flat_.chunks[u] * e});
      count_sent(Collective::all_reduce, flat_.chunks[u], *replicas, e);
    }
    const auto divisor = static_cast<value_type>(comm_.size());
    s.request = worker_->submit(
        std::string(replicas ? "ShardedTrainer reduce-scatter and replica all-reduce of "
                             : "ShardedTrainer reduce-scatter of ") +
            wrapped_name(u),
        detail::timed(&step_.reduce_seconds, [opts, replica_opts, storage, low_in, count, mine, replicas, divisor,
                                              add, low, space, home](Communicator<backend_type>& c) {
          if (low) {
            detail::fsdp::reduce_unit<Algo, bfloat16>(c, opts, replica_opts, storage, low_in, count, mine, replicas,
                                                      divisor, add);
          } else {
            detail::fsdp::reduce_unit<Algo, value_type>(c, opts, replica_opts, storage, {}, count, mine, replicas,
                                                        divisor, add);
          }
          if (space) {
            space->copy_out(home.data(), mine.data(), mine.size_bytes());
            space->wait();
          }
        }));
  }

  /// `keep_grads`: a NoSync micro-step, whose unsharded gradients stay.
  void finish_reductions(bool keep_grads) {
    std::string missing;
    for (std::size_t u = 0; u < members_.size(); ++u) {
      if (!members_[u].ready) missing += (missing.empty() ? "" : ", ") + unit_name(u);
    }
    std::exception_ptr first;
    {
      const detail::Stopwatch waiting(&step_.exposed_comm_seconds);
      first = drain();
    }
    // A micro-step that failed keeps no gather: what follows may be anything (a checkpoint load).
    release_all(keep_grads, keep_grads && keeps_gathered() && !first && missing.empty());
    if (first) std::rethrow_exception(first);
    if (!missing.empty()) {
      throw InvalidArgument(where() + ": backward reported no gradient for " + missing +
                            ". Every unit must call ctx.ready(u) in every step");
    }
  }

  /// After a step that threw, or an evaluation: let what is in flight end
  /// and free every gathered unit.
  void abandon_step() noexcept {
    settle_all();
    // Gradients accumulated before a failed training step are dropped.
    if (!evaluating_ && micro_steps_ > 0) {
      micro_steps_ = 0;
      std::ranges::fill(grad_shard(), value_type(0));
    }
    release_all(evaluating_);
    evaluating_ = false;
  }

  /// `keep_gathered`: the gathered units stay too (keeps_gathered()).
  void release_all(bool keep_grads, bool keep_gathered = false) noexcept {
    lingering_.clear();
    in_reduction_.clear();
    for (std::size_t w = 0; w < wrapped_.size(); ++w) {
      WrappedState& s = wrapped_[w];
      s.request = Request();
      s.gathering = Request();
      if (!keep_grads) give(s.grad);
      // Folded at ready; one is left only by a backward that failed part-way.
      std::vector<bfloat16>().swap(s.low_grad);
      if (sharded() && !keep_gathered) free_unit(w);
      s.held = 0;
    }
    for (MemberState& m : members_) m.held = false;
  }

  /// Waits for every reduction and gather (a prefetch the model never
  /// used included); returns the first failure.
  std::exception_ptr drain() {
    std::exception_ptr first;
    for (WrappedState& s : wrapped_) {
      for (Request* r : {&s.gathering, &s.request}) {
        try {
          if (r->valid()) r->wait();
        } catch (...) {
          if (!first) first = std::current_exception();
        }
        *r = Request();
      }
    }
    return first;
  }

  /// What decides memory_need() besides the options and the layout.
  detail::fsdp::MemoryFacts memory_facts() const noexcept {
    return {.shards = static_cast<std::size_t>(shard_comm().size()),
            .offload = offloaded(),
            .state_in_space = state_in_space(),
            .state_per_element = optimizer_state_per_element(),
            .element_bytes = sizeof(value_type),
            .keeps_low = keep_low_,
            .computes_low = computes_low,
            .reduces_low_grad = reduces_low_grad(),
            .inits_units = detail::ModelInitsUnits<M>};
  }

  /// Records the high-water mark of what gathered units and gradient
  /// buffers hold; called after each allocation, where the sum can only have grown.
  void track_transient() noexcept {
    peak_.track(transient_held());
  }

  /// Frees the gradient buffers of finished reductions, oldest first,
  /// first waiting until at most `in_flight` are left running. A reduction
  /// that failed is freed too; drain() still rethrows its error.
  void retire_reductions(std::size_t in_flight) {
    std::size_t done = 0;
    for (; done < in_reduction_.size(); ++done) {
      WrappedState& s = wrapped_[in_reduction_[done]];
      if (in_reduction_.size() - done > in_flight) {
        const detail::Stopwatch waiting(&step_.exposed_comm_seconds);
        detail::settle(s.request);
      } else {
        bool over = true;
        try {
          over = s.request.test();
        } catch (...) {
        }
        if (!over) break;
      }
      give(s.grad);
      std::vector<bfloat16>().swap(s.low_grad);
    }
    in_reduction_.erase(in_reduction_.begin(), in_reduction_.begin() + static_cast<std::ptrdiff_t>(done));
  }

  /// Adds what this rank sends in a Ring `collective` of `count` elements
  /// of `element_bytes` each on `c` to the step's figures.
  void count_sent(Collective collective, std::size_t count, const Comm& c, std::size_t element_bytes) noexcept {
    const std::size_t sent =
        detail::ring_sent(collective, count, static_cast<std::size_t>(c.size()), static_cast<std::size_t>(c.rank()));
    step_.sent_elements += sent;
    step_.sent_bytes += sent * element_bytes;
  }

  void settle_all() noexcept {
    for (WrappedState& s : wrapped_) {
      detail::settle(s.gathering);
      detail::settle(s.request);
    }
  }

  Comm& comm_;
  M model_;
  Opt opt_;
  ShardedTrainerOptions o_;
  std::vector<UnitSpec> specs_;
  /// Where every wrapped unit lies, in the unit and in the flat shard.
  detail::fsdp::FlatShard flat_;
  std::vector<std::size_t> buffer_offsets_;
  // 64-byte aligned, as ReplicatedTrainer's, so vectorized math sums in one
  // order whatever else the process allocated (exact resume).
  std::vector<value_type, detail::AlignedAllocator<value_type>> shard_params_, shard_grads_, buffers_;
  /// Offload: the master and gradient shards, in the offload space (else empty).
  Offloaded off_params_, off_grads_;
  /// Offload: the optimizer's state, lent to it by bind_state (empty if it has none).
  Offloaded off_state_;
  /// NoShard with a bfloat16 model: the copies its steps see (else empty).
  std::vector<bfloat16> low_params_, low_grads_;
  ShardPlan plan_;
  std::optional<detail::StepLabels> labels_;  ///< what each collective moves; made with the plan
  std::vector<MemberState> members_;
  std::vector<WrappedState> wrapped_;
  std::vector<ShardedTraceEvent> trace_;
  Provider provider_{*this};
  bool evaluating_ = false;
  /// FullShard: wrapped units kept gathered after their forward until
  /// another is asked for (keep_last_forward_unit, or members not yet asked).
  std::vector<std::size_t> lingering_;
  /// forward_backward() ran and optimizer_step() has not.
  bool pending_ = false;
  /// accumulate() calls since the last step.
  std::size_t micro_steps_ = 0;
  /// This backward reduces each ready unit (false: a NoSync micro-step).
  bool reducing_ = true;
  /// Applied to each unit's local gradient before its reduction.
  value_type local_scale_ = value_type(1);
  /// param_dtype / reduce_dtype are bfloat16 (else the master type).
  bool param_bf16_ = false, reduce_bf16_ = false;
  /// ShardGradOp keeps its gathered units' bfloat16 copies (keeps_low).
  bool keep_low_ = false;
  TrainerStats stats_{};
  /// HybridShard's groups; declared before worker_, which runs on the first.
  std::optional<Comm> shard_comm_, replica_comm_;
  std::shared_ptr<ProgressWorker<backend_type>> worker_;
  /// Wrapped units whose gradient buffer a reduction still holds, in submission order.
  std::vector<std::size_t> in_reduction_;
  detail::fsdp::TransientPeak peak_;
  std::size_t construction_bytes_ = 0;
  /// Storage of freed gathered units and gradient buffers, kept for the
  /// next of the same size; with what is in use, at most the transient need.
  detail::fsdp::BufferPool<value_type> pool_;
  /// This step's figures; the worker's jobs add their times to it.
  StepStats step_{};
};

}  // namespace gradsync

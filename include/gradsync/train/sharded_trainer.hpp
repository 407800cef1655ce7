#pragma once
/// \file ShardedTrainer: parameters, gradients and optimizer state 1/N per rank (PyTorch FSDP, ZeRO-3 semantics).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/collective/all_gather.hpp"
#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/collective/broadcast.hpp"
#include "gradsync/collective/progress_worker.hpp"
#include "gradsync/collective/reduce_scatter.hpp"
#include "gradsync/core/backend_traits.hpp"
#include "gradsync/core/collective.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/request.hpp"
#include "gradsync/train/clip_grad_norm.hpp"
#include "gradsync/train/memory_need.hpp"
#include "gradsync/train/model.hpp"
#include "gradsync/train/optimizer.hpp"
#include "gradsync/train/replicated_trainer.hpp"
#include "gradsync/train/step_stats.hpp"
#include "gradsync/train/unit_agreement.hpp"

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
  /// Bytes per rank this trainer may hold (persistent + transient, see
  /// ShardedTrainer::memory_need); 0: no limit. A configuration that needs
  /// more is refused at construction, before the parameters are broadcast.
  /// Give every rank the same value.
  std::size_t memory_budget = 0;
};

/// One collective a ShardedTrainer issued in a step, in issue order.
struct ShardedTraceEvent {
  Collective collective;
  std::size_t unit;
};

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
/// model asks, which is the same on every rank; a gather is waited for,
/// reductions overlap the rest of backward. Under NoShard nothing is
/// gathered and each unit is all-reduced (Avg) instead.
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
/// Not yet: prefetch, accumulation, mixed precision and offload (issue 13).
///
/// \tparam M     the model (see gradsync::Model); its forward_backward must use StepContext.
/// \tparam Opt   an optimizer on flat spans of M::value_type (Sgd, Adam, AdamW, ...).
/// \tparam Comm  gradsync::Communicator<Backend>.
/// \tparam Algo  the algorithm of every collective.
template <class M, class Opt, class Comm, class Algo = Auto>
class ShardedTrainer {
  static_assert(detail::CommunicatorTraits<Comm>::value,
                "gradsync::ShardedTrainer: the third parameter must be gradsync::Communicator<Backend>");
  static_assert(detail::communicates_host_memory<Comm>,
                "gradsync::ShardedTrainer needs a backend whose memory space is host memory: it keeps shards and "
                "gathered units in host vectors and steps the optimizer on the host.");
  static_assert(detail::ModelHasValueType<M>,
                "gradsync::ShardedTrainer: the model must declare `using value_type = float;` (or double)");
  static_assert(detail::ModelDeclaresUnits<M>,
                "gradsync::ShardedTrainer: the model must declare its parameters with "
                "`std::vector<gradsync::UnitSpec> units() const`");
  static_assert(detail::ModelBinds<M>,
                "gradsync::ShardedTrainer: the model must accept its initial storage with "
                "`void bind(std::span<const gradsync::UnitView<value_type>>)`");
  static_assert(std::move_constructible<M>, "gradsync::ShardedTrainer: the model must be move-constructible");

 public:
  using model_type = M;
  using optimizer_type = Opt;
  using communicator_type = Comm;
  using backend_type = typename detail::CommunicatorTraits<Comm>::backend;
  using value_type = typename M::value_type;
  using algorithm = Algo;

  static_assert(Optimizer<Opt, value_type>,
                "gradsync::ShardedTrainer: the optimizer must provide `step(std::span<T> params, "
                "std::span<const T> grads)`, `double lr() const` and `set_lr(double)` for T = the model's value_type");

  ShardedTrainer(Comm& comm, M model, Opt optimizer, ShardedTrainerOptions options = {})
      : comm_(comm), model_(std::move(model)), opt_(std::move(optimizer)), o_(options), specs_(model_.units()) {
    detail::check_units_agree(comm_, detail::describe_units(specs_), "ShardedTrainer",
                              "Every rank's model must declare the same units, with the same names and shapes, in "
                              "the same order: check what its units() depends on (configuration, rank, world size).");
    split();
    layout();
    if (total_ == 0) {
      // Every rank declared the same units, so every rank throws this.
      throw InvalidArgument("gradsync: ShardedTrainer on rank " + std::to_string(comm_.rank()) +
                            ": the model declares no parameters (" + std::to_string(specs_.size()) +
                            " units, 0 elements); there is nothing to shard or train");
    }
    check_budget();
    initialise();
    worker_ = ProgressWorker<backend_type>::shared(shard_comm());
  }
  ShardedTrainer(const ShardedTrainer&) = delete;
  ShardedTrainer& operator=(const ShardedTrainer&) = delete;
  /// What is in flight uses this trainer's buffers: let it end first.
  ~ShardedTrainer() { settle_all(); }

  /// One training step on this rank's batch: forward and backward, each
  /// unit gathered when asked for and its gradient reduced to its owner as
  /// soon as it is ready, then an optimizer step on this rank's shard.
  /// Returns this rank's loss on `batch`.
  template <class Batch>
  double step(const Batch& batch) {
    static_assert(TrainableOn<M, Batch>,
                  "gradsync::ShardedTrainer::step: the model has no `double forward_backward(const Batch&, "
                  "const gradsync::StepContext<value_type>&)` for this batch type");
    const double loss = forward_backward(batch);
    optimizer_step();
    return loss;
  }

  /// The first half of step(): forward, backward, and each unit's gradient
  /// reduced to its owner, without the optimizer step. Then clip_grad_norm()
  /// if you like, and optimizer_step().
  template <class Batch>
  double forward_backward(const Batch& batch) {
    static_assert(TrainableOn<M, Batch>,
                  "gradsync::ShardedTrainer::forward_backward: the model has no `double forward_backward(const "
                  "Batch&, const gradsync::StepContext<value_type>&)` for this batch type");
    if (pending_) {
      throw InvalidArgument(where() + ": forward_backward after a forward_backward() whose optimizer_step() has "
                            "not run yet");
    }
    step_ = {};
    if (o_.broadcast_buffers && !buffers_.empty()) {
      Broadcast<Algo>{o_.collective}(comm_, std::span<value_type>(buffers_), 0);
    }
    trace_.clear();
    begin_step(false);
    const auto t0 = std::chrono::steady_clock::now();
    double loss = 0;
    try {
      const StepContext<value_type> ctx(provider_);
      loss = static_cast<double>(model_.forward_backward(batch, ctx));
    } catch (...) {
      abandon_step();
      throw;
    }
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats_.compute_seconds += wall;
    step_.compute_seconds = wall - step_.exposed_comm_seconds;
    finish_reductions();
    pending_ = true;
    return loss;
  }

  /// Between forward_backward() and optimizer_step(): the global norm of
  /// order p of the averaged gradient (infinity: the largest magnitude).
  /// Each rank takes Σ|g|^p (or max|g|) over its shard, an AllReduce Sum (or
  /// Max) combines them, so every rank returns the same value; under NoShard
  /// every rank holds the whole gradient and nothing is communicated (each
  /// element counted once). If the norm exceeds max_norm, the gradient is
  /// scaled by max_norm / (norm + 1e-6), as PyTorch's clip_grad_norm_.
  /// Collective.
  double clip_grad_norm(double max_norm, double p = 2.0) {
    detail::check_norm_order("ShardedTrainer", max_norm, p);
    if (!pending_) {
      throw InvalidArgument(where() +
                            ": clip_grad_norm needs the reduced gradient: call it between forward_backward() and "
                            "optimizer_step()");
    }
    double partial = detail::norm_partial(std::span<const value_type>(shard_grads_), p);
    // Replicas hold the same shards: the shard group's partials are the whole.
    if (sharded() && shard_comm().size() > 1) {
      const AllReduce<Algo> all_reduce{o_.collective};
      if (std::isinf(p)) {
        all_reduce(shard_comm(), std::span<double>(&partial, 1), Max{});
      } else {
        all_reduce(shard_comm(), std::span<double>(&partial, 1), Sum{});
      }
    }
    const double total = detail::norm_total(partial, p);
    detail::clip_to(std::span<value_type>(shard_grads_), total, max_norm);
    return total;
  }

  /// The second half of step(): the optimizer step on this rank's shard;
  /// the gradient shard is then zeroed.
  void optimizer_step() {
    if (!pending_) {
      throw InvalidArgument(where() + ": optimizer_step without a forward_backward() before it");
    }
    pending_ = false;
    const auto t0 = std::chrono::steady_clock::now();
    opt_.step(std::span<value_type>(shard_params_), std::span<const value_type>(shard_grads_));
    std::fill(shard_grads_.begin(), shard_grads_.end(), value_type(0));
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
    const StepContext<value_type> ctx(provider_);
    return std::forward<F>(f)(ctx);
  }

  M& model() noexcept { return model_; }
  const M& model() const noexcept { return model_; }
  Opt& optimizer() noexcept { return opt_; }
  Comm& communicator() noexcept { return comm_; }
  const ShardedTrainerOptions& options() const noexcept { return o_; }
  const std::vector<UnitSpec>& units() const noexcept { return specs_; }

  /// This rank's shard of every unit, padded chunks one after the other.
  std::span<const value_type> shard() const noexcept { return shard_params_; }
  /// Unit u's elements (unpadded).
  std::size_t unit_size(std::size_t u) const { return sizes_.at(u); }
  /// Elements of each rank's chunk of unit u (padding included): ⌈P/N⌉, or P under NoShard.
  std::size_t chunk_size(std::size_t u) const { return chunks_.at(u); }
  /// Unit u's elements this rank owns, [first, first + count) of the unit;
  /// the rest of its chunk is zero padding. Under NoShard: all of them.
  std::pair<std::size_t, std::size_t> owned_range(std::size_t u) const {
    const std::size_t c = chunks_.at(u), p = sizes_.at(u);
    if (o_.strategy == ShardingStrategy::NoShard) return {0, p};
    const std::size_t first = std::min(p, static_cast<std::size_t>(shard_comm().rank()) * c);
    return {first, std::min(c, p - first)};
  }
  /// This rank's chunk of unit u, padding included.
  std::span<const value_type> unit_shard(std::size_t u) const {
    return std::span<const value_type>(shard_params_).subspan(offsets_.at(u), chunks_.at(u));
  }

  /// Gathers every unit's parameters, unpadded, units in declaration order
  /// (what ReplicatedTrainer::parameters() holds). Collective.
  std::vector<value_type> full_parameters() {
    std::vector<value_type> all;
    all.reserve(total_);
    for (std::size_t u = 0; u < specs_.size(); ++u) {
      if (o_.strategy == ShardingStrategy::NoShard) {
        const auto s = unit_shard(u);
        all.insert(all.end(), s.begin(), s.end());
        continue;
      }
      std::vector<value_type> full(chunks_[u] * static_cast<std::size_t>(shard_comm().size()));
      AllGather<Algo>{o_.collective}(shard_comm(), unit_shard(u), std::span<value_type>(full));
      all.insert(all.end(), full.begin(), full.begin() + static_cast<std::ptrdiff_t>(sizes_[u]));
    }
    return all;
  }

  std::span<value_type> buffers() noexcept { return buffers_; }

  /// Bytes this rank keeps between steps: its parameter and gradient shards
  /// and the optimizer's state on them, (2 + S)·sizeof(T)·Σ_u c_u, S being
  /// the optimizer's state elements per parameter (0 for SGD, 1 with
  /// momentum, 2 for Adam and AdamW; 0 for an optimizer that does not say,
  /// through `state_per_element()`). Buffers are replicated and left out.
  std::size_t persistent_bytes() const noexcept {
    return (2 + optimizer_state_per_element()) * sizeof(value_type) * shard_params_.size();
  }

  /// What this rank needs, by the formula (detail::sharded_memory_need):
  /// persistent bytes exactly, transient bytes as the most a step holds at once.
  MemoryNeed memory_need() const { return need(o_.strategy); }
  /// The most transient bytes (gathered units, gradient buffers) this rank
  /// really held at once since construction or reset_peak_transient().
  std::size_t peak_transient_bytes() const noexcept { return peak_transient_; }
  void reset_peak_transient() noexcept { peak_transient_ = 0; }

  /// The last forward_backward() and optimizer_step(): time per phase, and
  /// elements sent as Ring sends them (see StepStats).
  StepStats last_step() const noexcept {
    StepStats s = step_;
    s.sent_bytes = s.sent_elements * sizeof(value_type);
    return s;
  }

  /// The collectives of the last step, in the order this rank issued them.
  const std::vector<ShardedTraceEvent>& trace() const noexcept { return trace_; }

  const TrainerStats& stats() const noexcept { return stats_; }

 private:
  struct UnitState {
    std::vector<value_type> full;   ///< gathered parameters, N·c (empty when resharded)
    std::vector<value_type> grad;   ///< unsharded gradient and the reduction's output (backward only)
    UnitView<value_type> view;      ///< what the model sees while it holds the unit
    int asks = 0;                   ///< in this step: 1 = forward, 2 = backward
    bool held = false;
    bool ready = false;
    Request request;                ///< the gradient's reduction
  };

  /// Lends the model its units: gathers on demand, frees on release.
  class Provider final : public detail::UnitProvider<value_type> {
   public:
    explicit Provider(ShardedTrainer& t) : t_(t) {}
    const UnitView<value_type>& acquire(std::size_t u) override { return t_.acquire(u); }
    void release(std::size_t u) noexcept override { t_.release(u); }
    void ready(std::size_t u) override { t_.ready(u); }

   private:
    ShardedTrainer& t_;
  };

  std::size_t optimizer_state_per_element() const noexcept {
    if constexpr (requires(const Opt& o) {
                    { o.state_per_element() } -> std::convertible_to<std::size_t>;
                  }) {
      return opt_.state_per_element();
    } else {
      return 0;
    }
  }

  bool sharded() const noexcept { return o_.strategy != ShardingStrategy::NoShard; }
  bool full_shard() const noexcept {
    return o_.strategy == ShardingStrategy::FullShard || o_.strategy == ShardingStrategy::HybridShard;
  }

  /// Where units are sharded and gathered: the shard group under
  /// HybridShard, else the whole communicator.
  Comm& shard_comm() noexcept { return shard_comm_ ? *shard_comm_ : comm_; }
  const Comm& shard_comm() const noexcept { return shard_comm_ ? *shard_comm_ : comm_; }

  /// HybridShard: the shard group and the replica group of this rank, both
  /// split from the communicator (collective; every rank the same options).
  void split() {
    if (o_.strategy != ShardingStrategy::HybridShard) return;
    const int world = comm_.size();
    const int s = o_.shard_size == 0 ? world : o_.shard_size;
    if (s < 1 || world % s != 0) {
      throw InvalidArgument(where() + ": HybridShard needs a shard_size that divides the world size " +
                            std::to_string(world) + ", got " + std::to_string(o_.shard_size));
    }
    if constexpr (requires(Comm& c) { c.split(0, 0); }) {
      const int r = comm_.rank();
      // Colors are never no_color, so both splits give a communicator.
      if (auto g = comm_.split(r / s, r)) shard_comm_.emplace(std::move(*g));
      if (auto g = comm_.split(r % s, r)) replica_comm_.emplace(std::move(*g));
    } else {
      throw InvalidArgument(where() + ": HybridShard needs Communicator::split, which this backend lacks");
    }
  }

  std::string where() const { return "gradsync: ShardedTrainer on rank " + std::to_string(comm_.rank()); }
  std::string unit_name(std::size_t u) const { return "unit " + std::to_string(u) + " ('" + specs_[u].name + "')"; }

  void layout() {
    const auto n = static_cast<std::size_t>(shard_comm().size());
    std::size_t at = 0;
    for (const UnitSpec& s : specs_) {
      std::size_t p = 0;
      for (const TensorSpec& t : s.params) p += t.count();
      const std::size_t c = sharded() ? (p + n - 1) / n : p;
      sizes_.push_back(p);
      chunks_.push_back(c);
      offsets_.push_back(at);
      at += c;
      total_ += p;
    }
    shard_params_.assign(at, value_type(0));
    shard_grads_.assign(at, value_type(0));
    units_.resize(specs_.size());
  }

  /// Views of unit u over `params` (P elements) and `grads` (P or none), and its buffers.
  UnitView<value_type> make_view(std::size_t u, std::span<value_type> params, std::span<value_type> grads) {
    UnitView<value_type> v;
    std::size_t p = 0;
    for (const TensorSpec& t : specs_[u].params) {
      const std::span<value_type> g = grads.empty() ? std::span<value_type>() : grads.subspan(p, t.count());
      v.params.push_back({params.subspan(p, t.count()), g, &t});
      p += t.count();
    }
    std::size_t b = 0;
    for (const TensorSpec& t : specs_[u].buffers) {
      v.buffers.push_back({std::span<value_type>(buffers_).subspan(buffer_offsets_[u] + b, t.count()), {}, &t});
      b += t.count();
    }
    v.flat_params = params;
    v.flat_grads = grads;
    v.flat_buffers = std::span<value_type>(buffers_).subspan(buffer_offsets_[u], b);
    return v;
  }

  /// The model writes its initial values into full-size storage; rank 0's
  /// are broadcast, and each rank keeps its chunks.
  void initialise() {
    std::size_t nb = 0;
    for (const UnitSpec& s : specs_) {
      buffer_offsets_.push_back(nb);
      for (const TensorSpec& t : s.buffers) nb += t.count();
    }
    buffers_.assign(nb, value_type(0));
    std::vector<value_type> params(total_, value_type(0)), grads(total_, value_type(0));
    std::vector<UnitView<value_type>> views;
    std::size_t at = 0;
    for (std::size_t u = 0; u < specs_.size(); ++u) {
      views.push_back(make_view(u, std::span<value_type>(params).subspan(at, sizes_[u]),
                                std::span<value_type>(grads).subspan(at, sizes_[u])));
      at += sizes_[u];
    }
    model_.bind(std::span<const UnitView<value_type>>(views));
    const Broadcast<Algo> broadcast{o_.collective};
    broadcast(comm_, std::span<value_type>(params), 0);
    if (!buffers_.empty()) broadcast(comm_, std::span<value_type>(buffers_), 0);
    at = 0;
    for (std::size_t u = 0; u < specs_.size(); ++u) {
      const auto [first, count] = owned_range(u);
      std::copy_n(params.begin() + static_cast<std::ptrdiff_t>(at + first), count,
                  shard_params_.begin() + static_cast<std::ptrdiff_t>(offsets_[u]));
      at += sizes_[u];
      // NoShard: the shard is the unit, and the model sees it in place.
      if (!sharded()) {
        units_[u].view = make_view(u, std::span<value_type>(shard_params_).subspan(offsets_[u], sizes_[u]),
                                   std::span<value_type>(shard_grads_).subspan(offsets_[u], sizes_[u]));
      }
    }
  }

  void begin_step(bool evaluating) {
    evaluating_ = evaluating;
    for (UnitState& s : units_) {
      s.asks = 0;
      s.held = false;
      s.ready = false;
    }
  }

  void check_unit(std::size_t u, const char* what) const {
    if (u >= units_.size()) {
      throw InvalidArgument(where() + ": the model " + what + " unit " + std::to_string(u) +
                            ", which does not exist (" + std::to_string(units_.size()) + " units)");
    }
  }

  const UnitView<value_type>& acquire(std::size_t u) {
    check_unit(u, "asked for");
    UnitState& s = units_[u];
    if (s.held) {
      throw InvalidArgument(where() + ": the model asked for " + unit_name(u) +
                            " while it still holds it; ask once and keep the handle (ctx.params) while you use it");
    }
    if (!evaluating_ && s.asks == 2) {
      throw InvalidArgument(where() + ": the model asked for " + unit_name(u) +
                            " a third time in one step; a step asks once in forward and once in backward");
    }
    if (!evaluating_) ++s.asks;
    const bool backward = !evaluating_ && s.asks == 2;
    if (!sharded()) {
      s.held = true;
      return s.view;
    }
    // The unit kept from forward goes once another is asked for.
    if (kept_ != no_unit && kept_ != u) std::vector<value_type>().swap(units_[kept_].full);
    kept_ = no_unit;
    if (s.full.empty()) gather(u);
    std::span<value_type> grads;
    if (backward) {
      // ShardGradOp gathers nothing in backward, so nothing else waits for its reductions.
      retire_reductions(full_shard() ? 0 : 1);
      // The padded unit only: the reduce-scatter writes straight into this rank's gradient shard.
      s.grad.assign(chunks_[u] * static_cast<std::size_t>(shard_comm().size()), value_type(0));
      track_transient();
      grads = std::span<value_type>(s.grad).first(sizes_[u]);
    }
    s.view = make_view(u, std::span<value_type>(s.full).first(sizes_[u]), grads);
    s.held = true;
    return s.view;
  }

  void gather(std::size_t u) {
    UnitState& s = units_[u];
    s.full.assign(chunks_[u] * static_cast<std::size_t>(shard_comm().size()), value_type(0));
    track_transient();
    trace_.push_back({Collective::all_gather, u});
    step_.sent_elements += ring_sent(Collective::all_gather, s.full.size(), shard_comm());
    const std::span<const value_type> in = unit_shard(u);
    const std::span<value_type> out(s.full);
    const AllGather<Algo> all_gather{o_.collective};
    const detail::Stopwatch waiting(&step_.exposed_comm_seconds);
    worker_
        ->submit("ShardedTrainer gather of " + unit_name(u),
                 detail::timed(&step_.gather_seconds,
                               [all_gather, in, out](Communicator<backend_type>& c) { all_gather(c, in, out); }))
        .wait();
  }

  void release(std::size_t u) noexcept {
    if (u >= units_.size()) return;
    UnitState& s = units_[u];
    s.held = false;
    if (!sharded()) return;
    // FullShard reshards after forward and after backward; ShardGradOp
    // keeps forward's gather for the backward.
    const bool forward = !evaluating_ && s.asks == 1;
    if (forward && full_shard() && o_.keep_last_forward_unit) {
      if (kept_ != no_unit && kept_ != u && !units_[kept_].held) std::vector<value_type>().swap(units_[kept_].full);
      kept_ = u;
      return;
    }
    const bool free = evaluating_ || full_shard() || s.asks == 2;
    if (free) std::vector<value_type>().swap(s.full);
  }

  void ready(std::size_t u) {
    check_unit(u, "reported ready");
    UnitState& s = units_[u];
    if (evaluating_) {
      throw InvalidArgument(where() + ": the model reported " + unit_name(u) +
                            " ready during evaluate(), which runs no backward");
    }
    if (s.ready) {
      throw InvalidArgument(where() + ": the model reported " + unit_name(u) + " ready twice in one backward");
    }
    if (!s.held || s.asks != 2) {
      throw InvalidArgument(where() + ": the model reported " + unit_name(u) +
                            " ready without holding it from a backward ask; in backward, hold `auto p = "
                            "ctx.params(u)` (its second ask of the step), add the gradient into p's grad views, "
                            "then call ctx.ready(u)");
    }
    s.ready = true;
    const Options opts = o_.collective;
    if (!sharded()) {
      trace_.push_back({Collective::all_reduce, u});
      step_.sent_elements += ring_sent(Collective::all_reduce, sizes_[u], comm_);
      const std::span<value_type> g = std::span<value_type>(shard_grads_).subspan(offsets_[u], sizes_[u]);
      s.request = worker_->submit("ShardedTrainer all-reduce of " + unit_name(u),
                                  detail::timed(&step_.reduce_seconds, [opts, g](Communicator<backend_type>& c) {
                                    if (c.size() > 1) AllReduce<Algo>{opts}(c, g, Avg{});
                                  }));
      return;
    }
    trace_.push_back({Collective::reduce_scatter, u});
    reducing_.push_back(u);
    const std::size_t padded = chunks_[u] * static_cast<std::size_t>(shard_comm().size());
    step_.sent_elements += ring_sent(Collective::reduce_scatter, padded, shard_comm());
    if (replica_comm_) step_.sent_elements += ring_sent(Collective::all_reduce, chunks_[u], *replica_comm_);
    const std::span<const value_type> storage(s.grad);
    const std::span<value_type> mine = std::span<value_type>(shard_grads_).subspan(offsets_[u], chunks_[u]);
    if (replica_comm_) {
      trace_.push_back({Collective::all_reduce, u});
      // The replica communicator is used only here, on the shard group's
      // worker, after construction: one thread, one order.
      Comm* replicas = &*replica_comm_;
      const auto divisor = static_cast<value_type>(comm_.size());
      s.request = worker_->submit("ShardedTrainer reduce-scatter and replica all-reduce of " + unit_name(u),
                                  detail::timed(&step_.reduce_seconds, [opts, storage, mine, replicas,
                                                                        divisor](Communicator<backend_type>& c) {
                                    reduce_scatter(c, opts, storage, mine, false);
                                    if (replicas->size() > 1) AllReduce<Algo>{opts}(*replicas, mine, Sum{});
                                    for (value_type& x : mine) x /= divisor;
                                  }));
      return;
    }
    s.request = worker_->submit("ShardedTrainer reduce-scatter of " + unit_name(u),
                                detail::timed(&step_.reduce_seconds,
                                              [opts, storage, mine](Communicator<backend_type>& c) {
                                                reduce_scatter(c, opts, storage, mine, true);
                                              }));
  }

  /// ReduceScatterAverage's reduction (sum, or the mean: sum, then divide
  /// on the owner) of the padded unit `in` (N·c), straight into this rank's
  /// chunk `mine` (c; its padding gets the sum of zeros).
  static void reduce_scatter(Communicator<backend_type>& c, const Options& opts, std::span<const value_type> in,
                             std::span<value_type> mine, bool mean) {
    if (c.size() == 1) {
      std::copy(in.begin(), in.end(), mine.begin());
    } else if (mean) {
      ReduceScatter<Algo>{opts}(c, in, mine, Avg{});
    } else {
      ReduceScatter<Algo>{opts}(c, in, mine, Sum{});
    }
  }

  void finish_reductions() {
    std::string missing;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (!units_[u].ready) missing += (missing.empty() ? "" : ", ") + unit_name(u);
    }
    std::exception_ptr first;
    {
      const detail::Stopwatch waiting(&step_.exposed_comm_seconds);
      first = drain();
    }
    release_all();
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
    release_all();
    evaluating_ = false;
  }

  void release_all() noexcept {
    kept_ = no_unit;
    reducing_.clear();
    for (UnitState& s : units_) {
      s.request = Request();
      std::vector<value_type>().swap(s.grad);
      if (sharded()) std::vector<value_type>().swap(s.full);
      s.held = false;
    }
  }

  std::exception_ptr drain() {
    std::exception_ptr first;
    for (UnitState& s : units_) {
      try {
        s.request.wait();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
      s.request = Request();
    }
    return first;
  }

  MemoryNeed need(ShardingStrategy strategy) const {
    return detail::sharded_memory_need(std::span<const std::size_t>(sizes_),
                                       static_cast<std::size_t>(shard_comm().size()),
                                       strategy != ShardingStrategy::NoShard, strategy == ShardingStrategy::ShardGradOp,
                                       optimizer_state_per_element(), sizeof(value_type));
  }

  void check_budget() const {
    if (o_.memory_budget == 0) return;
    const MemoryNeed full = need(ShardingStrategy::FullShard);
    const bool least = o_.strategy == ShardingStrategy::FullShard || o_.strategy == ShardingStrategy::HybridShard;
    const std::string advice = least ? "Smaller units lower the transient part, more ranks the persistent part."
                                     : "FullShard would need " + full.describe() + ".";
    detail::check_memory_budget(where(), need(o_.strategy), o_.memory_budget, advice);
  }

  /// Records the high-water mark of what gathered units and gradient
  /// buffers hold; called after each allocation, where the sum can only have grown.
  void track_transient() noexcept {
    std::size_t held = 0;
    for (const UnitState& s : units_) held += (s.full.capacity() + s.grad.capacity()) * sizeof(value_type);
    peak_transient_ = std::max(peak_transient_, held);
  }

  /// Frees the gradient buffers of finished reductions, oldest first,
  /// first waiting until at most `in_flight` are left running. A reduction
  /// that failed is freed too; drain() still rethrows its error.
  void retire_reductions(std::size_t in_flight) {
    std::size_t done = 0;
    for (; done < reducing_.size(); ++done) {
      UnitState& s = units_[reducing_[done]];
      if (reducing_.size() - done > in_flight) {
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
      std::vector<value_type>().swap(s.grad);
    }
    reducing_.erase(reducing_.begin(), reducing_.begin() + static_cast<std::ptrdiff_t>(done));
  }

  /// Elements this rank sends in a Ring `collective` of `count` elements on `c`.
  static std::size_t ring_sent(Collective collective, std::size_t count, const Comm& c) noexcept {
    return detail::ring_sent(collective, count, static_cast<std::size_t>(c.size()), static_cast<std::size_t>(c.rank()));
  }

  void settle_all() noexcept {
    for (UnitState& s : units_) detail::settle(s.request);
  }

  Comm& comm_;
  M model_;
  Opt opt_;
  ShardedTrainerOptions o_;
  std::vector<UnitSpec> specs_;
  std::vector<std::size_t> sizes_, chunks_, offsets_, buffer_offsets_;
  std::size_t total_ = 0;
  std::vector<value_type> shard_params_, shard_grads_, buffers_;
  std::vector<UnitState> units_;
  std::vector<ShardedTraceEvent> trace_;
  Provider provider_{*this};
  bool evaluating_ = false;
  static constexpr std::size_t no_unit = static_cast<std::size_t>(-1);
  /// FullShard's unit kept gathered after its forward (keep_last_forward_unit).
  std::size_t kept_ = no_unit;
  /// forward_backward() ran and optimizer_step() has not.
  bool pending_ = false;
  TrainerStats stats_{};
  /// HybridShard's groups; declared before worker_, which runs on the first.
  std::optional<Comm> shard_comm_, replica_comm_;
  std::shared_ptr<ProgressWorker<backend_type>> worker_;
  /// Units whose gradient buffer a reduction still holds, in submission order.
  std::vector<std::size_t> reducing_;
  std::size_t peak_transient_ = 0;
  /// This step's figures; the worker's jobs add their times to it.
  StepStats step_{};
};

}  // namespace gradsync

#pragma once
/// \file ReplicatedTrainer: data parallelism with a full replica per rank (PyTorch DDP semantics).

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
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
#include "gradsync/core/aligned_allocator.hpp"
#include "gradsync/core/backend_traits.hpp"
#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/trace_scope.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/train/common/agreed_settings.hpp"
#include "gradsync/train/common/bfloat16_copies.hpp"
#include "gradsync/train/common/compute_spans.hpp"
#include "gradsync/train/optim/clip_grad_norm.hpp"
#include "gradsync/train/ddp/grad_sync.hpp"
#include "gradsync/train/common/hash_bytes.hpp"
#include "gradsync/train/common/memory_need.hpp"
#include "gradsync/train/common/model.hpp"
#include "gradsync/train/common/on_nonfinite.hpp"
#include "gradsync/train/optim/optimizer.hpp"
#include "gradsync/train/common/step_labels.hpp"
#include "gradsync/train/common/step_stats.hpp"
#include "gradsync/train/common/trainer_base.hpp"
#include "gradsync/train/common/trainer_requirements.hpp"
#include "gradsync/train/common/trainer_stats.hpp"
#include "gradsync/train/common/unit_agreement.hpp"

namespace gradsync {

/// Options of ReplicatedTrainer.
struct ReplicatedTrainerOptions {
  /// Bucketing, compression, find_unused_parameters, overlap.
  GradSyncOptions sync{};
  /// Broadcast rank 0's buffers before every step, as DDP does by default,
  /// so state the forward updates (running statistics) cannot drift apart
  /// (under join, the lowest rank's with data: see join()).
  bool broadcast_buffers = true;
  /// Debug: every this many steps, hash every rank's parameters and throw
  /// if a replica differs. 0 turns it off. Buffers are left out: the forward
  /// may update them from local data, and they are re-broadcast each step.
  std::size_t check_replicas_every = 0;
  /// Uneven inputs: each step starts with a one-integer AllReduce counting
  /// the ranks that still have data, so a rank that ran out (and called
  /// join()) can keep matching the others' collectives with zeros.
  bool join = false;
  /// Bytes per rank this trainer may hold (see ReplicatedTrainer::memory_need);
  /// 0: no limit. A configuration that needs more is refused at
  /// construction, before anything is allocated or broadcast. Ranks given
  /// different values all throw at construction.
  std::size_t memory_budget = 0;
  /// A step whose averaged gradient or loss holds a NaN or an Inf: throw
  /// before the optimizer runs (the default), skip its update, or ignore it
  /// (see OnNonfinite). The gradient is checked as GradSync copies it out of
  /// each bucket (in-place buckets: read once more after their all-reduce);
  /// unless `ignore`, each step ends with one 16-byte all-reduce that agrees
  /// on the verdict (under `ignore`, an 8-byte one on the micro-batch
  /// count). Ranks given different values all throw at construction.
  OnNonfinite on_nonfinite = OnNonfinite::throw_error;
};

/// Trains `Model` with a full replica on every rank of `Comm`: each step
/// every rank runs forward and backward on its own batch, the gradients are
/// averaged across ranks in buckets that overlap backward, and every rank
/// takes the same optimizer step, so the replicas stay bit-identical.
///
/// The trainer owns the model (moved in) and its storage: one flat array of
/// parameters, one of gradients, one of buffers, each unit a contiguous
/// range of it; the model gets views of a unit when it asks (StepContext).
/// Construction checks that every rank declared the same units (names and
/// shapes, in order; otherwise every rank throws InvalidArgument naming the
/// first unit and rank that differ) and
/// broadcasts rank 0's parameters and buffers. N ranks with per-rank batch
/// b under a mean loss then train as one rank with batch N·b. The gradient
/// is the plain mean of the ranks' gradients, as in PyTorch DDP: ranks with
/// unequal batches (a last, shorter batch) weigh alike, not by batch size.
///
/// \tparam M     the model (see gradsync::Model).
/// \tparam Opt   an optimizer on flat spans of M::value_type (Sgd, Adam, AdamW, ...).
/// \tparam Comm  gradsync::Communicator<Backend>.
/// \tparam Algo  the AllReduce/Broadcast algorithm.
template <class M, class Opt, class Comm, class Algo = Auto>
class ReplicatedTrainer : public detail::TrainerBase<ReplicatedTrainer<M, Opt, Comm, Algo>, M, Opt, Comm, Algo> {
  using Base = detail::TrainerBase<ReplicatedTrainer, M, Opt, Comm, Algo>;

 public:
  using typename Base::backend_type, typename Base::value_type, typename Base::compute_type;

  ReplicatedTrainer(Comm& comm, M model, Opt optimizer, ReplicatedTrainerOptions options = {})
      : Base("ReplicatedTrainer", comm, std::move(model), std::move(optimizer)), o_(options), specs_(model_.units()) {
    this->agree(specs_, o_.memory_budget, settings());
    check_compute();
    detail::check_memory_budget(where(), memory_need(), o_.memory_budget,
                                "Every rank keeps the whole model: a ShardedTrainer keeps 1/N of it.");
    allocate();
    detail::write_initial_values(model_, std::span<const UnitView<value_type>>(views_));
    const Broadcast<Algo> broadcast{};
    broadcast(comm_, std::span<value_type>(params_), 0);
    if (!buffers_.empty()) broadcast(comm_, std::span<value_type>(buffers_), 0);
    std::vector<std::span<value_type>> grads;
    std::vector<std::string> names;
    for (std::size_t u = 0; u < views_.size(); ++u) {
      grads.push_back(views_[u].flat_grads);
      names.push_back(specs_[u].name);
    }
    sync_ = std::make_unique<GradSync<backend_type, value_type, Algo>>(detail::LabelOrdinal{this->ordinal_}, comm_,
                                                                       std::move(grads), o_.sync, names);
    // check_nonfinite() takes the least unit over ranks, so each rank need
    // read only its share of a bucket reduced in place.
    using Sync = GradSync<backend_type, value_type, Algo>;
    sync_->set_check_finite(o_.on_nonfinite != OnNonfinite::ignore, Sync::CheckScope::across_ranks);
    labels_.emplace("step", "unit", std::move(names), "optimizer lr");
    labels_->set_ordinal(this->ordinal_);
    // Every synced step all-reduces each bucket once.
    for (const BucketInfo& b : sync_->buckets()) {
      step_sent_ += detail::ring_sent(Collective::all_reduce, b.count, static_cast<std::size_t>(comm_.size()),
                                      static_cast<std::size_t>(comm_.rank()));
    }
  }
  ReplicatedTrainer(const ReplicatedTrainer&) = delete;
  ReplicatedTrainer& operator=(const ReplicatedTrainer&) = delete;

  /// The first half of step(): forward, backward with the gradients
  /// averaged across ranks as they become ready, without the optimizer step.
  /// Gradients accumulated by accumulate() since the last step are included,
  /// the sum scaled by 1/K for K backwards. Then clip_grad_norm() if you
  /// like, and optimizer_step(). Returns this rank's loss on `batch`.
  template <class Batch>
  double forward_backward(const Batch& batch) {
    static_assert(detail::TrainerRequirements<M, Opt>::template batch<Batch>());
    check_no_pending("forward_backward");
    // The step's figures count its micro-steps too.
    const TrainerStats before = micro_steps_ > 0 ? micro_before_ : stats_;
    int active = comm_.size(), root = 0;
    if (o_.join) {
      const ActiveRanks a = agree_active(true);
      active = a.count;
      root = a.root;
    }
    step_active_ = active;
    broadcast_buffers(root);
    sync_->set_sync(true);
    sync_->set_agreed_lr(static_cast<double>(opt_.lr()));
    sync_->set_averaging({.local_scale = 1.0 / static_cast<double>(micro_steps_ + 1),
                          .divisor = o_.join ? active : 0});
    // In a step where a rank has joined, the ranks with data may have
    // accumulated for other windows than it: the agreement leaves the count out.
    const std::size_t micro_batches = active < comm_.size() ? 1 : micro_steps_ + 1;
    double loss = 0;
    try {
      loss = run_model(batch);
      sync_grads();
    } catch (...) {
      abandon_step();
      throw;
    }
    check_finite(micro_batches);
    step_ = {};
    step_.compute_seconds = stats_.compute_seconds - before.compute_seconds;
    step_.reduce_seconds = stats_.comm_seconds - before.comm_seconds;
    step_.exposed_comm_seconds = stats_.exposed_comm_seconds - before.exposed_comm_seconds;
    step_.sent_elements = step_sent_;
    step_.sent_bytes = step_sent_ * (o_.sync.compression == Compression::bf16 ? sizeof(bfloat16) : sizeof(value_type));
    this->mark_pending();
    return loss;
  }

  /// Between forward_backward() and optimizer_step(): the norm of order p
  /// (infinity: the largest magnitude) of the averaged gradient, which every
  /// rank holds whole, so every rank computes the same value; if it exceeds
  /// max_norm, the gradient is scaled by max_norm / (norm + 1e-6), as
  /// PyTorch's clip_grad_norm_. Collective: one 8-byte all-reduce labelled
  /// with max_norm and p, so ranks that clip differently (or one that skips
  /// the call) fail here, naming both, instead of stepping apart.
  double clip_grad_norm(double max_norm, double p = 2.0) {
    detail::check_norm_order("ReplicatedTrainer", max_norm, p);
    this->check_pending("clip_grad_norm");
    if (step_active_ < comm_.size()) {
      // A joined rank steps with the others but cannot know to clip: the
      // replicas would part. Every active rank saw the same count.
      throw InvalidArgument(where() + ": clip_grad_norm in a step where " +
                            std::to_string(comm_.size() - step_active_) +
                            " rank(s) have joined (join()): they take the step without clipping, and their replicas "
                            "would differ; clip only while every rank has data");
    }
    const detail::TraceScope span(this->timeline(), detail::TraceKind::clip, stats_.steps + 1);
    double total = detail::norm_total(detail::norm_partial(std::span<const value_type>(grads_), p), p);
    if (comm_.size() > 1) {
      // Max of equal values changes nothing; the call is the agreement.
      AllReduce<Algo>{{.label = this->clip_label(max_norm, p)}}(
          comm_, std::span<double>(&total, 1), Max{});
    }
    detail::clip_to(std::span<value_type>(grads_), total, max_norm);
    return total;
  }

  /// The second half of step(): the optimizer step on the averaged
  /// gradient, which is then zeroed.
  void optimizer_step() {
    if (pending_ && step_active_ < comm_.size()) agree_joined_step_lr(true);
    this->begin_optimizer_step();
    apply_step();
  }

  /// Forward and backward on `batch` without communication: the gradient
  /// is accumulated locally and reduced by the next step(). K−1 calls of
  /// accumulate() and one step() equal one step on K times the samples
  /// with the loss scaled by 1/K. A micro-step (or step) that throws drops
  /// what was accumulated since the last step, its own part included.
  template <class Batch>
  double accumulate(const Batch& batch) {
    static_assert(detail::TrainerRequirements<M, Opt>::template batch<Batch>());
    check_no_pending("accumulate");
    if (micro_steps_ == 0) micro_before_ = stats_;
    sync_->set_sync(false);
    double loss = 0;
    try {
      loss = run_model(batch);
    } catch (...) {
      abandon_step();
      throw;
    }
    ++micro_steps_;
    return loss;
  }

  /// For uneven inputs (options.join): call once this rank has no more
  /// data. It keeps taking part in the other ranks' steps, contributing zero
  /// gradients and taking the same optimizer step at their learning rate
  /// (set before forward_backward() or, as every rank then agrees, before
  /// optimizer_step()), and returns when every rank has joined. The average
  /// of each step is over the ranks that had data in it. Buffers are
  /// broadcast from the lowest rank with data (rank 0 while it has any, as
  /// without join): a joined rank runs no forward, so its buffers fall
  /// behind; as join() returns, every rank takes those of the last step's
  /// lowest rank with data, and its learning rate as it stands then (a
  /// schedule sets the next epoch's after the step), as PyTorch's Join
  /// syncs the model from its last joiner. clip_grad_norm is refused in a
  /// step where a rank has joined (that rank cannot clip with the others).
  void join() {
    check_no_pending("join");
    if (!o_.join) {
      throw InvalidArgument("gradsync: ReplicatedTrainer::join on rank " + std::to_string(comm_.rank()) +
                            " needs ReplicatedTrainerOptions::join = true on every rank");
    }
    for (;;) {
      // What this rank accumulated but never stepped on is dropped (its
      // batch count is not the others'), also when every rank joins at
      // once: kept, it would go into the next epoch's first step.
      std::fill(grads_.begin(), grads_.end(), value_type(0));
      micro_steps_ = 0;
      this->forget_losses();
      const ActiveRanks a = agree_active(false);
      if (a.count == 0) {
        if (last_root_ >= 0) {
          opt_.set_lr(last_step_rate());
          broadcast_buffers(last_root_);
        }
        return;
      }
      step_active_ = a.count;
      opt_.set_lr(a.lr);
      broadcast_buffers(a.root);
      sync_->set_sync(true);
      sync_->set_agreed_lr(static_cast<double>(opt_.lr()));
      sync_->set_averaging({.local_scale = 1.0, .divisor = a.count});
      sync_->mark_all_ready();
      sync_grads();
      check_finite(1);
      agree_joined_step_lr(false);
      step_.skipped = false;
      apply_step();
    }
  }

  /// Runs `f(ctx)` with a StepContext for a forward without backward
  /// (evaluation): the model reaches its units as in a step, and ctx.ready
  /// throws. Returns what f returns.
  template <class F>
  decltype(auto) evaluate(F&& f) {
    round_parameters();
    const StepContext<compute_type> ctx(eval_provider_);
    return std::forward<F>(f)(ctx);
  }

  /// Hashes every rank's parameters and throws gradsync::Error
  /// naming the first rank whose replica differs from rank 0's. Collective:
  /// every rank must call it (the trainer does, every check_replicas_every
  /// steps), and every rank throws the same error.
  void check_replicas() {
    std::uint64_t h = detail::hash_bytes(params_.data(), params_.size() * sizeof(value_type), 0x6772616473796e63ull);
    const auto mine = std::bit_cast<std::int64_t>(h);
    std::vector<std::int64_t> all(static_cast<std::size_t>(comm_.size()));
    AllGather<Algo>{}(comm_, std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(all));
    for (std::size_t r = 1; r < all.size(); ++r) {
      if (all[r] != all[0]) {
        throw Error("gradsync: ReplicatedTrainer replica check after step " + std::to_string(stats_.steps) + ": rank " +
                    std::to_string(r) + "'s parameters differ from rank 0's (the first of " +
                    std::to_string(all.size()) +
                    " ranks to differ). Something changed one replica outside the trainer, or ranks ran different "
                    "code.");
      }
    }
  }

  GradSync<backend_type, value_type, Algo>& grad_sync() noexcept { return *sync_; }

  /// The flat storage, units in declaration order.
  std::span<value_type> parameters() noexcept { return params_; }
  std::span<value_type> gradients() noexcept { return grads_; }
  std::span<value_type> buffers() noexcept { return buffers_; }
  const std::vector<UnitSpec>& units() const noexcept { return specs_; }
  std::span<const UnitView<value_type>> unit_views() const noexcept { return views_; }

  /// Bytes this rank keeps between steps: parameters, gradients and the
  /// optimizer's state on them, (2 + S)·sizeof(T)·Ψ, S being the optimizer's
  /// state elements per parameter (`state_per_element()`: 0 for SGD, 1 with
  /// momentum, 2 for Adam and AdamW; 0 for an optimizer that does not say);
  /// for a model computing in bfloat16, 2·2·Ψ more (its parameters and
  /// gradients in bfloat16). GradSync's bucket staging and buffers are left
  /// out, as in ShardedTrainer::persistent_bytes.
  std::size_t persistent_bytes() const noexcept {
    return (2 + state_per_element()) * sizeof(value_type) * params_.size() +
           (bf16_params_.size() + bf16_grads_.size()) * sizeof(bfloat16);
  }

  const ReplicatedTrainerOptions& options() const noexcept { return o_; }

  /// No forward_backward() waits for its optimizer_step() and nothing is
  /// accumulated: the only moments a checkpoint can be taken or loaded,
  /// since gradients are not saved.
  bool between_steps() const noexcept { return !pending_ && micro_steps_ == 0; }

  /// What this rank needs: parameters, gradients and optimizer state on all
  /// Ψ elements, (2 + S)·sizeof(T)·Ψ, with a bfloat16 model's copies of the
  /// parameters and gradients (2·2·Ψ) counted in the first two
  /// (persistent_bytes()), and GradSync's
  /// bucket buffers, which exist only with bf16 compression (2 bytes per
  /// element), buckets otherwise being reduced in place in the gradients.
  MemoryNeed memory_need() const {
    std::size_t psi = 0;
    for (const UnitSpec& u : specs_)
      for (const TensorSpec& t : u.params) psi += t.count();
    MemoryNeed need;
    const std::size_t bf16_bytes = computes_bf16 ? sizeof(bfloat16) : 0;
    need.params = (sizeof(value_type) + bf16_bytes) * psi;
    need.grads = (sizeof(value_type) + bf16_bytes) * psi;
    need.optimizer_state = sizeof(value_type) * state_per_element() * psi;
    if (o_.sync.compression == Compression::bf16) need.gradient_buffers = sizeof(bfloat16) * psi;
    return need;
  }
  /// The transient bytes this rank really holds: GradSync's bucket buffers,
  /// allocated at construction and kept.
  std::size_t peak_transient_bytes() const noexcept { return sync_->buffer_bytes(); }

  /// last_step(), for this trainer: compute, the buckets' all-reduces
  /// (their time, the part backward did not hide) and the elements sent as
  /// Ring sends them (see StepStats); no gathers.
  void reset_stats() {
    const std::size_t steps = stats_.steps;
    stats_ = {};
    stats_.steps = steps;
    sync_->reset_stats();
    // Micro-steps taken before the reset count from it, like the totals.
    micro_before_ = stats_;
  }

 private:
  using Base::comm_, Base::model_, Base::opt_, Base::stats_, Base::step_, Base::pending_, Base::micro_steps_,
      Base::labels_, Base::where, Base::check_no_pending;

  std::size_t state_per_element() const noexcept { return detail::optimizer_state_per_element(opt_); }

  /// The model computes in bfloat16 (compute_type): it sees a bfloat16
  /// copy of the parameters, rounded from the master before each step, and
  /// writes bfloat16 gradients, which each unit's ready adds into the
  /// value_type gradient that GradSync averages and the optimizer steps on.
  static constexpr bool computes_bf16 = !std::is_same_v<compute_type, value_type>;

  /// A model computing in bfloat16 has no buffers, refused before anything is allocated.
  void check_compute() const {
    if constexpr (computes_bf16) {
      detail::refuse_buffers_of_bf16_model(where(), specs_, data_type_v<value_type>);
    }
  }

  /// The model's views in a step: the value_type storage itself, or its bfloat16 copy.
  const std::vector<UnitView<compute_type>>& compute_views() const noexcept {
    if constexpr (computes_bf16) {
      return bf16_views_;
    } else {
      return views_;
    }
  }

  /// A bfloat16 model: its copy of the parameters, rounded from the master
  /// (which the optimizer, a checkpoint's load or the user may have changed).
  void round_parameters() {
    if constexpr (computes_bf16) {
      detail::round_into(std::span<const value_type>(params_), std::span<bfloat16>(bf16_params_));
    }
  }

  /// A bfloat16 model's unit u is ready: its gradient is added into the
  /// value_type one (run_model zeroes the bfloat16 ones before each backward).
  void fold_bf16_grad(std::size_t u) {
    if constexpr (computes_bf16) {
      detail::add_widened(views_[u].flat_grads, std::span<const bfloat16>(bf16_views_[u].flat_grads));
    }
  }

  void allocate() {
    std::size_t np = 0, nb = 0;
    for (const UnitSpec& u : specs_) {
      for (const TensorSpec& t : u.params) np += t.count();
      for (const TensorSpec& t : u.buffers) nb += t.count();
    }
    params_.assign(np, value_type(0));
    grads_.assign(np, value_type(0));
    buffers_.assign(nb, value_type(0));
    std::size_t p = 0, b = 0;
    views_.resize(specs_.size());
    ready_in_backward_.assign(specs_.size(), 0);
    for (std::size_t i = 0; i < specs_.size(); ++i) {
      UnitView<value_type>& v = views_[i];
      const std::size_t p0 = p, b0 = b;
      for (const TensorSpec& t : specs_[i].params) {
        v.params.push_back({std::span<value_type>(params_).subspan(p, t.count()),
                            std::span<value_type>(grads_).subspan(p, t.count()), &t});
        p += t.count();
      }
      for (const TensorSpec& t : specs_[i].buffers) {
        v.buffers.push_back({std::span<value_type>(buffers_).subspan(b, t.count()), {}, &t});
        b += t.count();
      }
      v.flat_params = std::span<value_type>(params_).subspan(p0, p - p0);
      v.flat_grads = std::span<value_type>(grads_).subspan(p0, p - p0);
      v.flat_buffers = std::span<value_type>(buffers_).subspan(b0, b - b0);
    }
    if constexpr (computes_bf16) {
      // The same layout over the bfloat16 copies (a bfloat16 model has no buffers).
      bf16_params_.assign(np, bfloat16(0.0f));
      bf16_grads_.assign(np, bfloat16(0.0f));
      bf16_views_.resize(specs_.size());
      p = 0;
      for (std::size_t i = 0; i < specs_.size(); ++i) {
        UnitView<bfloat16>& v = bf16_views_[i];
        const std::size_t p0 = p;
        for (const TensorSpec& t : specs_[i].params) {
          v.params.push_back({std::span<bfloat16>(bf16_params_).subspan(p, t.count()),
                              std::span<bfloat16>(bf16_grads_).subspan(p, t.count()), &t});
          p += t.count();
        }
        v.flat_params = std::span<bfloat16>(bf16_params_).subspan(p0, p - p0);
        v.flat_grads = std::span<bfloat16>(bf16_grads_).subspan(p0, p - p0);
      }
    }
  }

  /// After a forward or backward that threw: the gradients accumulated
  /// since the last step are dropped, and the losses noted for them, as
  /// ShardedTrainer drops them; a backward that threw part-way left some
  /// of its gradient there, which the next step would otherwise average in.
  void abandon_step() noexcept {
    sync_->abandon();
    std::ranges::fill(grads_, value_type(0));
    micro_steps_ = 0;
    this->forget_losses();
  }

  template <class Batch>
  double run_model(const Batch& batch) {
    this->mark_step_begin();
    const auto t0 = std::chrono::steady_clock::now();
    if constexpr (computes_bf16) {
      round_parameters();
      // A backward that threw part-way may have left gradients here.
      std::ranges::fill(bf16_grads_, bfloat16(0.0f));
    }
    std::ranges::fill(ready_in_backward_, 0);
    const StepContext<compute_type> ctx(provider_);
    spans_.begin(this->timeline(), views_.size());
    struct End {
      detail::ComputeSpans& spans;
      ~End() { spans.end(); }
    } end{spans_};
    const double loss = static_cast<double>(model_.forward_backward(batch, ctx));
    this->note_loss(loss);
    stats_.compute_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return loss;
  }

  /// What every rank must have been given alike besides its units, the
  /// model's types and the optimizer (TrainerBase::agree adds those).
  std::vector<detail::AgreedValue> settings() const {
    const std::string same = "Give every rank the same ReplicatedTrainerOptions.";
    std::vector<detail::AgreedValue> v{
        detail::flag("ReplicatedTrainerOptions::broadcast_buffers", o_.broadcast_buffers, same),
        detail::setting("ReplicatedTrainerOptions::check_replicas_every", o_.check_replicas_every, same),
        detail::flag("ReplicatedTrainerOptions::join", o_.join, same),
        {"ReplicatedTrainerOptions::on_nonfinite", name(o_.on_nonfinite), same},
    };
    return v;
  }

  /// `root`'s buffers to every rank, labelled with the step and the
  /// learning rate the step will use: the step's first collective.
  void broadcast_buffers(int root) {
    if (!o_.broadcast_buffers || buffers_.empty()) return;
    Broadcast<Algo>{this->labelled({}, detail::LabelPhase::buffers, 0)}(comm_, std::span<value_type>(buffers_), root);
  }

  void sync_grads() {
    const double wait0 = sync_->stats().wait_seconds;
    sync_->finish();
    stats_.exposed_comm_seconds += sync_->stats().wait_seconds - wait0;
    stats_.comm_seconds = sync_->stats().comm_seconds;
    micro_steps_ = 0;
  }

  void apply_step() {
    this->step_optimizer(std::span<value_type>(params_), std::span<value_type>(grads_));
    if (o_.check_replicas_every && stats_.steps % o_.check_replicas_every == 0) check_replicas();
  }

  /// The step's averaged gradient and losses, checked (OnNonfinite), over
  /// `micro_batches` (its accumulate() calls and its own), which no
  /// collective of the micro-steps tells apart: they only add locally.
  void check_finite(std::size_t micro_batches) {
    this->check_nonfinite(
        o_.on_nonfinite, sync_->first_nonfinite_unit(), {},
        [this](std::size_t u) { return "unit " + std::to_string(u) + " ('" + specs_[u].name + "')"; },
        std::span<value_type>(grads_), micro_batches);
  }

  /// The ranks with data in a step (options.join): how many, the lowest of
  /// them, whose buffers the step broadcasts, and its learning rate, which
  /// a joined rank takes. Ranks with data that differ in rate fail in the
  /// step's labelled collectives.
  struct ActiveRanks {
    int count = 0;
    int root = 0;
    double lr = 0;
  };
  ActiveRanks agree_active(bool mine) {
    const double me[2] = {mine ? 1.0 : 0.0, static_cast<double>(opt_.lr())};
    active_.resize(2 * static_cast<std::size_t>(comm_.size()));
    AllGather<Algo>{}(comm_, std::span<const double>(me), std::span<double>(active_));
    ActiveRanks a;
    for (int r = comm_.size() - 1; r >= 0; --r) {
      if (active_[2 * static_cast<std::size_t>(r)] == 0) continue;
      ++a.count;
      a.root = r;
      a.lr = active_[2 * static_cast<std::size_t>(r) + 1];
    }
    if (a.count > 0) {
      last_root_ = a.root;
      last_active_.resize(static_cast<std::size_t>(comm_.size()));
      for (std::size_t r = 0; r < last_active_.size(); ++r) last_active_[r] = active_[2 * r] != 0;
    }
    return a;
  }

  /// As every rank has joined (agree_active() found none with data): the
  /// rate the ranks that had data in the last step hold now, which a
  /// schedule set after that step for the next epoch; every rank takes it.
  /// Those ranks holding different ones throw InvalidArgument, every rank
  /// alike (all read the same all-gather).
  double last_step_rate() const {
    std::size_t lo = last_active_.size(), hi = lo;
    for (std::size_t r = 0; r < last_active_.size(); ++r) {
      if (!last_active_[r]) continue;
      if (lo == last_active_.size() || active_[2 * r + 1] < active_[2 * lo + 1]) lo = r;
      if (hi == last_active_.size() || active_[2 * r + 1] > active_[2 * hi + 1]) hi = r;
    }
    if (active_[2 * lo + 1] != active_[2 * hi + 1]) {
      throw InvalidArgument(where() + ": as join() returns, the ranks that took the last step hold different "
                            "learning rates: " + detail::shortest(active_[2 * lo + 1]) + " on rank " +
                            std::to_string(lo) + ", " + detail::shortest(active_[2 * hi + 1]) + " on rank " +
                            std::to_string(hi) + "; set the same rate on every rank");
    }
    return active_[2 * lo + 1];
  }

  /// In a step where some rank has joined: every rank's part of one 16-byte
  /// all-reduce under Max, the ranks with data giving {lr, −lr} and the
  /// joined ones −∞, so that a rate set between forward_backward() and
  /// optimizer_step() reaches the joined ranks (who take it) and ranks
  /// with data that set different ones all throw. It takes the place of
  /// the agreement on a changed rate, which the joined ranks cannot make.
  void agree_joined_step_lr(bool has_data) {
    constexpr double none = -std::numeric_limits<double>::infinity();
    const double lr = static_cast<double>(opt_.lr());
    double v[2] = {has_data ? lr : none, has_data ? -lr : none};
    // Labelled with the step but no rate: the joined ranks do not know it yet.
    const Options agreement{.label = labels_->label(detail::LabelPhase::lr_changed, 1, stats_.steps + 1, 0)};
    AllReduce<Algo>{agreement}(comm_, std::span<double>(v), Max{});
    if (v[0] != -v[1]) {
      throw InvalidArgument(where() + ": in step " + std::to_string(stats_.steps + 1) + ", where " +
                            std::to_string(comm_.size() - step_active_) +
                            " rank(s) have joined, the ranks with data set different learning rates after "
                            "forward_backward(), between " + detail::shortest(-v[1]) + " and " +
                            detail::shortest(v[0]) + "; set the same rate on every rank");
    }
    if (!has_data) opt_.set_lr(v[0]);
    // The rate is agreed: begin_optimizer_step() need not agree on it again.
    this->pending_lr_bits_ = detail::bits_of(static_cast<double>(opt_.lr()));
  }

  /// Lends the model its own storage: every unit is resident, so asking
  /// for it costs a virtual call and releasing it nothing.
  class Provider final : public detail::UnitProvider<compute_type> {
   public:
    explicit Provider(ReplicatedTrainer& t, bool evaluating = false) : t_(t), evaluating_(evaluating) {}
    const UnitView<compute_type>& acquire(std::size_t u) override {
      t_.spans_.switch_to(u);
      if (u >= t_.views_.size()) {
        throw InvalidArgument("gradsync: ReplicatedTrainer on rank " + std::to_string(t_.comm_.rank()) +
                              ": the model asked for unit " + std::to_string(u) + ", which does not exist (" +
                              std::to_string(t_.views_.size()) + " units)");
      }
      return t_.compute_views()[u];
    }
    void release(std::size_t) noexcept override {}
    void ready(std::size_t u) override {
      if (evaluating_) {
        throw InvalidArgument("gradsync: ReplicatedTrainer::evaluate on rank " + std::to_string(t_.comm_.rank()) +
                              ": the model reported unit " + std::to_string(u) +
                              " ready, but evaluation runs no backward");
      }
      if (u < t_.views_.size()) {
        // GradSync catches a second ready() in a synced backward, but not
        // under accumulate(), where it does not follow readiness; a bfloat16
        // gradient folded twice would count twice.
        if (t_.ready_in_backward_[u]) {
          throw InvalidArgument("gradsync: ReplicatedTrainer on rank " + std::to_string(t_.comm_.rank()) +
                                ": the model reported unit " + std::to_string(u) + " ('" + t_.specs_[u].name +
                                "') ready twice in one backward");
        }
        t_.ready_in_backward_[u] = 1;
        t_.fold_bf16_grad(u);
      }
      t_.sync_->ready(u);
    }

    ReplicatedTrainer& t_;
    bool evaluating_ = false;
  };

  ReplicatedTrainerOptions o_;
  Provider provider_{*this};
  Provider eval_provider_{*this, true};
  std::vector<UnitSpec> specs_;
  /// Units the model reported ready in the current backward.
  std::vector<unsigned char> ready_in_backward_;
  // Aligned alike in every process, so a model's vectorized math sums in
  // the same order wherever the heap put them (see AlignedAllocator).
  std::vector<value_type, detail::AlignedAllocator<value_type>> params_, grads_, buffers_;
  std::vector<UnitView<value_type>> views_;
  /// A model computing in bfloat16: the copies its steps see (else empty).
  std::vector<bfloat16> bf16_params_, bf16_grads_;
  std::vector<UnitView<compute_type>> bf16_views_;
  std::unique_ptr<GradSync<backend_type, value_type, Algo>> sync_;
  /// The model's compute per unit on the timeline, switched at its asks to provider_.
  detail::ComputeSpans spans_;
  /// Elements this rank sends per synced step (the bucket plan's all-reduces under Ring).
  std::size_t step_sent_ = 0;
  /// Ranks with data in the current step (join: counted at forward_backward
  /// and in join()).
  int step_active_ = 0;
  /// join: every rank's {has data, lr} of the current step (agree_active),
  /// and the lowest rank with data in the last step that had any (-1: none yet).
  std::vector<double> active_;
  int last_root_ = -1;
  /// join: which ranks had data in the last step that any had.
  std::vector<unsigned char> last_active_;
  /// The figures when the current step's first micro-step began.
  TrainerStats micro_before_{};
};

}  // namespace gradsync

#pragma once
/// \file TrainerBase: what ReplicatedTrainer and ShardedTrainer share above
/// their storage, written once: the model, optimizer and communicator they
/// own or use, the step count and timings, the forward_backward() /
/// optimizer_step() pairing, the construction-time agreement and the labels
/// that carry the step and learning rate on every collective.

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/trace_recorder.hpp"
#include "gradsync/core/trace_scope.hpp"
#include "gradsync/train/common/agreed_settings.hpp"
#include "gradsync/train/common/communicates_host_memory.hpp"
#include "gradsync/train/common/model.hpp"
#include "gradsync/train/common/nonfinite_verdict.hpp"
#include "gradsync/train/common/on_nonfinite.hpp"
#include "gradsync/train/common/step_labels.hpp"
#include "gradsync/train/common/step_stats.hpp"
#include "gradsync/train/common/trainer_requirements.hpp"
#include "gradsync/train/common/trainer_stats.hpp"
#include "gradsync/train/common/unit_agreement.hpp"

namespace gradsync::detail {

/// The types a trainer names, its accessors, its step bookkeeping and
/// step(), which is forward_backward() then optimizer_step() in both
/// trainers. CRTP: `Derived` provides those two.
///
/// \tparam Derived  ReplicatedTrainer or ShardedTrainer.
/// \tparam M        the model (see gradsync::Model).
/// \tparam Opt      an optimizer on flat spans of M::value_type.
/// \tparam Comm     gradsync::Communicator<Backend>.
/// \tparam Algo     the algorithm of the trainer's collectives.
template <class Derived, class M, class Opt, class Comm, class Algo>
class TrainerBase {
  static_assert(TrainerRequirements<M, Opt>::template communicator<Comm>());
  static_assert(TrainerRequirements<M, Opt>::model_and_optimizer());
  static_assert(communicates_host_memory<Comm>,
                "gradsync::ReplicatedTrainer and gradsync::ShardedTrainer need a backend whose memory space is host "
                "memory: they keep parameters, gradients, shards and buffers in host vectors and step the optimizer "
                "on the host, which cannot work on device pointers. On a device-memory backend (Nccl), train with "
                "your own device buffers and the primitives (AllReduce, Broadcast).");

 public:
  using model_type = M;
  using optimizer_type = Opt;
  using communicator_type = Comm;
  using backend_type = typename CommunicatorTraits<Comm>::backend;
  using value_type = typename M::value_type;
  using algorithm = Algo;
  /// The element type of the views the model sees in a step: its
  /// compute_type, value_type unless it declares bfloat16.
  using compute_type = compute_t<M>;

  /// One training step on this rank's batch: forward_backward(batch), then
  /// optimizer_step() (see each for what the trainer does in it). Returns
  /// this rank's loss on `batch`.
  template <class Batch>
  double step(const Batch& batch) {
    static_assert(TrainerRequirements<M, Opt>::template batch<Batch>());
    Derived& self = static_cast<Derived&>(*this);
    const double loss = self.forward_backward(batch);
    self.optimizer_step();
    return loss;
  }

  M& model() noexcept { return model_; }
  const M& model() const noexcept { return model_; }
  Opt& optimizer() noexcept { return opt_; }
  Comm& communicator() noexcept { return comm_; }

  /// The last step (forward_backward() or its micro-steps, and
  /// optimizer_step()): time per phase and what was sent (see StepStats).
  const StepStats& last_step() const noexcept { return step_; }
  const TrainerStats& stats() const noexcept { return stats_; }

  /// Optimizer steps taken (what a checkpoint saves as `trainer.step`).
  std::size_t step_count() const noexcept { return stats_.steps; }
  /// Sets the step count; for loading a checkpoint.
  void set_step_count(std::size_t steps) noexcept { stats_.steps = steps; }

  /// The first call of a checkpoint's save (save_checkpoint,
  /// AsyncCheckpointer::save), collective: one 16-byte all-reduce over all
  /// ranks labelled with this rank's step count and learning rate. The
  /// checkpoint records rank 0's, so ranks that differ in either (which
  /// their next step would refuse) fail here, naming both, instead of
  /// leaving a checkpoint whose load would make them agree unseen. Under
  /// HybridShard it also meets, on the world, a peer that steps instead.
  /// `alike`: a hash of what else the checkpoint records once (the
  /// sampler's state), or none where this rank has nothing to compare;
  /// returns whether the ranks that passed one passed the same.
  [[nodiscard]] bool agree_to_save(std::optional<std::uint64_t> alike = std::nullopt) {
    // The maximum of h and of −h over the ranks that pass one: both are one
    // rank's exactly when those agree. h keeps 63 bits, so that −h is an
    // int64 and above the lowest, which a rank without one contributes.
    constexpr std::int64_t none = std::numeric_limits<std::int64_t>::min();
    const auto h = alike ? static_cast<std::int64_t>(*alike >> 1) : none;
    std::array<std::int64_t, 2> both{h, alike ? -h : none};
    const auto save = static_cast<std::size_t>(TrainerEntry::checkpoint_save);
    const Options opts = labelled(Options{}, LabelPhase::entry, save);
    AllReduce<Algo>{opts}(comm_, std::span<std::int64_t>(both), Max{});
    return both[0] == none || both[0] == -both[1];
  }

 protected:
  /// `name`: the trainer's, as messages and the agreement say it ("ShardedTrainer").
  TrainerBase(std::string_view name, Comm& comm, M model, Opt optimizer)
      : name_(name),
        comm_(comm),
        model_(std::move(model)),
        opt_(std::move(optimizer)),
        ordinal_(TrainerOrdinalAccess::next(comm)) {}
  /// The trainer's end writes the rank's timeline, its labels in words.
  ~TrainerBase() {
    if (TraceRecorder* t = timeline()) {
      if (labels_) t->forget_names(&*labels_);
      t->flush();
    }
  }

  /// The rank's timeline; null when it records none.
  TraceRecorder* timeline() const noexcept { return trace_recorder(comm_); }
  /// A step's model call starts: the first of its micro-steps starts the
  /// step's span on the timeline, which optimizer_step() ends.
  void mark_step_begin() {
    TraceRecorder* t = timeline();
    if (!t || micro_steps_ != 0) return;
    if (labels_) t->keep_names(&*labels_);
    step_began_ns_ = TraceRecorder::now_ns();
  }

  /// "gradsync: ShardedTrainer on rank 3", the start of every message.
  std::string where() const {
    return "gradsync: " + std::string(name_) + " on rank " + std::to_string(comm_.rank());
  }

  /// Checks that every rank declared the same `units` and was given the
  /// same `options` (the trainer's own settings), the same model types and
  /// an optimizer alike; every rank throws the same error otherwise.
  void agree(const std::vector<UnitSpec>& units, std::uint64_t memory_budget, std::vector<AgreedValue> options) {
    const std::string same_model = "Build every rank with the same model type.";
    options.push_back({"the model's value_type", std::string(type_name<value_type>()), same_model});
    options.push_back({"the model's compute_type", std::string(type_name<compute_type>()), same_model});
    add_optimizer_settings<value_type>(options, opt_);
    check_trainer_units(comm_, units, name_, memory_budget, options);
  }

  /// `what` (accumulate, forward_backward, ...) may not start while a
  /// forward_backward() waits for its optimizer_step().
  void check_no_pending(const char* what) const {
    if (pending_) {
      throw InvalidArgument(where() + ": " + what +
                            " after a forward_backward() whose optimizer_step() has not run yet");
    }
  }

  /// `what` needs the reduced gradient of a forward_backward().
  void check_pending(const char* what) const {
    if (!pending_) {
      throw InvalidArgument(where() + ": " + what +
                            " needs the reduced gradient: call it between forward_backward() and optimizer_step()");
    }
  }

  /// forward_backward() has reduced the step's gradient, labelled with the
  /// learning rate it had then: optimizer_step() may follow.
  void mark_pending() noexcept {
    pending_ = true;
    pending_lr_bits_ = bits_of(static_cast<double>(opt_.lr()));
  }

  /// optimizer_step() ends the forward_backward() before it, which it needs.
  /// The step's collectives carried forward_backward()'s learning rate, so a
  /// rate set since (a scheduler run after backward) went unchecked: a rank
  /// that set it alone would step apart from the others, and nothing after
  /// (a save, the end of training) need notice. Such a rank agrees on the new
  /// rate with one 8-byte AllReduce on the world, labelled with it, before
  /// its optimizer runs: where every rank set the same rate they agree and
  /// step; where some did not, the call meets their next collective (and
  /// all fail, naming both calls) or their leaving (this rank fails, and
  /// with it the run), and no rank steps at a rate the others did not.
  /// Where the others' next calls are in groups of the world (HybridShard),
  /// no agreement on the world could meet them: the caller passes
  /// `agree_on_world` false and a changed rate is refused instead, every
  /// communicator of this rank failed with the words (`fail`).
  template <class Fail>
  void begin_optimizer_step(bool agree_on_world, Fail&& fail) {
    if (!pending_) throw InvalidArgument(where() + ": optimizer_step without a forward_backward() before it");
    const double lr = static_cast<double>(opt_.lr());
    if (bits_of(lr) != pending_lr_bits_ && comm_.size() > 1) {
      if (!agree_on_world) {
        const std::string what = where() + ": the learning rate was set to " + shortest(lr) +
                                 " after forward_backward(), whose collectives carried " +
                                 shortest(double_of(pending_lr_bits_)) +
                                 "; under HybridShard the other ranks' next calls are in their groups, where no "
                                 "agreement on the new rate can meet them. Set the rate before forward_backward()";
        fail(what);
        throw InvalidArgument(what);
      }
      double agreed = lr;
      AllReduce<Algo>{labelled(Options{}, LabelPhase::lr_changed, 0)}(comm_, std::span<double>(&agreed, 1), Max{});
    }
    pending_ = false;
  }
  void begin_optimizer_step() {
    begin_optimizer_step(true, [](const std::string&) {});
  }

  /// The optimizer's step on `params` with `grads`, which are then zeroed,
  /// timed and counted; what both trainers' optimizer_step() do at heart.
  /// A step check_nonfinite() marked skipped only drops `grads` and counts.
  void step_optimizer(std::span<value_type> params, std::span<value_type> grads) {
    struct StepSpan {
      TrainerBase& t;
      ~StepSpan() {
        TraceRecorder* r = t.timeline();
        if (r && t.step_began_ns_) r->phase(TraceKind::step, t.stats_.steps, t.step_began_ns_, TraceRecorder::now_ns());
        t.step_began_ns_ = 0;
      }
    } step_span{*this};
    if (skip_) {
      skip_ = false;
      std::ranges::fill(grads, value_type(0));
      step_.skipped = true;
      ++stats_.skipped_steps;
      ++stats_.steps;
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    {
      const TraceScope span(timeline(), TraceKind::optimizer, stats_.steps + 1);
      opt_.step(params, std::span<const value_type>(grads));
      std::ranges::fill(grads, value_type(0));
    }
    step_.optimizer_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats_.optimizer_seconds += step_.optimizer_seconds;
    ++stats_.steps;
  }

  /// A forward_backward() or micro-step returned `loss`: check_nonfinite() reports a NaN or Inf.
  void note_loss(double loss) noexcept {
    if (!std::isfinite(loss)) loss_nonfinite_ = true;
  }
  /// The gradient of the losses noted so far was dropped (a rank that
  /// joined, a step that threw): they must not fail the next step.
  void forget_losses() noexcept { loss_nonfinite_ = false; }

  /// After the step's reduction, unless OnNonfinite::ignore: agrees with
  /// every rank (one 16-byte AllReduce on the world, carrying `base`
  /// labelled for the step) on whether the step went non-finite, given this
  /// rank's first unit whose reduced gradient is (`unit`) and the losses
  /// note_loss() saw. Then under throw_error every rank zeroes `grads` (the
  /// step's gradient, before the optimizer saw it) and throws Error naming
  /// the step and `unit_name(u)` or the rank; under skip_step the coming
  /// step_optimizer() only drops the gradient. The label also carries
  /// `micro_batches`, the step's accumulate() calls and its own: ranks that
  /// accumulated a different number (where no collective of theirs told
  /// them apart: ReplicatedTrainer, NoSync) would average their micro-
  /// batches with different weights, so they fail here, naming both.
  /// Where micro-steps do communicate, their collectives carry the step's
  /// labels, so a rank's extra micro-step matches its peers' step and goes
  /// unseen until this agreement. Under ignore the count alone is agreed,
  /// by one 8-byte all-reduce.
  template <class Name>
  void check_nonfinite(OnNonfinite policy, std::optional<std::size_t> unit, Options base, Name&& unit_name,
                       std::span<value_type> grads, std::size_t micro_batches) {
    const bool loss_finite = !loss_nonfinite_;
    loss_nonfinite_ = false;
    if (policy == OnNonfinite::ignore) {
      if (comm_.size() > 1) {
        // Max of zeros changes nothing; the call, and its label, is the agreement.
        double none = 0;
        AllReduce<Algo>{labelled(std::move(base), LabelPhase::micro_batches, micro_batches)}(
            comm_, std::span<double>(&none, 1), Max{});
      }
      return;
    }
    const auto verdict =
        NonfiniteVerdict::agree<Algo>(comm_, labelled(std::move(base), LabelPhase::nonfinite, micro_batches), unit,
                                      loss_finite);
    if (verdict.finite()) return;
    if (policy == OnNonfinite::skip_step) {
      skip_ = true;
      return;
    }
    std::ranges::fill(grads, value_type(0));
    throw Error(where() + ": step " + std::to_string(stats_.steps + 1) + " went non-finite: " +
                verdict.describe(unit_name) +
                ". The optimizer did not run: parameters and optimizer state are as before the step, whose "
                "gradient was dropped. Look for a learning rate too high or a bad batch, or set on_nonfinite = "
                "OnNonfinite::skip_step to skip such steps.");
  }

  /// `base` labelled with what the call moves in the coming step and with
  /// the learning rate that step will use: ranks that differ in either
  /// fail in the call, naming both.
  Options labelled(Options base, LabelPhase phase, std::size_t index) const {
    base.label = labels_->label(phase, index, stats_.steps + 1, bits_of(static_cast<double>(opt_.lr())));
    return base;
  }
  /// clip_grad_norm's label: the coming step, max_norm and p.
  CallLabel clip_label(double max_norm, double p) const { return labels_->clip_label(stats_.steps + 1, max_norm, p); }

  std::string_view name_;
  Comm& comm_;
  M model_;
  Opt opt_;
  TrainerStats stats_{};
  /// This step's figures; a sharded trainer's worker jobs add their times to it.
  StepStats step_{};
  /// forward_backward() ran and optimizer_step() has not.
  bool pending_ = false;
  /// The learning rate's bits when forward_backward() ended (mark_pending).
  std::uint64_t pending_lr_bits_ = 0;
  /// accumulate() calls since the last step.
  std::size_t micro_steps_ = 0;
  /// A loss since the last check_nonfinite() was NaN or Inf.
  bool loss_nonfinite_ = false;
  /// check_nonfinite() found the step non-finite under OnNonfinite::skip_step.
  bool skip_ = false;
  /// What each collective moves; made once the units or buckets are known.
  std::optional<StepLabels> labels_;
  /// Which trainer of comm_ this is, in the order every rank made them: its
  /// labels carry it (StepLabels::set_ordinal), so ranks that step two
  /// trainers in another order fail at the first call.
  std::uint32_t ordinal_;
  /// When this step's first model call started, on the timeline; 0: none.
  std::int64_t step_began_ns_ = 0;
};

}  // namespace gradsync::detail

#pragma once
/// \file detail::ComputeSpans: a trainer's forward and backward per unit on
/// the rank's timeline, as the time between the model's calls into the trainer.
///
/// The model computes between its asks, releases and readies, and the
/// trainer has control only at those calls. So the time from one call's
/// return to the next call is compute, put down to the unit asked for
/// last: forward at its first ask in the step, backward at its second.
/// What the trainer does inside a call (waiting for a gather, launching a
/// bucket) is left out, so a gap in the compute track is the rank's
/// thread not computing. Spans never overlap, whichever units the model holds at once.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gradsync/core/trace_recorder.hpp"

namespace gradsync::detail {

/// The compute spans of one step's model call; every member does nothing
/// without a timeline.
class ComputeSpans {
 public:
  static constexpr std::size_t no_unit = static_cast<std::size_t>(-1);

  /// The model's forward_backward starts, with `trace` (null: no timeline)
  /// and `units` model units.
  void begin(TraceRecorder* trace, std::size_t units) {
    trace_ = trace;
    if (!trace_) return;
    asks_.assign(units, 0);
    unit_ = no_unit;
    open_ = 0;
  }
  /// The model calls into the trainer: the open span ends here.
  void enter() noexcept {
    if (!trace_ || !open_) return;
    trace_->phase(kind_, unit_, open_, TraceRecorder::now_ns());
    open_ = 0;
  }
  /// An ask for model unit `u` returns: compute on it starts.
  void asked(std::size_t u) noexcept {
    if (!trace_ || u >= asks_.size()) return;
    unit_ = u;
    kind_ = asks_[u] ? TraceKind::backward : TraceKind::forward;
    asks_[u] = 1;
    open_ = TraceRecorder::now_ns();
  }
  /// A release or ready returns: compute goes on, on the unit asked last.
  void resume() noexcept {
    if (!trace_ || unit_ == no_unit) return;
    open_ = TraceRecorder::now_ns();
  }
  /// One call of the model into the trainer, from its start to its return
  /// (or throw): an ask of `asked` model unit, else a release or a ready.
  class Call {
   public:
    Call(ComputeSpans& spans, std::size_t asked) noexcept : spans_(spans), asked_(asked) { spans_.enter(); }
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;
    ~Call() {
      if (asked_ == no_unit) {
        spans_.resume();
      } else {
        spans_.asked(asked_);
      }
    }

   private:
    ComputeSpans& spans_;
    std::size_t asked_;
  };

  /// The model's forward_backward returned (or threw).
  void end() noexcept {
    enter();
    trace_ = nullptr;
  }

 private:
  TraceRecorder* trace_ = nullptr;
  std::vector<std::uint8_t> asks_;
  std::size_t unit_ = no_unit;
  std::int64_t open_ = 0;
  TraceKind kind_ = TraceKind::forward;
};

}  // namespace gradsync::detail

#pragma once
/// \file detail::ComputeSpans: a trainer's forward and backward per unit on
/// the rank's timeline: the model's call, less the trainer's waits for collectives.
///
/// The trainer has control only when the model calls into it, so a unit's
/// compute runs from the model's ask for it to its next ask of any unit:
/// forward at a unit's first ask in the step, backward at its second. The
/// trainer's waits for a collective (a gather the ask needs, a reduction
/// whose buffer it needs back) are left out, as StepStats leaves them out
/// of compute_seconds, so a gap in the compute track is exposed
/// communication. Spans never overlap, whichever units the model holds at once.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gradsync/core/trace_recorder.hpp"

namespace gradsync::detail {

/// The compute spans of one step's model call; every member does nothing
/// without a timeline.
class ComputeSpans {
 public:
  /// The model's forward_backward starts, with `trace` (null: no timeline)
  /// and `units` model units.
  void begin(TraceRecorder* trace, std::size_t units) {
    trace_ = trace;
    if (!trace_) return;
    asks_.assign(units, 0);
    unit_ = no_unit;
    open_ = 0;
  }
  /// The model asks for model unit `u`: the open span ends and u's starts.
  void switch_to(std::size_t u) noexcept {
    if (!trace_ || u >= asks_.size()) return;
    close();
    unit_ = u;
    kind_ = asks_[u] ? TraceKind::backward : TraceKind::forward;
    asks_[u] = 1;
    open_ = TraceRecorder::now_ns();
  }
  /// The model's forward_backward returned (or threw).
  void end() noexcept {
    close();
    trace_ = nullptr;
  }

  /// While it lives the trainer waits for a collective: a gap in the span.
  class Wait {
   public:
    explicit Wait(ComputeSpans& spans) noexcept : spans_(spans), paused_(spans.open_ != 0) { spans_.close(); }
    Wait(const Wait&) = delete;
    Wait& operator=(const Wait&) = delete;
    ~Wait() {
      if (paused_ && spans_.trace_) spans_.open_ = TraceRecorder::now_ns();
    }

   private:
    ComputeSpans& spans_;
    bool paused_;
  };

 private:
  static constexpr std::size_t no_unit = static_cast<std::size_t>(-1);
  void close() noexcept {
    if (!trace_ || !open_) return;
    trace_->phase(kind_, unit_, open_, TraceRecorder::now_ns());
    open_ = 0;
  }

  TraceRecorder* trace_ = nullptr;
  std::vector<std::uint8_t> asks_;
  std::size_t unit_ = no_unit;
  std::int64_t open_ = 0;
  TraceKind kind_ = TraceKind::forward;
};

}  // namespace gradsync::detail

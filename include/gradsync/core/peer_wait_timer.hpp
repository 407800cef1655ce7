#pragma once
/// \file PeerWaitTimer: how long a rank waited for its peers inside one collective.

#include <chrono>
#include <cstdint>
#include <utility>

namespace gradsync::detail {

/// A backend's account of the time its rank spent waiting for peers, for
/// the timeline's peer_wait_us: the waits that found nothing to do, less
/// the rank's own work done inside them (a copy or reduction of what had
/// arrived). Off (no timeline), every method is a test of one flag and
/// reads no clock; on, a clock read at each end of a wait and of each piece
/// of work inside one (work outside a wait is not timed). Waits do not nest.
class PeerWaitTimer {
 public:
  /// Where a wait began, and the work done up to then.
  struct Mark {
    std::int64_t at = 0;
    std::int64_t worked = 0;
  };

  void enable(bool on) noexcept { on_ = on; }

  Mark wait_begins() noexcept {
    if (!on_) return {};
    waiting_ = true;
    return {now_ns(), worked_ns_};
  }
  void wait_ends(Mark m) noexcept {
    if (!waiting_) return;
    waiting_ = false;
    waited_ns_ += now_ns() - m.at - (worked_ns_ - m.worked);
  }

  /// 0 (nothing to time) outside a wait.
  std::int64_t work_begins() const noexcept { return waiting_ ? now_ns() : 0; }
  void work_ends(std::int64_t begin) noexcept {
    if (begin != 0) worked_ns_ += now_ns() - begin;
  }

  /// The call waited where waiting and moving data cannot be told apart
  /// (inside a native collective): take() then says -1, "not told".
  void untold() noexcept { untold_ = on_; }

  /// Nanoseconds waited since the last take (or -1, see untold), then 0.
  std::int64_t take() noexcept {
    const std::int64_t waited = std::exchange(waited_ns_, 0);
    return std::exchange(untold_, false) ? -1 : waited;
  }

 private:
  static std::int64_t now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  bool on_ = false;
  bool waiting_ = false;
  bool untold_ = false;
  std::int64_t waited_ns_ = 0, worked_ns_ = 0;
};

}  // namespace gradsync::detail

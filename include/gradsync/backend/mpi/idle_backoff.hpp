#pragma once
/// \file IdleBackoff: how a long Mpi wait stops burning its core.

#include <algorithm>
#include <chrono>
#include <thread>

namespace gradsync::detail::mpi {

/// MPI gives a wait nothing to sleep on, so Mpi waits poll. Past its spin
/// phase a wait yields the core between polls: a message is still answered
/// at once, and a peer that shares the core gets to run. But a rank that
/// waits long (on a straggler, on a failed peer until its notice comes, out
/// to a deadline) then spends a whole core in sched_yield, and oversubscribed
/// Open MPI yields once more inside every empty MPI_Test. The MPI fault
/// tests (2 to 4 ranks on 2 cores) spent more CPU than wall time that way,
/// most of it in the kernel.
///
/// So an idle turn yields during the first `yield_time` of a wait, long
/// enough for a busy peer to answer (a large copy, a reduction, a few
/// scheduler time slices when ranks outnumber cores), and sleeps after it,
/// for 1/32 of the time waited so far, clamped to [`min_sleep`,
/// `max_sleep`]: a message that lands during a sleep is answered at most
/// about 3% (and 1 ms) later than the wait would have ended, and a second
/// of waiting costs about a thousand polls.
class IdleBackoff {
 public:
  static constexpr std::chrono::milliseconds yield_time{20};
  static constexpr std::chrono::microseconds min_sleep{50};
  static constexpr std::chrono::microseconds max_sleep{1000};

  /// A wait that began at `start` (now, by default).
  explicit IdleBackoff(std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now()) noexcept
      : start_(start) {}

  /// One turn in which nothing was ready: yield, or sleep once the wait is long.
  void idle() const {
    const std::chrono::nanoseconds waited = std::chrono::steady_clock::now() - start_;
    if (waited < yield_time) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::clamp<std::chrono::nanoseconds>(waited / 32, min_sleep, max_sleep));
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

}  // namespace gradsync::detail::mpi

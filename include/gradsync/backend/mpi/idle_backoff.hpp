#pragma once
/// \file IdleBackoff: how a long Mpi wait stops taking cores other ranks need.

#include <chrono>
#include <thread>

namespace gradsync::detail::mpi {

/// MPI gives a wait nothing to sleep on, so Mpi waits poll. Past its spin
/// phase a wait yields the core between polls: a message is still answered
/// at once, and a peer that shares the core gets to run. But where ranks
/// outnumber cores, ranks that wait long (on a straggler, on a failed peer
/// until its notice comes, out to a deadline) hand the cores to each other
/// in a loop of sched_yield, and oversubscribed Open MPI yields once more
/// inside every empty MPI_Test. The MPI fault tests (3 and 4 ranks on 2
/// cores) spent more CPU than wall time that way, most of it in the kernel.
///
/// Used by the waits of ranks that outnumber their host's cores (see
/// Endpoint::await: with a core per rank, yielding costs nobody) and by the
/// failure paths' listening loops, where no data is moving. An idle turn
/// yields during the first `yield_time` of a wait, long enough for a busy
/// peer to answer (a large copy, a reduction, a few scheduler time slices),
/// and naps for `nap` after it: a message that lands meanwhile is answered
/// that much later (plus the kernel's timer slack), under 1% of a wait
/// already 20 ms long, and a second of waiting costs some 6,000 polls
/// instead of hundreds of thousands of yields. Naps of 1 ms made 64 MiB
/// all-reduces at 4 ranks on 2 cores 20-40% slower: Open MPI moves a large
/// message only inside MPI calls, and needs many of them on both sides.
class IdleBackoff {
 public:
  static constexpr std::chrono::milliseconds yield_time{20};
  static constexpr std::chrono::microseconds nap{100};

  /// A wait that began at `start` (now, by default).
  explicit IdleBackoff(std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now()) noexcept
      : yield_until_(start + yield_time) {}

  /// One turn in which nothing was ready: yield, or nap once the wait is long.
  void idle() const {
    if (std::chrono::steady_clock::now() < yield_until_) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(nap);
    }
  }

 private:
  std::chrono::steady_clock::time_point yield_until_;
};

}  // namespace gradsync::detail::mpi

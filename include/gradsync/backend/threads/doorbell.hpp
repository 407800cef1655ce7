#pragma once
/// \file How a Threads rank waits: spin briefly, then yield, then block.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include "gradsync/core/flight_signal.hpp"
#include "gradsync/core/spinner.hpp"

namespace gradsync::detail::threads {

/// One per rank. Whoever changes state a rank may be waiting on rings its
/// bell; a rank that found nothing to do sleeps on it. The epoch counter and
/// sleeper count make the hand-off free when nobody sleeps.
struct alignas(64) Doorbell {
  std::atomic<std::uint64_t> epoch{0};
  std::atomic<int> sleepers{0};
  std::mutex mutex;
  std::condition_variable cv;

  void ring() noexcept {
    epoch.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex);
      cv.notify_all();
    }
  }
};

/// How long to yield before sleeping. Yielding hands the core to the awaited
/// rank when it shares the core, and costs only a system call when the core
/// is free, so it also covers waits for a peer that is busy copying a large
/// message (hundreds of microseconds), which a sleep would lengthen by its
/// wake-up latency.
inline constexpr std::chrono::microseconds yield_time{2000};

/// Waits until `ready()` holds. `check()` runs between attempts once spinning
/// is over and throws to give up (abort, deadline).
template <class Ready, class Check>
void wait_on(Doorbell& bell, Spinner& spinner, Ready&& ready, Check&& check) {
  const auto until = std::chrono::steady_clock::now() + spinner.budget();
  for (int i = 1;; ++i) {
    if (ready()) return spinner.spun_enough();
    cpu_relax();
    if (i % 32 == 0 && std::chrono::steady_clock::now() > until) break;
  }
  spinner.spun_in_vain();
  const auto yield_until = std::chrono::steady_clock::now() + yield_time;
  for (;;) {
    const std::uint64_t seen = bell.epoch.load(std::memory_order_seq_cst);
    if (ready()) return;
    check();
    poll_flight_signal();
    if (std::chrono::steady_clock::now() < yield_until) {
      std::this_thread::yield();
      continue;
    }
    bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
    {
      std::unique_lock<std::mutex> lock(bell.mutex);
      // Wake at least every 20 ms so `check` can see the deadline pass.
      bell.cv.wait_for(lock, std::chrono::milliseconds(20),
                       [&] { return bell.epoch.load(std::memory_order_seq_cst) != seen; });
    }
    bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace gradsync::detail::threads

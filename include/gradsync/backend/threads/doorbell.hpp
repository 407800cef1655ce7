#pragma once
/// \file How a Threads rank waits: spin briefly, then yield, then block.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace gradsync::detail::threads {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

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

/// Spin iterations before yielding: a few microseconds, enough for a peer on
/// another core to answer a small message without a system call.
inline constexpr int spin_iterations = 4000;
/// Yields before sleeping: when ranks outnumber cores, yielding hands the core
/// to the rank we are waiting for.
inline constexpr int yield_iterations = 64;

/// Waits until `ready()` holds. `check()` runs between attempts once spinning
/// is over and throws to give up (abort, deadline).
template <class Ready, class Check>
void wait_on(Doorbell& bell, Ready&& ready, Check&& check) {
  for (int i = 0; i < spin_iterations; ++i) {
    if (ready()) return;
    cpu_relax();
  }
  for (int i = 0;; ++i) {
    const std::uint64_t seen = bell.epoch.load(std::memory_order_seq_cst);
    if (ready()) return;
    check();
    if (i < yield_iterations) {
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

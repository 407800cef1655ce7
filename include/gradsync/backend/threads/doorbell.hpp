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

/// How long to spin before yielding, when every rank has a core: long
/// enough for a peer to answer a small message without a system call.
inline constexpr std::chrono::microseconds spin_time{30};
/// Yields before sleeping. When ranks outnumber cores, spinning only steals
/// the core from the rank being waited for, so waiting starts here.
inline constexpr int yield_iterations = 200;

/// Waits until `ready()` holds. `check()` runs between attempts once spinning
/// is over and throws to give up (abort, deadline).
template <class Ready, class Check>
void wait_on(Doorbell& bell, bool oversubscribed, Ready&& ready, Check&& check) {
  if (!oversubscribed) {
    const auto until = std::chrono::steady_clock::now() + spin_time;
    for (int i = 1;; ++i) {
      if (ready()) return;
      cpu_relax();
      if (i % 64 == 0 && std::chrono::steady_clock::now() > until) break;
    }
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

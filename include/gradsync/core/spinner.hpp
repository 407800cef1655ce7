#pragma once
/// \file Spinner: how long a waiting rank polls before it gives its core away.
///
/// Shared by the backends whose waits poll (Threads' doorbells, Mpi's
/// MPI_Testsome), because both face the same trade: spinning answers a small
/// message in well under a microsecond when the peer runs on another core,
/// and steals the peer's time slice when it runs on this one.

#include <algorithm>
#include <chrono>
#include <thread>
#if defined(__linux__)
#include <sched.h>
#endif

namespace gradsync::detail {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

/// Cores this process may run on: its affinity mask where the OS has one
/// (taskset, cgroups), which hardware_concurrency() ignores.
inline int usable_cores() noexcept {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

/// How long a waiting rank spins before it yields, adapted to what spinning
/// has been worth. It only burns time when the awaited peer shares this core
/// (more ranks than cores, or other processes busy): each wait that outlasts
/// its spin shrinks the budget fourfold and each one that ends within it
/// doubles it, so a crowded machine converges to yielding at once, and a
/// quiet one to spinning.
class Spinner {
 public:
  static constexpr std::chrono::nanoseconds max_spin{30'000};
  /// Even at a zero budget a wait first polls this long, so that the budget
  /// can recover once the machine is quiet again.
  static constexpr std::chrono::nanoseconds probe{500};

  explicit Spinner(bool oversubscribed) noexcept
      : budget_(oversubscribed ? probe : max_spin), oversubscribed_(oversubscribed) {}

  /// Whether the ranks sharing this host outnumbered its cores when the
  /// waits began: then a rank that waits takes a core some peer needs.
  bool oversubscribed() const noexcept { return oversubscribed_; }

  std::chrono::nanoseconds budget() const noexcept { return budget_ > probe ? budget_ : probe; }
  void spun_enough() noexcept { budget_ = std::min(max_spin, budget_ * 2 + probe); }
  void spun_in_vain() noexcept { budget_ /= 4; }

 private:
  std::chrono::nanoseconds budget_;
  bool oversubscribed_;
};

}  // namespace gradsync::detail

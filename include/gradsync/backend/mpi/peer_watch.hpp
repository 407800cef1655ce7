#pragma once
/// \file PeerWatch: which Mpi ranks on this host have died, told by their
/// processes rather than by their messages.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "gradsync/backend/mpi/peer_process.hpp"
#include "gradsync/backend/mpi/shared_slots.hpp"

namespace gradsync::detail::mpi {

/// A rank killed outright (SIGKILL, the OOM killer) sends no notice, so a
/// peer holding a send to it would never hear that it can let go (see
/// Endpoint::let_sends_go). On one host each rank's slot says which process
/// it is, and a process that is gone reads no one's memory. Across hosts
/// there are no slots and nothing to watch: such a send waits out
/// cancel_bound there.
///
/// A peer counts as gone once two looks at least `interval` apart have found
/// its process gone: what it put in this rank's MPI queues before it died
/// (say, a rendezvous answer that would make this rank push the data) is
/// taken by the MPI calls this rank makes in between, while the buffer is
/// still the caller's.
class PeerWatch {
 public:
  /// How often one peer's process is looked at: a kill(2) and a read of
  /// /proc, too dear for every MPI_Test of a failure path's poll.
  static constexpr std::chrono::milliseconds interval{1};

  PeerWatch() = default;
  /// Watches the peers whose slot names a process this one sees as itself
  /// (process_seen); the others count as alive for good. The slots' ids are
  /// written before the collective that ends mapping them.
  PeerWatch(Slot* slots, int size, int rank) : procs_(static_cast<std::size_t>(size)), looks_(procs_.size()),
                                               next_(procs_.size()) {
    for (int q = 0; q < size; ++q) {
      const auto i = static_cast<std::size_t>(q);
      const ProcessId p{std::atomic_ref<std::uint64_t>(slots[q].pid).load(std::memory_order_acquire),
                        std::atomic_ref<std::uint64_t>(slots[q].start).load(std::memory_order_acquire)};
      if (q != rank && process_seen(p)) procs_[i] = p;
    }
  }

  /// Whether q's process is gone, as far as the looks so far tell; looks
  /// again if the last look is `interval` old.
  bool gone(int q) noexcept {
    const auto i = static_cast<std::size_t>(q);
    if (i >= procs_.size() || procs_[i].pid == 0) return false;
    if (looks_[i] >= 2) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now < next_[i]) return false;
    next_[i] = now + interval;
    looks_[i] = process_gone(procs_[i]) ? looks_[i] + 1 : 0;
    return looks_[i] >= 2;
  }

 private:
  std::vector<ProcessId> procs_;  ///< per rank; pid 0: not watched
  std::vector<std::uint8_t> looks_;  ///< looks in a row that found it gone
  std::vector<std::chrono::steady_clock::time_point> next_;
};

}  // namespace gradsync::detail::mpi

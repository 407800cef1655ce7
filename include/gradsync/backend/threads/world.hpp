#pragma once
/// \file State shared by the ranks of one run_threads call.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/backend/threads/doorbell.hpp"
#include "gradsync/core/spinner.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync::detail::threads {

/// A send waiting in the receiver's mailbox. It lives in the sender's
/// endpoint until `state` says done; the receiver copies straight out of
/// `data`, so a message is one copy, never two.
struct Message {
  enum State : int { posted = 0, claimed = 1, done = 2 };
  const void* data = nullptr;
  std::size_t count = 0;
  DataType type = DataType::float32;
  std::uint64_t seq = 0;
  std::uint32_t tag = 0;
  int src = 0;
  const CallInfo* call = nullptr;  ///< the sender's call, for mismatch messages
  std::atomic<int> state{posted};
};

/// Messages addressed to one rank, from anyone.
struct alignas(64) Mailbox {
  std::mutex mutex;
  std::vector<Message*> queue;
  /// Bumped on every post, so a poller can skip the lock when nothing is new.
  std::atomic<std::uint64_t> posted{0};
};

/// What a rank publishes for a Native (shared-memory) collective.
struct alignas(64) NativeSlot {
  const void* in = nullptr;
  void* out = nullptr;
  CallInfo call;
};

struct alignas(64) PaddedCounter {
  std::atomic<std::uint64_t> value{0};
};

/// Shared by all ranks of one in-process world.
class World {
 public:
  explicit World(int size)
      : size_(size),
        oversubscribed_(size > usable_cores()),
        bells_(size),
        mailboxes_(size),
        slots_(size),
        arrivals_(size) {}

  int size() const noexcept { return size_; }
  /// More ranks than cores: waiting ranks should give their core away at once.
  bool oversubscribed() const noexcept { return oversubscribed_; }
  Doorbell& bell(int r) noexcept { return bells_[static_cast<std::size_t>(r)]; }
  Mailbox& mailbox(int r) noexcept { return mailboxes_[static_cast<std::size_t>(r)]; }
  NativeSlot& slot(int r) noexcept { return slots_[static_cast<std::size_t>(r)]; }

  bool aborted() const noexcept { return aborted_.load(std::memory_order_acquire); }

  /// Marks the world failed (first caller's reason wins) and wakes everyone.
  void abort(int rank, const std::string& why) noexcept {
    {
      std::lock_guard<std::mutex> lock(reason_mutex_);
      if (!aborted_.load(std::memory_order_relaxed)) {
        reason_ = "rank " + std::to_string(rank) + " failed: " + why;
        aborted_.store(true, std::memory_order_release);
      }
    }
    for (auto& b : bells_) b.ring();
  }

  std::string abort_reason() const {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    return reason_;
  }

  /// The barrier: one counter of all arrivals ever. The k-th barrier (from 1)
  /// completes when it reaches k * size. A single counter makes "did this
  /// barrier complete?" one atomic fact, so a rank that gives up can take its
  /// arrival back only while the answer is still no (see Endpoint::barrier).
  std::atomic<std::uint64_t>& barrier_count() noexcept { return barrier_count_.value; }
  /// Per-rank count of barriers entered, only to name a missing rank.
  std::atomic<std::uint64_t>& arrivals(int r) noexcept { return arrivals_[static_cast<std::size_t>(r)].value; }

 private:
  int size_;
  bool oversubscribed_;
  std::vector<Doorbell> bells_;
  std::vector<Mailbox> mailboxes_;
  std::vector<NativeSlot> slots_;
  std::vector<PaddedCounter> arrivals_;
  PaddedCounter barrier_count_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex reason_mutex_;
  std::string reason_;
};

}  // namespace gradsync::detail::threads

#pragma once
/// \file State shared by the ranks of one run_threads call.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "gradsync/backend/threads/doorbell.hpp"
#include "gradsync/core/spinner.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/rank_names.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync::detail::threads {

/// A send waiting in the receiver's mailbox. It lives in the sender's
/// endpoint until `state` says done; the receiver copies straight out of
/// `data`, so a message is one copy, never two.
struct Message {
  /// refused: the receiver failed and handed the message back unread; its
  /// sender must fail too rather than count it as delivered.
  enum State : int { posted = 0, claimed = 1, done = 2, refused = 3 };
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
  /// The sequence number of the Native call whose buffers this rank may be
  /// reading or writing right now, 0 when none: a rank that abandons a Native
  /// call waits until no peer is inside it before its buffers can be freed.
  std::atomic<std::uint64_t> busy{0};
};

struct alignas(64) PaddedCounter {
  std::atomic<std::uint64_t> value{0};
};

/// The last few calls a rank has started, so that a waiting peer can tell a
/// disagreement (same sequence number, different call) from a peer that is
/// merely late, and name both calls. Written only by its rank, read by any:
/// a sequence lock built of atomics, so readers never block the writer.
class alignas(64) CallLog {
 public:
  static constexpr std::uint64_t depth = 4;

  /// Publishes call `c` (c.seq >= 1) as started.
  void publish(const CallInfo& c) noexcept {
    Entry& e = entries_[c.seq % depth];
    // No fences (ThreadSanitizer cannot follow them): each word is stored
    // with release, so a reader that sees any new word also sees seq = 0.
    e.seq.store(0, std::memory_order_relaxed);
    e.words[0].store(static_cast<std::uint64_t>(c.collective) | static_cast<std::uint64_t>(c.type) << 8 |
                         static_cast<std::uint64_t>(c.op) << 16 | static_cast<std::uint64_t>(c.deterministic) << 24 |
                         static_cast<std::uint64_t>(static_cast<std::uint32_t>(c.root)) << 32,
                     std::memory_order_release);
    e.words[1].store(c.count, std::memory_order_release);
    e.words[2].store(c.chunk_bytes, std::memory_order_release);
    // Algorithm names are string literals with static storage, shared by
    // every rank of the process, so their address is a stable identity.
    e.words[3].store(reinterpret_cast<std::uintptr_t>(c.algorithm.data()), std::memory_order_release);
    e.words[4].store(c.algorithm.size(), std::memory_order_release);
    e.words[5].store(c.label.id, std::memory_order_release);
    e.words[6].store(c.label.setting, std::memory_order_release);
    e.seq.store(c.seq, std::memory_order_release);
    latest_.store(c.seq, std::memory_order_seq_cst);
  }

  /// The highest sequence number published (0 before the first call).
  std::uint64_t latest() const noexcept { return latest_.load(std::memory_order_seq_cst); }

  /// Call number `seq` as this rank started it, if it is still in the log.
  bool read(std::uint64_t seq, CallInfo& out) const noexcept {
    const Entry& e = entries_[seq % depth];
    if (e.seq.load(std::memory_order_acquire) != seq) return false;
    std::uint64_t w[words];
    for (std::size_t i = 0; i < words; ++i) w[i] = e.words[i].load(std::memory_order_acquire);
    if (e.seq.load(std::memory_order_relaxed) != seq) return false;
    out.collective = static_cast<Collective>(w[0] & 0xff);
    out.type = static_cast<DataType>(w[0] >> 8 & 0xff);
    out.op = static_cast<OpKind>(w[0] >> 16 & 0xff);
    out.deterministic = (w[0] >> 24 & 1) != 0;
    out.root = static_cast<int>(static_cast<std::uint32_t>(w[0] >> 32));
    out.count = w[1];
    out.chunk_bytes = w[2];
    out.algorithm = std::string_view(reinterpret_cast<const char*>(static_cast<std::uintptr_t>(w[3])), w[4]);
    out.label.id = w[5];
    out.label.setting = w[6];
    out.seq = seq;
    return true;
  }

 private:
  static constexpr std::size_t words = 7;
  struct Entry {
    std::atomic<std::uint64_t> seq{0};
    std::atomic<std::uint64_t> words[CallLog::words]{};
  };
  std::atomic<std::uint64_t> latest_{0};
  Entry entries_[depth];
};

/// How a rank's endpoint went away, so that the peers it leaves waiting
/// are told what happened on that rank, in words they can act on.
enum class Departure : std::uint8_t {
  destroyed,  ///< its communicator was destroyed
  unwound,    ///< an exception destroyed its communicator as it unwound
  returned,   ///< its run_threads body returned
  threw,      ///< its run_threads body ended with an exception
};

/// Why the world failed, so other ranks can fail the same way: a
/// disagreement reads as InvalidArgument on every rank.
struct AbortInfo {
  std::string reason;
  FailureKind kind = FailureKind::error;
};

/// Shared by all ranks of one in-process world: a run_threads call's, or a
/// sub-world made by Communicator::split, which has its own mailboxes, call
/// logs, barrier and failure state, and is owned by its members' endpoints.
class World {
 public:
  explicit World(int size) : World(size, size > usable_cores()) {}
  /// A sub-world (Communicator::split) runs beside its parent's other ranks,
  /// so it is as oversubscribed as the parent, whatever its own size.
  World(int size, bool oversubscribed)
      : size_(size),
        oversubscribed_(oversubscribed),
        bells_(size),
        mailboxes_(size),
        slots_(size),
        logs_(size),
        left_after_(size),
        departures_(size),
        arrivals_(size) {
    for (auto& l : left_after_) l.value.store(still_here, std::memory_order_relaxed);
  }

  int size() const noexcept { return size_; }
  /// More ranks than cores: waiting ranks should give their core away at once.
  bool oversubscribed() const noexcept { return oversubscribed_; }
  Doorbell& bell(int r) noexcept { return bells_[static_cast<std::size_t>(r)]; }
  Mailbox& mailbox(int r) noexcept { return mailboxes_[static_cast<std::size_t>(r)]; }
  NativeSlot& slot(int r) noexcept { return slots_[static_cast<std::size_t>(r)]; }
  CallLog& log(int r) noexcept { return logs_[static_cast<std::size_t>(r)]; }

  /// left_after(r) is still_here until rank r's endpoint is destroyed, then
  /// the number of calls it had made: a peer waiting in a later call knows
  /// rank r will never come.
  static constexpr std::uint64_t still_here = ~std::uint64_t{0};
  std::uint64_t left_after(int r) const noexcept {
    return left_after_[static_cast<std::size_t>(r)].value.load(std::memory_order_acquire);
  }
  /// Rank r's endpoint is gone after `calls` calls; `unwinding`: an
  /// exception destroyed it, whatever run_threads said of the body before.
  void leave(int r, std::uint64_t calls, bool unwinding) noexcept {
    if (unwinding) depart(r, Departure::unwound);
    left_after_[static_cast<std::size_t>(r)].value.store(calls, std::memory_order_release);
    for (auto& b : bells_) b.ring();
  }
  /// How rank r's endpoint is about to go (run_threads tells it of the body
  /// before the communicator it made for it is destroyed).
  void depart(int r, Departure how) noexcept {
    departures_[static_cast<std::size_t>(r)].value.store(static_cast<std::uint64_t>(how), std::memory_order_relaxed);
  }
  /// How rank r went, once left_after(r) says it has (that read orders this one).
  Departure departure(int r) const noexcept {
    return static_cast<Departure>(departures_[static_cast<std::size_t>(r)].value.load(std::memory_order_relaxed));
  }

  bool aborted() const noexcept { return aborted_.load(std::memory_order_acquire); }

  /// Whether the failure concerns call number `seq`: the call it happened in
  /// and every later one. A rank still finishing an earlier call goes on:
  /// every rank has done its part of that call, and the failure belongs to
  /// the next (which is then refused at once).
  bool aborted_for(std::uint64_t seq) const noexcept {
    return aborted_.load(std::memory_order_acquire) && seq >= abort_seq_.load(std::memory_order_relaxed);
  }

  void ring_all() noexcept {
    for (auto& b : bells_) b.ring();
  }
  /// Ranks waiting for a peer to start a call; a rank starting one rings
  /// the bells only when there are some. Sequentially consistent on both
  /// sides, so a waiter either sees the start or is rung.
  int publish_waiters() const noexcept { return publish_waiters_.load(std::memory_order_seq_cst); }
  void add_publish_waiter(int d) noexcept { publish_waiters_.fetch_add(d, std::memory_order_seq_cst); }

  /// Marks the world failed from call number `seq` on (first caller's
  /// reason wins) and wakes everyone. `names` names the failing `rank`.
  void abort(int rank, const RankNames& names, std::uint64_t seq, const std::string& why,
             FailureKind kind = FailureKind::error) noexcept {
    {
      std::lock_guard<std::mutex> lock(reason_mutex_);
      if (!aborted_.load(std::memory_order_relaxed)) {
        try {
          // A disagreement's own text already names both ranks and calls.
          abort_.reason = kind == FailureKind::invalid_argument ? why : names.failed(rank, why);
        } catch (...) {
          abort_.reason = "a rank failed";
        }
        abort_.kind = kind;
        abort_seq_.store(seq, std::memory_order_relaxed);
        aborted_.store(true, std::memory_order_release);
      }
    }
    for (auto& b : bells_) b.ring();
  }

  AbortInfo abort_info() const {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    return abort_;
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
  std::vector<CallLog> logs_;
  std::vector<PaddedCounter> left_after_;
  std::vector<PaddedCounter> departures_;  ///< a Departure per rank
  std::vector<PaddedCounter> arrivals_;
  PaddedCounter barrier_count_;
  std::atomic<bool> aborted_{false};
  std::atomic<std::uint64_t> abort_seq_{0};
  std::atomic<int> publish_waiters_{0};
  mutable std::mutex reason_mutex_;
  AbortInfo abort_;
};

}  // namespace gradsync::detail::threads

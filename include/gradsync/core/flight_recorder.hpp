#pragma once
/// \file FlightRecorder: a communicator's last collectives, always kept, written out when a call fails.
///
/// A deadline says that a rank waited too long; it cannot say what every
/// other rank was doing then. So each communicator keeps, in a fixed ring,
/// its last calls (what, how large, and how far each got, with times), and
/// when a call fails (Timeout, Aborted, a disagreement) each rank writes its
/// ring to one JSON file. tools/flight-analyze reads the files of all ranks
/// and says in one line who never entered which call. PyTorch's NCCL flight
/// recorder answers the same question the same way.
///
/// Cost on the success path: one copy of the CallInfo into the ring and one
/// read of the kernel's coarse clock per call (bench/flight_recorder_cost);
/// nothing allocates after construction.

#include <algorithm>
#include <bit>
#include <chrono>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/json_string.hpp"
#include "gradsync/core/local_reduce.hpp"
#include "gradsync/core/rank_names.hpp"

namespace gradsync::detail {

/// How far a recorded call got. `issued`: entered the communicator, not yet
/// agreed on by the ranks; `started`: agreed, data moving; then one of the
/// two ends.
enum class FlightState : std::uint8_t { issued, started, completed, failed };

constexpr std::string_view name(FlightState s) noexcept {
  switch (s) {
    case FlightState::issued: return "issued";
    case FlightState::started: return "started";
    case FlightState::completed: return "completed";
    case FlightState::failed: return "failed";
  }
  return "?";
}

/// The class name of a failure kind, as the exception is called.
constexpr std::string_view name(FailureKind k) noexcept {
  switch (k) {
    case FailureKind::invalid_argument: return "InvalidArgument";
    case FailureKind::timeout: return "Timeout";
    case FailureKind::aborted: return "Aborted";
    case FailureKind::error: return "Error";
  }
  return "Error";
}

/// One recorded call. Times are nanoseconds of CLOCK_MONOTONIC, the clock
/// of std::chrono::steady_clock on Linux, one for every process of a host.
struct FlightEntry {
  CallInfo call{};
  FlightState state = FlightState::issued;
  /// When the call entered, read from the coarse form of the clock (its
  /// last tick: a few ms at most; a precise read costs 30 ns here, several
  /// percent of the cheapest call). Enough to tell a rank that came after a
  /// deadline ran out from one that was waiting.
  std::int64_t issued_ns = 0;
  /// When a failed call gave up, read precisely; 0 for any other state (a
  /// completed call's end would cost a clock read on every call).
  std::int64_t ended_ns = 0;
};

/// Where a failing call's record goes: $GRADSYNC_FLIGHT_DIR, else the
/// working directory; empty when GRADSYNC_FLIGHT_DIR is "off".
inline std::string flight_dir() {
  const char* env = std::getenv("GRADSYNC_FLIGHT_DIR");
  if (env == nullptr || *env == '\0') return ".";
  if (std::string_view(env) == "off") return {};
  return env;
}

/// Calls a communicator's ring holds: $GRADSYNC_FLIGHT_ENTRIES (at most
/// 2^20; 0 keeps none, to measure the recorder's cost or to do without it),
/// else 256.
inline std::size_t flight_capacity() noexcept {
  const char* env = std::getenv("GRADSYNC_FLIGHT_ENTRIES");
  if (env == nullptr) return 256;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(env, &end, 10);
  if (end == env || *end != '\0') return 256;
  return static_cast<std::size_t>(std::min<unsigned long long>(n, 1u << 20));
}

/// The ring of one communicator's last calls.
class FlightRecorder {
 public:
  /// A ring of `capacity` calls, rounded up to a power of two (an index is
  /// then a mask, not a division); 0 keeps no calls.
  explicit FlightRecorder(std::size_t capacity)
      : capacity_(capacity == 0 ? 0 : std::bit_ceil(capacity)),
        mask_(capacity_ == 0 ? 0 : capacity_ - 1),
        ring_(std::make_unique<FlightEntry[]>(std::max<std::size_t>(capacity_, 1))) {}

  static std::int64_t now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  /// The same clock at its last tick: a read of the kernel's shared page.
  static std::int64_t coarse_now_ns() noexcept {
#if defined(__linux__) && defined(CLOCK_MONOTONIC_COARSE)
    timespec t{};
    clock_gettime(CLOCK_MONOTONIC_COARSE, &t);
    return std::int64_t{t.tv_sec} * 1'000'000'000 + t.tv_nsec;
#else
    return now_ns();
#endif
  }

  /// Records `call` as issued; the slot stays valid until `capacity` more
  /// calls are issued.
  FlightEntry& issue(const CallInfo& call) noexcept {
    // Kept nowhere: the one entry is scratch that start() and end() may write.
    if (capacity_ == 0) [[unlikely]] return ring_[0];
    FlightEntry& e = ring_[recorded_++ & mask_];
    e.call = call;
    e.state = FlightState::issued;
    e.issued_ns = coarse_now_ns();
    e.ended_ns = 0;
    return e;
  }
  static void start(FlightEntry& e) noexcept { e.state = FlightState::started; }
  static void end(FlightEntry& e, FlightState how) noexcept {
    e.state = how;
    if (how == FlightState::failed) e.ended_ns = now_ns();
  }

  /// Calls recorded since construction (the ring holds the last capacity()).
  std::uint64_t recorded() const noexcept { return recorded_; }
  std::size_t capacity() const noexcept { return capacity_; }
  /// The i-th oldest call the ring holds, i < held().
  std::size_t held() const noexcept { return static_cast<std::size_t>(std::min<std::uint64_t>(recorded_, capacity_)); }
  const FlightEntry& entry(std::size_t i) const noexcept {
    const std::uint64_t first = recorded_ - held();
    return ring_[(first + i) & mask_];
  }

  /// What a record says beside its entries.
  struct Context {
    int rank = 0;
    int size = 1;
    const RankNames* names = nullptr;
    std::string_view reason;   ///< the failure's class name, or "requested"
    std::string_view message;  ///< the failure's what(), or empty
    /// Label names that are alive now (the failing call's): entries with
    /// other names print their labels as numbers, since those names may be
    /// gone.
    const LabelNames* live_names = nullptr;
  };

  /// The record as one JSON document (docs/DEBUGGING.md describes it).
  std::string to_json(const Context& c) const {
    const RankNames& names = c.names ? *c.names : RankNames::world();
    std::string s = "{\n  \"format\": \"gradsync flight record\",\n  \"version\": 1,\n  \"group\": ";
    append_json_string(s, names.group());
    s += ",\n  \"rank\": " + std::to_string(c.rank) + ",\n  \"size\": " + std::to_string(c.size) +
         ",\n  \"world_rank\": " + std::to_string(names.world_rank(c.rank)) + ",\n  \"who\": ";
    append_json_string(s, names.who(c.rank));
    s += ",\n  \"world_ranks\": [";
    for (int r = 0; r < c.size; ++r) s += (r ? ", " : "") + std::to_string(names.world_rank(r));
    char host[256] = {};
    if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
    s += "],\n  \"host\": ";
    append_json_string(s, host);
    s += ",\n  \"pid\": " + std::to_string(static_cast<long long>(getpid())) + ",\n  \"reason\": ";
    append_json_string(s, c.reason);
    s += ",\n  \"message\": ";
    append_json_string(s, c.message);
    // Both clocks read together: a reader converts the steady times of any
    // host to wall-clock time (to compare hosts) with their difference.
    const std::int64_t steady = now_ns();
    const std::int64_t wall = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::system_clock::now().time_since_epoch())
                                  .count();
    s += ",\n  \"dumped_steady_ns\": " + std::to_string(steady) + ",\n  \"dumped_unix_ns\": " + std::to_string(wall) +
         ",\n  \"capacity\": " + std::to_string(capacity_) + ",\n  \"recorded\": " + std::to_string(recorded_) +
         ",\n  \"entries\": [";
    for (std::size_t i = 0; i < held(); ++i) {
      const FlightEntry& e = entry(i);
      const CallInfo& k = e.call;
      const bool live = k.label.names != nullptr && k.label.names == c.live_names;
      s += i ? ",\n    {" : "\n    {";
      s += "\"seq\": " + std::to_string(k.seq) + ", \"collective\": ";
      append_json_string(s, name(k.collective));
      s += ", \"algorithm\": ";
      append_json_string(s, k.algorithm);
      s += ", \"dtype\": ";
      append_json_string(s, name(k.type));
      s += ", \"op\": ";
      append_json_string(s, name(k.op));
      s += ", \"count\": " + std::to_string(k.count) + ", \"bytes\": " + std::to_string(k.count * size_of(k.type)) +
           ", \"root\": " + std::to_string(k.root) + ", \"label\": ";
      append_json_string(s, k.label.describe(live ? k.label.names : nullptr));
      s += ", \"what\": ";
      append_json_string(s, describe(k, live ? k.label.names : nullptr));
      s += ", \"state\": ";
      append_json_string(s, name(e.state));
      s += ", \"issued_ns\": " + std::to_string(e.issued_ns) + ", \"ended_ns\": " + std::to_string(e.ended_ns) + "}";
    }
    s += "\n  ]\n}\n";
    return s;
  }

  /// Writes the record to `dir`/gradsync-flight-<group>-rank<R>.json (R: the
  /// world rank where known), replacing an earlier one whole (written
  /// beside it, then renamed), and returns the path. Throws Error naming the
  /// path if the file cannot be written.
  std::string write(const std::string& dir, const Context& c) const {
    const RankNames& names = c.names ? *c.names : RankNames::world();
    std::string group;
    for (const char ch : names.group()) {
      const bool plain = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
      group += plain ? ch : '-';
    }
    const int world = names.world_rank(c.rank);
    const std::string path = dir + "/gradsync-flight-" + group + "-rank" +
                             (world >= 0 ? std::to_string(world) : std::to_string(c.rank) + "-local") + ".json";
    // One level made if missing: a record is wanted most when nothing was prepared.
    if (mkdir(dir.c_str(), 0777) != 0 && errno != EEXIST) throw Error("gradsync: could not make " + dir + " for the flight record");
    const std::string tmp = path + ".tmp" + std::to_string(static_cast<long long>(getpid()));
    const std::string text = to_json(c);
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    bool ok = f != nullptr && std::fwrite(text.data(), 1, text.size(), f) == text.size();
    if (f != nullptr) ok = std::fclose(f) == 0 && ok;
    if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
      std::remove(tmp.c_str());
      throw Error("gradsync: could not write the flight record " + path);
    }
    return path;
  }

 private:
  std::size_t capacity_;
  std::size_t mask_;
  std::unique_ptr<FlightEntry[]> ring_;
  std::uint64_t recorded_ = 0;
};

}  // namespace gradsync::detail

#pragma once
/// \file Flight records on a signal: `kill -USR1 PID` makes every rank of a stuck process write its ring.
///
/// A run that hangs with a long deadline says nothing until the deadline
/// fires. With GRADSYNC_FLIGHT_SIGNAL=USR1 (or USR2, or a number), or
/// after dump_flight_records_on(SIGUSR1), that signal makes each rank
/// write its flight record from its own thread: the handler only counts
/// the signal (an atomic add, all a handler may safely do), and a rank
/// waiting inside a call sees the count change at its next look at the
/// clock (every 20 ms at most) and writes its communicator's ring, the
/// call it waits in included. A rank that is not inside a call then writes
/// nothing, and its missing record says just that to tools/flight-analyze.
/// Its thread writing its own ring is what keeps the recorder free of
/// locks: no other thread ever reads it.
///
/// Only the slow part of a wait looks (after it stopped spinning); a call
/// pays one read of the count as it starts (a signal that came before it
/// is not its to answer).

#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "gradsync/core/error.hpp"

namespace gradsync::detail {

/// How many dump signals have arrived. Constant-initialised, so the handler
/// never meets a static's first-use guard.
inline constinit std::atomic<std::uint32_t> flight_signals{0};

extern "C" inline void gradsync_flight_signal_handler(int /*signal*/) {
  flight_signals.fetch_add(1, std::memory_order_relaxed);
}

/// What a thread inside a collective can dump: its communicator, as a
/// function and an object (the backend does not know the Communicator type).
struct FlightSignalSlot {
  void (*dump)(const void* owner) noexcept = nullptr;
  const void* owner = nullptr;
  std::uint32_t seen = 0;  ///< the count this thread last answered
};

/// Constant-initialised, so a thread's first use runs no guard: the slot is
/// set on every call (about 1 ns with the count's read).
inline constinit thread_local FlightSignalSlot flight_signal_slot_v{};
inline FlightSignalSlot& flight_signal_slot() noexcept { return flight_signal_slot_v; }

/// Makes the communicator `owner` the one this thread dumps while it is in
/// a call, for the signals that arrive from now on, and none once the call
/// is over. (Calls do not nest: a collective's body makes no other.)
class FlightSignalScope {
 public:
  FlightSignalScope(void (*dump)(const void*) noexcept, const void* owner) noexcept : slot_(flight_signal_slot()) {
    slot_.dump = dump;
    slot_.owner = owner;
    slot_.seen = flight_signals.load(std::memory_order_relaxed);
  }
  FlightSignalScope(const FlightSignalScope&) = delete;
  FlightSignalScope& operator=(const FlightSignalScope&) = delete;
  ~FlightSignalScope() { slot_.dump = nullptr; }

 private:
  FlightSignalSlot& slot_;
};

/// From a wait's slow path: writes this thread's communicator's ring once
/// for each signal that arrived since it last did.
inline void poll_flight_signal() noexcept {
  const std::uint32_t n = flight_signals.load(std::memory_order_relaxed);
  FlightSignalSlot& slot = flight_signal_slot();
  if (n == slot.seen || slot.dump == nullptr) return;
  slot.seen = n;
  slot.dump(slot.owner);
}

/// "USR1", "SIGUSR2", "10": the signal's number; 0 for anything else.
inline int parse_signal(std::string_view s) noexcept {
  if (s.starts_with("SIG")) s.remove_prefix(3);
  if (s == "USR1") return SIGUSR1;
  if (s == "USR2") return SIGUSR2;
  if (s.empty() || s.size() > 2) return 0;
  int n = 0;
  for (const char c : s) {
    if (c < '0' || c > '9') return 0;
    n = n * 10 + (c - '0');
  }
  return n > 0 && n < NSIG ? n : 0;
}

/// Installs the handler for `signal`. Throws InvalidArgument for a signal
/// that cannot be caught or where sigaction refuses.
inline void install_flight_signal(int signal) {
  if (signal <= 0 || signal >= NSIG || signal == SIGKILL || signal == SIGSTOP) {
    throw InvalidArgument("gradsync: dump_flight_records_on(" + std::to_string(signal) +
                          "): give a signal that can be caught, such as SIGUSR1");
  }
  struct sigaction action;
  std::memset(&action, 0, sizeof action);
  action.sa_handler = gradsync_flight_signal_handler;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  if (sigaction(signal, &action, nullptr) != 0) {
    throw InvalidArgument("gradsync: dump_flight_records_on(" + std::to_string(signal) + "): sigaction refused it");
  }
}

/// GRADSYNC_FLIGHT_SIGNAL, read once per process, when the first
/// communicator is made: its handler installed, or a warning on stderr for
/// a value that names no signal (a misspelt variable must not stop a run).
inline void install_flight_signal_from_env() noexcept {
  static const bool once = [] {
    const char* v = std::getenv("GRADSYNC_FLIGHT_SIGNAL");
    if (v == nullptr || *v == '\0') return true;
    const int signal = parse_signal(v);
    try {
      install_flight_signal(signal);
    } catch (const std::exception&) {
      std::string msg = "gradsync: GRADSYNC_FLIGHT_SIGNAL='" + std::string(v) +
                        "' names no signal that can be caught (USR1, USR2 or a number); no handler installed\n";
      std::fputs(msg.c_str(), stderr);
    }
    return true;
  }();
  (void)once;
}

}  // namespace gradsync::detail

namespace gradsync {

/// From now on, `signal` (SIGUSR1, say) makes every rank of this process
/// write its flight record, as a failing call does, into
/// $GRADSYNC_FLIGHT_DIR or the working directory; the reason in the file
/// is "signal". GRADSYNC_FLIGHT_SIGNAL=USR1 does the same without code.
/// It replaces any handler the program had for that signal.
inline void dump_flight_records_on(int signal) { detail::install_flight_signal(signal); }

}  // namespace gradsync

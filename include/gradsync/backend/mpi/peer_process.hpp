#pragma once
/// \file ProcessId: which process an Mpi rank on this host is, and whether it
/// is gone, told from outside it (see PeerWatch).

#if __has_include(<signal.h>) && __has_include(<unistd.h>)
#include <signal.h>
#include <unistd.h>
#define GRADSYNC_MPI_PEER_PROCESS 1
#endif

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace gradsync::detail::mpi {

/// A process on this host: its pid, and when it started (Linux's
/// /proc/<pid>/stat starttime, in clock ticks since boot; 0 where there is no
/// /proc). The start time tells a process from a later one that got its pid.
struct ProcessId {
  std::uint64_t pid = 0;
  std::uint64_t start = 0;
};

namespace process_detail {

/// What /proc says of `pid`: false if it has no entry; else its state letter
/// and start time (both 0 where the line cannot be read).
inline bool read_stat(std::uint64_t pid, char& state, std::uint64_t& start) noexcept {
  state = 0;
  start = 0;
  char path[48];
  std::snprintf(path, sizeof(path), "/proc/%llu/stat", static_cast<unsigned long long>(pid));
  std::FILE* f = std::fopen(path, "r");
  if (!f) return errno != ENOENT && errno != ESRCH;
  char line[1024];
  const std::size_t n = std::fread(line, 1, sizeof(line) - 1, f);
  std::fclose(f);
  line[n] = '\0';
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so
  // the fields are counted from its last ')'. starttime is field 22, the
  // 20th after the state.
  const char* p = std::strrchr(line, ')');
  if (!p || std::sscanf(p + 1, " %c", &state) != 1) return true;
  for (int field = 3; field <= 22 && p; ++field) p = std::strchr(p + 1, ' ');
  if (p) start = std::strtoull(p + 1, nullptr, 10);
  return true;
}

}  // namespace process_detail

/// This process.
inline ProcessId this_process() noexcept {
#ifdef GRADSYNC_MPI_PEER_PROCESS
  ProcessId me;
  me.pid = static_cast<std::uint64_t>(getpid());
  char state = 0;
  if (!process_detail::read_stat(me.pid, state, me.start)) me.start = 0;
  return me;
#else
  return {};
#endif
}

/// Whether `p` is the process this one sees under p.pid: false where pids
/// are not comparable or unknown (0). On Linux a peer may share the memory
/// segment from another pid namespace, where its pid names someone else here
/// or no one: so there the start times must match too, and no /proc means
/// no.
inline bool process_seen(ProcessId p) noexcept {
#ifdef GRADSYNC_MPI_PEER_PROCESS
  if (p.pid == 0 || (kill(static_cast<pid_t>(p.pid), 0) != 0 && errno == ESRCH)) return false;
#ifdef __linux__
  char state = 0;
  std::uint64_t start = 0;
  return p.start != 0 && process_detail::read_stat(p.pid, state, start) && start == p.start;
#else
  return true;
#endif
#else
  (void)p;
  return false;
#endif
}

/// Whether `p` (seen by process_seen once) has ended: no process has its pid
/// any more, it is a zombie (dead, not yet reaped), or its pid now names a
/// later process. Only ever true when certain; an unreadable /proc says no.
inline bool process_gone(ProcessId p) noexcept {
#ifdef GRADSYNC_MPI_PEER_PROCESS
  // EPERM: it exists, owned by someone else (then /proc still tells).
  if (kill(static_cast<pid_t>(p.pid), 0) != 0 && errno == ESRCH) return true;
  // A zombie still takes kill(0); /proc tells it, and a reused pid.
  if (p.start == 0) return false;
  char state = 0;
  std::uint64_t start = 0;
  if (!process_detail::read_stat(p.pid, state, start)) return true;
  if (state == 'Z' || state == 'X' || state == 'x') return true;
  return start != 0 && start != p.start;
#else
  (void)p;
  return false;
#endif
}

}  // namespace gradsync::detail::mpi

#pragma once
/// \file The memory Mpi ranks on one host share for their call agreement
/// and their failure flags: a slot per rank (see Control).

#include <mpi.h>
#if __has_include(<sys/mman.h>)
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#define GRADSYNC_MPI_SHARED_AGREEMENT 1
#endif

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "gradsync/backend/mpi/peer_process.hpp"

namespace gradsync::detail::mpi {

/// One rank's line of the shared segment: its hash for the calls of each
/// parity, which call it is (0: none yet), whether it has sent the others
/// its notice (raised before the first message leaves), and which process
/// it is (ProcessId, written once at mapping: see PeerWatch).
struct alignas(64) Slot {
  std::uint64_t seq[2] = {};
  std::uint64_t h[2] = {};
  std::uint64_t spoke = 0;
  std::uint64_t pid = 0;
  std::uint64_t start = 0;
};

/// Maps a segment of `size` slots that every rank of `comm` shares, if they
/// all run on this host (`one_host`) and can, and GRADSYNC_MPI_AGREEMENT is
/// not "messages" (in every rank's environment); collective. Null: they
/// cannot. `bytes` is set to the mapping's size.
inline Slot* map_shared_slots(MPI_Comm comm, int rank, int size, std::uint64_t nonce, bool one_host,
                              std::size_t& bytes) {
  int ok = one_host ? 1 : 0;
  if (const char* env = std::getenv("GRADSYNC_MPI_AGREEMENT"); env && std::string_view(env) == "messages") ok = 0;
#ifndef GRADSYNC_MPI_SHARED_AGREEMENT
  ok = 0;
#endif
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm);
  if (!ok) return nullptr;
#ifdef GRADSYNC_MPI_SHARED_AGREEMENT
  bytes = sizeof(Slot) * static_cast<std::size_t>(size);
  // Rank 0 creates it under a name no other communicator has; the others
  // open it, and once all have, rank 0 unlinks the name.
  char name[64] = {};
  int fd = -1;
  if (rank == 0) {
    std::snprintf(name, sizeof(name), "/gradsync-%ld-%016llx", static_cast<long>(getpid()),
                  static_cast<unsigned long long>(nonce));
    fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      close(fd);
      shm_unlink(name);
      fd = -1;
    }
    if (fd < 0) name[0] = '\0';
  }
  MPI_Bcast(name, sizeof(name), MPI_CHAR, 0, comm);
  if (rank != 0 && name[0]) fd = shm_open(name, O_RDWR, 0600);
  void* p = fd >= 0 ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (fd >= 0) close(fd);
  ok = p != MAP_FAILED ? 1 : 0;
  // Before the collective below, after which the others read it.
  if (ok) {
    Slot& mine = static_cast<Slot*>(p)[rank];
    const ProcessId me = this_process();
    std::atomic_ref<std::uint64_t>(mine.pid).store(me.pid, std::memory_order_release);
    std::atomic_ref<std::uint64_t>(mine.start).store(me.start, std::memory_order_release);
  }
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm);
  if (rank == 0 && name[0]) shm_unlink(name);
  if (!ok) {
    if (p != MAP_FAILED) munmap(p, bytes);
    return nullptr;
  }
  return static_cast<Slot*>(p);
#else
  (void)rank;
  (void)size;
  (void)nonce;
  (void)bytes;
  return nullptr;
#endif
}

/// Unmaps this rank's view of the segment (the peers keep theirs); null is
/// nothing to do.
inline void unmap_shared_slots(Slot*& slots, std::size_t bytes) noexcept {
#ifdef GRADSYNC_MPI_SHARED_AGREEMENT
  if (slots) munmap(slots, bytes);
#else
  (void)bytes;
#endif
  slots = nullptr;
}

}  // namespace gradsync::detail::mpi

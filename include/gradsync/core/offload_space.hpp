#pragma once
/// \file OffloadSpace: the memory a trainer offloads its shards into, and the copies across.

#include <cstddef>

namespace gradsync {

/// Where a trainer keeps what it offloads (ShardedTrainerOptions::offload):
/// the master parameter shard and the gradient shard live in allocations of
/// this space, and reach the compute side (the memory the backend's
/// collectives read and write) only through copy_in and copy_out. Its
/// memory must be readable and writable by the host, since the optimizer
/// steps there on flat spans (pinned host memory for a GPU backend).
///
/// A space is used from two threads, never at once: the rank's thread
/// allocates and steps the optimizer, the communicator's progress worker
/// copies. Copies may be asynchronous; wait() returns once every copy this
/// space was asked for has completed.
class OffloadSpace {
 public:
  virtual ~OffloadSpace() = default;

  /// A name for messages ("host stand-in", "pinned host").
  virtual const char* name() const noexcept = 0;
  /// `bytes` of this space, aligned to 64 bytes and zeroed.
  virtual void* allocate(std::size_t bytes) = 0;
  /// Returns what allocate(bytes) gave.
  virtual void deallocate(void* p, std::size_t bytes) noexcept = 0;
  /// `bytes` from this space (`offloaded`) to the compute side (`compute`).
  virtual void copy_in(void* compute, const void* offloaded, std::size_t bytes) = 0;
  /// `bytes` from the compute side (`compute`) to this space (`offloaded`).
  virtual void copy_out(void* offloaded, const void* compute, std::size_t bytes) = 0;
  /// Waits until every copy issued so far has completed.
  virtual void wait() = 0;
};

}  // namespace gradsync

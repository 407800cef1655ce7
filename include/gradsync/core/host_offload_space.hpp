#pragma once
/// \file HostOffloadSpace: an OffloadSpace in separate host allocations, for host backends and tests.

#include <atomic>
#include <cstddef>
#include <cstring>
#include <new>

#include "gradsync/core/offload_space.hpp"

namespace gradsync {

/// Offload on a host backend (Threads, Mpi): the offloaded shards live in
/// allocations of their own, apart from the compute side's buffers, and
/// every crossing is an explicit copy that this space counts. It exercises
/// the data path a GPU's pinned host memory takes (what is copied, when, by
/// whom) where there is no device; it saves no memory, since both sides are
/// the same host's.
class HostOffloadSpace final : public OffloadSpace {
 public:
  const char* name() const noexcept override { return "host stand-in"; }

  void* allocate(std::size_t bytes) override {
    void* p = ::operator new(bytes == 0 ? 1 : bytes, std::align_val_t{64});
    std::memset(p, 0, bytes);
    allocated_.fetch_add(bytes, std::memory_order_relaxed);
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    if (p == nullptr) return;
    ::operator delete(p, std::align_val_t{64});
    allocated_.fetch_sub(bytes, std::memory_order_relaxed);
  }
  void copy_in(void* compute, const void* offloaded, std::size_t bytes) override {
    if (bytes != 0) std::memcpy(compute, offloaded, bytes);
    copied_in_.fetch_add(bytes, std::memory_order_relaxed);
  }
  void copy_out(void* offloaded, const void* compute, std::size_t bytes) override {
    if (bytes != 0) std::memcpy(offloaded, compute, bytes);
    copied_out_.fetch_add(bytes, std::memory_order_relaxed);
  }
  void wait() override {}

  /// Bytes copied to the compute side, and back, since construction.
  std::size_t copied_in() const noexcept { return copied_in_.load(std::memory_order_relaxed); }
  std::size_t copied_out() const noexcept { return copied_out_.load(std::memory_order_relaxed); }
  /// Bytes allocated and not yet returned.
  std::size_t allocated() const noexcept { return allocated_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::size_t> copied_in_{0}, copied_out_{0}, allocated_{0};
};

}  // namespace gradsync

#pragma once
/// \file What a backend can do beyond the Endpoint concept, declared in one place.
///
/// The Endpoint concept (core/backend.hpp) is what every backend must do.
/// Everything optional, and where the backend's buffers live, is declared by
/// the backend policy as one `static constexpr Capabilities capabilities`
/// and read through `backend_traits<B>`: code above the backends asks the
/// traits, never probes an endpoint for a member.

#include <cstdint>

#include "gradsync/core/backend.hpp"

namespace gradsync {

/// Where a backend's collectives read and write: host memory (Threads, Mpi)
/// or the memory of one GPU (Nccl).
enum class MemorySpace : std::uint8_t { host, device };

/// A backend's optional abilities; each defaults to "no".
struct Capabilities {
  MemorySpace memory_space = MemorySpace::host;
  /// The endpoint has native_all_reduce/reduce_scatter/all_gather/broadcast.
  bool native_collectives = false;
  /// Native reductions combine contributions in rank order, so the
  /// deterministic option may use them as they are.
  bool native_rank_ordered = false;
  /// The backend knows which ranks share a host (Communicator::local_rank).
  bool knows_hosts = false;
  /// Communicator::split(color, key) makes sub-communicators.
  bool split = false;
};

/// The capabilities of backend `B`, as its policy declares them.
template <Backend B>
struct backend_traits {
  static constexpr Capabilities capabilities = [] {
    if constexpr (requires { B::capabilities; }) {
      return Capabilities(B::capabilities);
    } else {
      return Capabilities{};
    }
  }();
  static constexpr MemorySpace memory_space = capabilities.memory_space;
  static constexpr bool native_collectives = capabilities.native_collectives;
  static constexpr bool native_rank_ordered = capabilities.native_rank_ordered;
  static constexpr bool knows_hosts = capabilities.knows_hosts;
  static constexpr bool split = capabilities.split;
  static constexpr bool host_memory = memory_space == MemorySpace::host;
};

}  // namespace gradsync

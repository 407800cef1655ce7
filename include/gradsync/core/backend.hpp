#pragma once
/// \file The one concept a backend satisfies.
///
/// A backend is a type with an `Endpoint`: one rank's view of the transport.
/// Algorithms are written once against it: they post sends, receives and
/// receive-and-reduce operations tagged within the current call, then wait
/// for them to complete one at a time. Buffers are type-erased (pointer,
/// count, DataType) because an MPI or NCCL transport needs the type at run
/// time anyway and a device backend cannot take a host function pointer.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync {

/// What an algorithm may ask of one rank's transport.
template <class E>
concept Endpoint = requires(E& e, const E& ce, const detail::CallInfo& call, void* p, const void* cp, std::size_t n,
                            DataType t, OpKind op, int peer, std::uint32_t tag, std::chrono::nanoseconds timeout) {
  { ce.rank() } -> std::convertible_to<int>;
  { ce.size() } -> std::convertible_to<int>;
  /// Starts sending n elements at cp to peer; completes when the data is out of cp.
  e.post_send(cp, n, t, peer, tag, tag, call);
  /// Starts receiving n elements from peer into p; with a reduce op, p = op(p, incoming).
  e.post_recv(p, n, t, peer, tag, tag, call, op, true);
  /// Blocks until one posted operation completes and returns its token.
  { e.wait_any(call, timeout) } -> std::same_as<std::uint32_t>;
  { ce.pending() } -> std::convertible_to<std::size_t>;
  e.barrier(call, timeout);
  /// Local work on buffers in the backend's memory space.
  e.local_copy(p, cp, n, t);
  e.local_reduce(p, cp, n, t, op);
  e.local_finish(p, n, t, op);
  /// Abandons pending operations and tells the other ranks this rank failed,
  /// and how (so a disagreement reads as one on every rank).
  e.fail(call, std::string_view{}, detail::FailureKind{});
};

/// A backend policy: a type naming its Endpoint, e.g. `gradsync::Threads`.
template <class B>
concept Backend = requires { typename B::Endpoint; } && Endpoint<typename B::Endpoint>;

}  // namespace gradsync

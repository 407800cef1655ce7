#pragma once
/// \file Native: the backend's own collectives.

#include <span>

#include "gradsync/algorithm/algorithm.hpp"
#include "gradsync/algorithm/tags.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/ops.hpp"

namespace gradsync::detail {

/// Whether backend B's endpoint has its own collectives.
template <class B>
concept HasNative = requires(typename B::Endpoint& e, const float* in, float* out, const CallInfo& call) {
  e.template native_all_reduce<Sum>(in, out, call, std::chrono::nanoseconds{});
  e.template native_reduce_scatter<Sum>(in, out, call, std::chrono::nanoseconds{});
  e.native_all_gather(in, out, call, std::chrono::nanoseconds{});
  e.native_broadcast(out, call, std::chrono::nanoseconds{});
};

template <>
struct Algorithm<Native> {
  template <class B>
  static constexpr void require() {
    static_assert(HasNative<B>,
                  "gradsync: this backend has no Native collectives; use Ring, Tree or RecursiveHalvingDoubling");
  }

  /// Native reductions are rank-ordered on every backend that provides them
  /// here (the Threads path folds rank 0..N-1), so `deterministic` holds.
  template <ReduceOp Op, class B, class T>
  static void all_reduce(Communicator<B>& comm, std::span<const T> in, std::span<T> out, const Options&) {
    require<B>();
    comm.endpoint().template native_all_reduce<Op>(in.data(), out.data(), comm.call(), comm.timeout());
  }
  template <ReduceOp Op, class B, class T>
  static void reduce_scatter(Communicator<B>& comm, std::span<const T> in, std::span<T> out, const Options&) {
    require<B>();
    comm.endpoint().template native_reduce_scatter<Op>(in.data(), out.data(), comm.call(), comm.timeout());
  }
  template <class B, class T>
  static void all_gather(Communicator<B>& comm, std::span<const T> in, std::span<T> out, const Options&) {
    require<B>();
    comm.endpoint().native_all_gather(in.data(), out.data(), comm.call(), comm.timeout());
  }
  template <class B, class T>
  static void broadcast(Communicator<B>& comm, std::span<T> buf, int, const Options&) {
    require<B>();
    comm.endpoint().native_broadcast(buf.data(), comm.call(), comm.timeout());
  }
};

}  // namespace gradsync::detail

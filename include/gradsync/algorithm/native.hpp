#pragma once
/// \file Native: the backend's own collectives.

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "gradsync/algorithm/algorithm.hpp"
#include "gradsync/algorithm/ordered_reduce_scatter.hpp"
#include "gradsync/algorithm/tags.hpp"
#include "gradsync/core/backend_traits.hpp"
#include "gradsync/core/buffer.hpp"
#include "gradsync/core/call_view.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/partition.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/core/visit.hpp"

namespace gradsync::detail {

/// The members Native calls on an endpoint.
template <class E>
concept NativeEndpoint = requires(E& e, const float* in, float* out, const CallInfo& call) {
  e.native_all_reduce(in, out, call, std::chrono::nanoseconds{});
  e.native_reduce_scatter(in, out, call, std::chrono::nanoseconds{});
  e.native_all_gather(in, out, call, std::chrono::nanoseconds{});
  e.native_broadcast(out, call, std::chrono::nanoseconds{});
};

/// Whether backend B has its own collectives, as its Capabilities declare.
template <class B>
concept HasNative = backend_traits<B>::native_collectives;

template <>
struct Algorithm<Native> {
  template <class B>
  static constexpr void require() {
    static_assert(HasNative<B>,
                  "gradsync: this backend has no Native collectives; use Ring, Tree or RecursiveHalvingDoubling");
    static_assert(!HasNative<B> || NativeEndpoint<typename B::Endpoint>,
                  "gradsync: this backend declares native_collectives but its Endpoint lacks native_all_reduce, "
                  "native_reduce_scatter, native_all_gather or native_broadcast");
  }

  /// The Threads path folds ranks 0..N-1 in order, so `deterministic` holds
  /// as is. A backend whose own reduction order is its business (MPI) leaves
  /// Capabilities::native_rank_ordered false; there, deterministic calls reduce with
  /// the rank-ordered reduce-scatter and distribute with the native all-gather.
  /// The op travels in the call (comm.call().op), which the backend reads.
  template <class B>
  static void all_reduce(CallView<B>& comm, ConstBuffer in, Buffer out, OpKind op,
                         const Options& opt) {
    require<B>();
    if (opt.deterministic && !rank_ordered<B>()) return ordered_all_reduce(comm, in, out, op);
    visit(out.type(), [&]<class T>(T) {
      comm.endpoint().native_all_reduce(static_cast<const T*>(in.data()), static_cast<T*>(out.data()), comm.call(),
                                        comm.timeout());
    });
  }
  template <class B>
  static void reduce_scatter(CallView<B>& comm, ConstBuffer in, Buffer out, OpKind op,
                             const Options& opt) {
    require<B>();
    if (opt.deterministic && !rank_ordered<B>()) {
      return ordered_reduce_scatter(comm, in, out, op, EqualBlocks{out.size()});
    }
    visit(out.type(), [&]<class T>(T) {
      comm.endpoint().native_reduce_scatter(static_cast<const T*>(in.data()), static_cast<T*>(out.data()), comm.call(),
                                            comm.timeout());
    });
  }
  template <class B>
  static void all_gather(CallView<B>& comm, ConstBuffer in, Buffer out, const Options&) {
    require<B>();
    native_all_gather(comm, in, out, comm.call());
  }
  template <class B>
  static void broadcast(CallView<B>& comm, Buffer buf, int, const Options&) {
    require<B>();
    visit(buf.type(), [&]<class T>(T) {
      comm.endpoint().native_broadcast(static_cast<T*>(buf.data()), comm.call(), comm.timeout());
    });
  }

 private:
  template <class B>
  static void native_all_gather(CallView<B>& comm, ConstBuffer in, Buffer out, const CallInfo& call) {
    visit(out.type(), [&]<class T>(T) {
      comm.endpoint().native_all_gather(static_cast<const T*>(in.data()), static_cast<T*>(out.data()), call,
                                        comm.timeout());
    });
  }

  template <class B>
  static constexpr bool rank_ordered() {
    return backend_traits<B>::native_rank_ordered;
  }

  /// Rank-ordered reduce-scatter into a padded buffer (blocks of ceil(n/p)),
  /// then the backend's all-gather, then unpadding.
  template <class B>
  static void ordered_all_reduce(CallView<B>& comm, ConstBuffer in, Buffer out, OpKind op) {
    const auto p = static_cast<std::size_t>(comm.size());
    const std::size_t n = in.size();
    const std::size_t m = (n + p - 1) / p;
    auto padded = comm.scratch(in.type(), m * p, 2);
    const auto r = static_cast<std::size_t>(comm.rank());
    const Range mine = block(n, p, r);
    ordered_reduce_scatter(comm, in, padded.subspan(r * m, mine.size()), op,
                           [&](int q) { return block(n, p, static_cast<std::size_t>(q)); });
    CallInfo gather = comm.call();
    gather.collective = Collective::all_gather;
    gather.count = m;
    native_all_gather(comm, padded.subspan(r * m, m), padded, gather);
    for (std::size_t q = 0; q < p; ++q) {
      const Range b = block(n, p, q);
      comm.copy(out.subspan(b.begin, b.size()), ConstBuffer(padded.subspan(q * m, b.size())));
    }
  }
};

}  // namespace gradsync::detail

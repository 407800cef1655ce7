#pragma once
/// \file NativeCollectives: the Threads endpoint's own collectives, worked
/// straight on the ranks' shared memory.
///
/// Threads has no library underneath whose collectives it could call, so
/// Native here is gradsync's own shared-memory path. The endpoint runs the
/// call (Endpoint::native_call, which split shares): each rank publishes its
/// buffers, a barrier makes them visible and the calls are compared, every
/// rank works on its own slice of everyone's buffers, and a closing barrier
/// keeps the buffers alive until all are done. This header holds that work,
/// one collective at a time.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>

#include "gradsync/backend/threads/world.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/partition.hpp"
#include "gradsync/core/visit.hpp"

namespace gradsync::detail::threads {

/// The native_* members the Native algorithm calls, mixed into `Self` (the
/// Threads Endpoint, which befriends it): they run inside Self::native_call
/// and read the peers' buffers from Self's World.
template <class Self>
class NativeCollectives {
 public:
  template <class T>
  void native_all_reduce(const T* in, T* out, const CallInfo& call, std::chrono::nanoseconds timeout) {
    with_op(call.op, [&]<class Op>() {
      self().native_call(in, out, call, timeout, [&] { all_reduce_slice<Op, T>(call); });
    });
  }

  template <class T>
  void native_reduce_scatter(const T* in, T* out, const CallInfo& call, std::chrono::nanoseconds timeout) {
    with_op(call.op, [&]<class Op>() {
      self().native_call(in, out, call, timeout, [&] { reduce_scatter_slice<Op>(out, call); });
    });
  }

  template <class T>
  void native_all_gather(const T* in, T* out, const CallInfo& call, std::chrono::nanoseconds timeout) {
    self().native_call(in, out, call, timeout, [&] {
      for (int q = 0; q < self().size(); ++q) {
        const T* src = static_cast<const T*>(slot(q).in);
        T* dst = out + call.count * static_cast<std::size_t>(q);
        // In place, our own block is already there, and others are reading it.
        if (src != dst) std::copy(src, src + call.count, dst);
      }
    });
  }

  template <class T>
  void native_broadcast(T* buf, const CallInfo& call, std::chrono::nanoseconds timeout) {
    self().native_call(buf, buf, call, timeout, [&] {
      if (self().rank() != call.root) {
        const T* src = static_cast<const T*>(slot(call.root).in);
        std::copy(src, src + call.count, buf);
      }
    });
  }

 private:
  Self& self() noexcept { return static_cast<Self&>(*this); }
  /// What rank q published for the Native call under way.
  NativeSlot& slot(int q) noexcept { return self().world_->slot(q); }

  /// Calls f.template operator()<Op>() for the op type of `kind`, so the
  /// element loops below are compiled per op, not dispatched per element.
  template <class F>
  static void with_op(OpKind kind, F&& f) {
    visit(kind, [&]<class Op>(Op) { f.template operator()<Op>(); });
  }

  template <ReduceOp Op, class T>
  void all_reduce_slice(const CallInfo& call) {
    const int n = self().size();
    const Range mine = block(call.count, static_cast<std::size_t>(n), static_cast<std::size_t>(self().rank()));
    // In place, rank r's output is rank r's input, so the sum is built in a
    // small tile first and only then written to every rank's output.
    constexpr std::size_t tile = 16384 / sizeof(T);
    alignas(64) std::array<T, tile> acc;
    for (std::size_t b = mine.begin; b < mine.end; b += tile) {
      const std::size_t len = std::min(tile, mine.end - b);
      const T* src0 = static_cast<const T*>(slot(0).in) + b;
      std::copy(src0, src0 + len, acc.data());
      for (int q = 1; q < n; ++q) reduce_into<Op>(acc.data(), static_cast<const T*>(slot(q).in) + b, len);
      finish<Op>(acc.data(), len, n);
      for (int q = 0; q < n; ++q) std::copy(acc.data(), acc.data() + len, static_cast<T*>(slot(q).out) + b);
    }
  }

  template <ReduceOp Op, class T>
  void reduce_scatter_slice(T* out, const CallInfo& call) {
    const int n = self().size();
    const std::size_t off = call.count * static_cast<std::size_t>(self().rank());
    constexpr std::size_t tile = 16384 / sizeof(T);
    for (std::size_t b = 0; b < call.count; b += tile) {
      const std::size_t len = std::min(tile, call.count - b);
      const T* src0 = static_cast<const T*>(slot(0).in) + off + b;
      std::copy(src0, src0 + len, out + b);
      for (int q = 1; q < n; ++q) reduce_into<Op>(out + b, static_cast<const T*>(slot(q).in) + off + b, len);
      finish<Op>(out + b, len, n);
    }
  }
};

}  // namespace gradsync::detail::threads

#pragma once
/// \file Communicator<Backend>: what every primitive takes.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/core/backend.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync {

/// One rank's handle on a group of ranks, over backend `B`.
///
/// It owns the backend's endpoint, the deadline every wait uses, and the
/// sequence number of the current call (for diagnostics). The typed
/// point-to-point members below are what algorithms are written against;
/// user code calls the primitives instead.
template <Backend B>
class Communicator {
 public:
  using backend_type = B;
  using endpoint_type = typename B::Endpoint;
  using duration = std::chrono::nanoseconds;

  /// 300 s: long enough for any real collective, short enough that a lost
  /// rank ends the job rather than the job's allocation.
  static constexpr duration default_timeout = std::chrono::seconds(300);

  explicit Communicator(endpoint_type endpoint) : ep_(std::move(endpoint)) {}
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  /// Movable while idle, so factories can return several (one per GPU).
  Communicator(Communicator&&) = default;

  int rank() const noexcept { return ep_.rank(); }
  int size() const noexcept { return ep_.size(); }

  /// Rank among the ranks on this host, where the backend knows hosts (Mpi).
  int local_rank() const noexcept
    requires requires(const endpoint_type& e) { e.local_rank(); }
  {
    return ep_.local_rank();
  }

  /// The deadline of every wait inside a collective on this communicator.
  duration timeout() const noexcept { return timeout_; }
  template <class Rep, class Period>
  void set_timeout(std::chrono::duration<Rep, Period> t) {
    if (t <= t.zero()) throw InvalidArgument("gradsync: set_timeout expects a positive duration");
    timeout_ = std::chrono::duration_cast<duration>(t);
  }

  /// Blocks until every rank has called barrier().
  void barrier() {
    run(detail::CallInfo{}, [&](const detail::CallInfo& call) { ep_.barrier(call, timeout_); });
  }

  /// Number of collectives started on this communicator.
  std::uint64_t sequence() const noexcept { return seq_; }

  endpoint_type& endpoint() noexcept { return ep_; }

  /// Runs one collective: stamps it with the next sequence number, and if it
  /// throws, abandons what is in flight and tells the other ranks, so they
  /// fail fast instead of waiting out the deadline.
  template <class F>
  void run(detail::CallInfo call, F&& body) {
    call.seq = ++seq_;
    call_ = call;
    try {
      std::forward<F>(body)(call_);
    } catch (const std::exception& e) {
      ep_.fail(call_, e.what());
      throw;
    } catch (...) {
      ep_.fail(call_, "unknown exception");
      throw;
    }
  }

  // Point-to-point within the current call, for algorithms.

  template <Element T>
  void send(std::span<const T> data, int peer, std::uint32_t tag, std::uint32_t token = 0) {
    ep_.post_send(data.data(), data.size(), data_type_v<T>, peer, tag, token, call_);
  }
  template <Element T>
  void recv(std::span<T> data, int peer, std::uint32_t tag, std::uint32_t token = 0) {
    ep_.post_recv(data.data(), data.size(), data_type_v<T>, peer, tag, token, call_, OpKind::sum, false);
  }
  /// Receives into `data` reducing as it lands: data = op(data, incoming).
  template <Element T>
  void recv_reduce(std::span<T> data, int peer, std::uint32_t tag, std::uint32_t token, OpKind op) {
    ep_.post_recv(data.data(), data.size(), data_type_v<T>, peer, tag, token, call_, op, true);
  }
  /// Token of one completed operation.
  std::uint32_t wait_any() { return ep_.wait_any(call_, timeout_); }
  void wait_all() {
    while (ep_.pending()) ep_.wait_any(call_, timeout_);
  }
  std::size_t pending() const noexcept { return ep_.pending(); }

  template <Element T>
  void copy(std::span<T> dst, std::span<const T> src) {
    ep_.local_copy(dst.data(), src.data(), src.size(), data_type_v<T>);
  }
  template <Element T>
  void reduce(std::span<T> dst, std::span<const T> src, OpKind op) {
    ep_.local_reduce(dst.data(), src.data(), src.size(), data_type_v<T>, op);
  }
  /// Avg's division by the world size; nothing for other ops.
  template <Element T>
  void finish(std::span<T> data, OpKind op) {
    ep_.local_finish(data.data(), data.size(), data_type_v<T>, op);
  }

  const detail::CallInfo& call() const noexcept { return call_; }

  /// A reusable work buffer of `count` elements. Buffers are kept per slot and
  /// only grow: fresh memory costs far more to touch than to reuse.
  template <Element T>
  std::span<T> scratch(std::size_t count, std::size_t slot = 0) {
    // A device backend keeps work buffers in its own memory space.
    if constexpr (requires { ep_.scratch(count, slot); }) {
      return {static_cast<T*>(ep_.scratch(count * sizeof(T), slot)), count};
    }
    if (slot >= scratch_.size()) scratch_.resize(slot + 1);
    Scratch& s = scratch_[slot];
    const std::size_t bytes = count * sizeof(T);
    if (s.bytes < bytes) {
      s.data.reset(static_cast<std::byte*>(::operator new(bytes, std::align_val_t{64})));
      s.bytes = bytes;
    }
    return {reinterpret_cast<T*>(s.data.get()), count};
  }

 private:
  struct AlignedDelete {
    void operator()(std::byte* p) const noexcept { ::operator delete(p, std::align_val_t{64}); }
  };
  struct Scratch {
    std::unique_ptr<std::byte, AlignedDelete> data;
    std::size_t bytes = 0;
  };

  endpoint_type ep_;
  duration timeout_ = default_timeout;
  std::uint64_t seq_ = 0;
  detail::CallInfo call_{};
  std::vector<Scratch> scratch_;
};

}  // namespace gradsync

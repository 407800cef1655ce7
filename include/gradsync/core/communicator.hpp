#pragma once
/// \file Communicator<Backend>: what every primitive takes.

#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/core/backend.hpp"
#include "gradsync/core/buffer.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
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

  static constexpr duration default_timeout = detail::default_timeout;

  /// Builds the backend's endpoint from `args`: an endpoint itself, or what
  /// the endpoint is made from (`Communicator<Mpi> comm(MPI_COMM_WORLD)`,
  /// optionally followed by the backend's options).
  template <class... Args>
    requires std::constructible_from<endpoint_type, Args&&...>
  explicit Communicator(Args&&... args) : ep_(std::forward<Args>(args)...) {}
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  /// Movable while idle, so factories can return several (one per GPU).
  Communicator(Communicator&& o) noexcept(std::is_nothrow_move_constructible_v<endpoint_type>)
      : ep_(std::move(o.ep_)),
        timeout_(o.timeout_),
        seq_(o.seq_),
        call_(o.call_),
        scratch_(std::move(o.scratch_)),
        failure_(std::move(o.failure_)) {}

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

  /// Whether a collective on this communicator has failed; it then refuses
  /// every later call at once (see run()).
  bool failed() const noexcept { return !failure_.empty(); }

  /// Runs one collective: stamps it with the next sequence number, and if it
  /// throws, abandons what is in flight and tells the other ranks, so they
  /// fail fast instead of waiting out the deadline. A communicator whose call
  /// failed refuses the next ones at once (Aborted, naming that failure): its
  /// peers may be anywhere in the sequence, so nothing later can match.
  template <class F>
  void run(detail::CallInfo call, F&& body) {
    if (!failure_.empty()) {
      throw Aborted("gradsync: rank " + std::to_string(rank()) + ": " + describe_next(call) +
                    " refused: this communicator failed earlier and cannot be used again (" + failure_ + ")");
    }
    // Two threads in one communicator would interleave sequence numbers and
    // messages; one atomic exchange per call says so instead of a confusing
    // mismatch or a hang later.
    if (busy_.exchange(true, std::memory_order_acquire)) {
      // The other thread owns the sequence number; this call gets none.
      throw InvalidArgument("gradsync: rank " + std::to_string(rank()) + ": Communicator used from two threads at once (" +
                            describe(call) +
                            " started while another call was in progress); a communicator serves one thread at a "
                            "time: give each thread its own communicator");
    }
    struct Release {
      std::atomic<bool>& busy;
      ~Release() { busy.store(false, std::memory_order_release); }
    } release{busy_};
    call.seq = ++seq_;
    call_ = call;
    try {
      if constexpr (requires { ep_.begin_call(call_, timeout_); }) ep_.begin_call(call_, timeout_);
      std::forward<F>(body)(call_);
      if constexpr (requires { ep_.end_call(call_, timeout_); }) ep_.end_call(call_, timeout_);
    } catch (const std::exception& e) {
      record_failure(detail::current_failure_kind(), e.what());
      throw;
    } catch (...) {
      record_failure(detail::FailureKind::error, "unknown exception");
      throw;
    }
  }

  // Point-to-point within the current call, for algorithms: buffers are
  // type-erased (see detail::Buffer), so an algorithm is compiled once per
  // backend, not once per element type.

  void send(detail::ConstBuffer data, int peer, std::uint32_t tag, std::uint32_t token = 0) {
    ep_.post_send(data.data(), data.size(), data.type(), peer, tag, token, call_);
  }
  void recv(detail::Buffer data, int peer, std::uint32_t tag, std::uint32_t token = 0) {
    ep_.post_recv(data.data(), data.size(), data.type(), peer, tag, token, call_, OpKind::sum, false);
  }
  /// Receives into `data` reducing as it lands: data = op(data, incoming).
  void recv_reduce(detail::Buffer data, int peer, std::uint32_t tag, std::uint32_t token, OpKind op) {
    ep_.post_recv(data.data(), data.size(), data.type(), peer, tag, token, call_, op, true);
  }
  /// Token of one completed operation.
  std::uint32_t wait_any() { return ep_.wait_any(call_, timeout_); }
  void wait_all() {
    while (ep_.pending()) ep_.wait_any(call_, timeout_);
  }
  std::size_t pending() const noexcept { return ep_.pending(); }

  void copy(detail::Buffer dst, detail::ConstBuffer src) { ep_.local_copy(dst.data(), src.data(), src.size(), src.type()); }
  void reduce(detail::Buffer dst, detail::ConstBuffer src, OpKind op) {
    ep_.local_reduce(dst.data(), src.data(), src.size(), src.type(), op);
  }
  /// Avg's division by the world size; nothing for other ops.
  void finish(detail::Buffer data, OpKind op) { ep_.local_finish(data.data(), data.size(), data.type(), op); }

  const detail::CallInfo& call() const noexcept { return call_; }

  /// A reusable work buffer of `count` elements of `type`. Buffers are kept
  /// per slot and only grow: fresh memory costs far more to touch than to reuse.
  detail::Buffer scratch(DataType type, std::size_t count, std::size_t slot = 0) {
    const std::size_t bytes = count * detail::size_of(type);
    // A device backend keeps work buffers in its own memory space.
    if constexpr (requires { ep_.scratch(bytes, slot); }) {
      return {ep_.scratch(bytes, slot), count, type};
    }
    if (slot >= scratch_.size()) scratch_.resize(slot + 1);
    Scratch& s = scratch_[slot];
    if (s.bytes < bytes) {
      s.data.reset(static_cast<std::byte*>(::operator new(bytes, std::align_val_t{64})));
      s.bytes = bytes;
    }
    return {s.data.get(), count, type};
  }

 private:
  struct AlignedDelete {
    void operator()(std::byte* p) const noexcept { ::operator delete(p, std::align_val_t{64}); }
  };
  struct Scratch {
    std::unique_ptr<std::byte, AlignedDelete> data;
    std::size_t bytes = 0;
  };

  std::string describe_next(detail::CallInfo call) const {
    call.seq = seq_ + 1;
    return describe(call);
  }

  void record_failure(detail::FailureKind kind, const char* what) noexcept {
    try {
      failure_ = describe(call_) + " failed: " + what;
    } catch (...) {
      failure_ = "a call failed";
    }
    ep_.fail(call_, what, kind);
  }

  endpoint_type ep_;
  duration timeout_ = default_timeout;
  std::uint64_t seq_ = 0;
  detail::CallInfo call_{};
  std::vector<Scratch> scratch_;
  std::string failure_;  ///< empty until a call fails
  std::atomic<bool> busy_{false};
};

}  // namespace gradsync

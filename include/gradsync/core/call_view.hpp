#pragma once
/// \file CallView<B>: what an algorithm sees of one call.
///
/// The user's Communicator offers what a user needs; an algorithm gets this
/// view for the duration of one collective instead: the call's identity, the
/// rank's point-to-point transport within the call, local copy/reduce/finish,
/// and scratch. Buffers are type-erased (see Buffer), so an algorithm is
/// compiled once per backend, not once per element type.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

#include "gradsync/core/backend.hpp"
#include "gradsync/core/backend_traits.hpp"
#include "gradsync/core/buffer.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/local_reduce.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync::detail {

/// Host work buffers kept per slot across calls. They only grow: fresh
/// memory costs far more to touch than to reuse.
class ScratchPool {
 public:
  void* get(std::size_t bytes, std::size_t slot) {
    if (slot >= slots_.size()) slots_.resize(slot + 1);
    Slot& s = slots_[slot];
    if (s.bytes < bytes) {
      s.data.reset(static_cast<std::byte*>(::operator new(bytes, std::align_val_t{64})));
      s.bytes = bytes;
    }
    return s.data.get();
  }

 private:
  struct AlignedDelete {
    void operator()(std::byte* p) const noexcept { ::operator delete(p, std::align_val_t{64}); }
  };
  struct Slot {
    std::unique_ptr<std::byte, AlignedDelete> data;
    std::size_t bytes = 0;
  };
  std::vector<Slot> slots_;
};

/// One collective call as an algorithm sees it. Made by Communicator for
/// the duration of the call; cheap to copy, valid only inside it.
template <Backend B>
class CallView {
 public:
  using endpoint_type = typename B::Endpoint;

  CallView(endpoint_type& ep, const CallInfo& call, std::chrono::nanoseconds timeout, ScratchPool& pool) noexcept
      : ep_(&ep), call_(&call), timeout_(timeout), pool_(&pool) {}

  int rank() const noexcept { return ep_->rank(); }
  int size() const noexcept { return ep_->size(); }
  /// The call's identity: collective, sequence number, count, type, op, ...
  const CallInfo& call() const noexcept { return *call_; }
  /// The deadline of every wait in this call.
  std::chrono::nanoseconds timeout() const noexcept { return timeout_; }
  /// The backend's own endpoint (the Native algorithm calls its collectives).
  endpoint_type& endpoint() const noexcept { return *ep_; }

  void send(ConstBuffer data, int peer, std::uint32_t tag, std::uint32_t token = 0) const {
    ep_->post_send(data.data(), data.size(), data.type(), peer, tag, token, *call_);
  }
  void recv(Buffer data, int peer, std::uint32_t tag, std::uint32_t token = 0) const {
    ep_->post_recv(data.data(), data.size(), data.type(), peer, tag, token, *call_, OpKind::sum, false);
  }
  /// Receives into `data` reducing as it lands: data = op(data, incoming).
  void recv_reduce(Buffer data, int peer, std::uint32_t tag, std::uint32_t token, OpKind op) const {
    ep_->post_recv(data.data(), data.size(), data.type(), peer, tag, token, *call_, op, true);
  }
  /// Token of one completed operation.
  std::uint32_t wait_any() const { return ep_->wait_any(*call_, timeout_); }
  void wait_all() const {
    while (ep_->pending()) ep_->wait_any(*call_, timeout_);
  }
  std::size_t pending() const noexcept { return ep_->pending(); }

  void copy(Buffer dst, ConstBuffer src) const { ep_->local_copy(dst.data(), src.data(), src.size(), src.type()); }
  void reduce(Buffer dst, ConstBuffer src, OpKind op) const {
    ep_->local_reduce(dst.data(), src.data(), src.size(), src.type(), op);
  }
  /// Avg's division by the world size; nothing for other ops.
  void finish(Buffer data, OpKind op) const { ep_->local_finish(data.data(), data.size(), data.type(), op); }

  /// A reusable work buffer of `count` elements of `type`, one per slot.
  Buffer scratch(DataType type, std::size_t count, std::size_t slot = 0) const {
    const std::size_t bytes = count * size_of(type);
    // A hook, not a capability: an endpoint whose buffers are not plain host
    // memory hands out work buffers in its own memory space; the rest share
    // the communicator's host pool. A device backend must have it.
    static_assert(backend_traits<B>::host_memory || requires { ep_->scratch(bytes, slot); },
                  "gradsync: a backend whose memory space is device needs Endpoint::scratch(bytes, slot)");
    if constexpr (requires { ep_->scratch(bytes, slot); }) {
      return {ep_->scratch(bytes, slot), count, type};
    } else {
      return {pool_->get(bytes, slot), count, type};
    }
  }

 private:
  endpoint_type* ep_;
  const CallInfo* call_;
  std::chrono::nanoseconds timeout_;
  ScratchPool* pool_;
};

}  // namespace gradsync::detail

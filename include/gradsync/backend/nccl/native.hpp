#pragma once
/// \file NativeCollectives: the Nccl endpoint's native collectives, NCCL's
/// own, enqueued on the communicator's stream.
///
/// Like the rest of the endpoint they return once the work is enqueued: the
/// deadline applies where the host waits (barrier, synchronize, Event), not
/// here. The call agreement has already run in begin_call.

#include <nccl.h>

#include <chrono>

#include "gradsync/backend/nccl/datatype.hpp"
#include "gradsync/backend/nccl/error.hpp"
#include "gradsync/core/call_info.hpp"

namespace gradsync::detail::nccl {

/// The native_* members the Native algorithm calls, mixed into `Self` (the
/// Nccl Endpoint, which befriends it for its check that the communicator
/// was not aborted).
template <class Self>
class NativeCollectives {
 public:
  template <class T>
  void native_all_reduce(const T* in, T* out, const CallInfo& call, std::chrono::nanoseconds) {
    reduction(&ncclAllReduce, "ncclAllReduce", in, out, call);
  }

  template <class T>
  void native_reduce_scatter(const T* in, T* out, const CallInfo& call, std::chrono::nanoseconds) {
    reduction(&ncclReduceScatter, "ncclReduceScatter", in, out, call);
  }

  template <class T>
  void native_all_gather(const T* in, T* out, const CallInfo& call, std::chrono::nanoseconds) {
    Self& ep = self();
    DeviceGuard guard(ep.device());
    ep.check_usable(call);
    check_nccl(ncclAllGather(in, out, call.count, datatype(call.type), ep.nccl_comm(), ep.stream()), "ncclAllGather",
               ep.nccl_comm());
  }

  template <class T>
  void native_broadcast(T* buf, const CallInfo& call, std::chrono::nanoseconds) {
    Self& ep = self();
    DeviceGuard guard(ep.device());
    ep.check_usable(call);
    check_nccl(ncclBroadcast(buf, buf, call.count, datatype(call.type), call.root, ep.nccl_comm(), ep.stream()),
               "ncclBroadcast", ep.nccl_comm());
  }

 private:
  Self& self() noexcept { return static_cast<Self&>(*this); }

  /// ncclAllReduce and ncclReduceScatter take the same arguments (count:
  /// the elements each rank ends with), and NCCL averages no integers, so
  /// after either an integer Avg ends in gradsync's finish kernel.
  void reduction(decltype(&ncclAllReduce) start, const char* name, const void* in, void* out, const CallInfo& call) {
    Self& ep = self();
    DeviceGuard guard(ep.device());
    ep.check_usable(call);
    check_nccl(start(in, out, call.count, datatype(call.type), redop(call.op, call.type), ep.nccl_comm(), ep.stream()),
               name, ep.nccl_comm());
    if (needs_finish(call.op, call.type)) ep.local_finish(out, call.count, call.type, call.op);
  }
};

}  // namespace gradsync::detail::nccl

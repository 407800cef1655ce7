#pragma once
/// \file NativeCollectives: the Mpi endpoint's native collectives, MPI's own.
///
/// Non-blocking forms (MPI_Iallreduce and the like), so the deadline holds.
/// Each first waits for the ranks to agree on the call: MPI collectives that
/// do not match are undefined behaviour (Open MPI may kill the job).
///
/// MPI cannot cancel a collective, and keeps writing into its buffers after
/// a wait gave up on it (a peer never joined). Under throw_error the caller
/// regains control and may free them, so Native runs on buffers the endpoint
/// owns (copy in, collective, copy out): an abandoned call keeps its buffer
/// (NativeBuffers) for as long as MPI may use it, and the user's memory is
/// never touched after the call throws. The buffer is reused and only grows.
/// Under abort_job a failed call never returns (fail() ends the job from
/// inside Communicator::run, before any caller frame unwinds), so MPI gets
/// the caller's buffers and the copies go: at 16 MiB and 256 MiB out of place
/// the copies made Native 1.6-1.7x slower (docs/PERFORMANCE.md, "Native on
/// Mpi without the copies", which also times the copies).

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstring>

#include "gradsync/backend/mpi/datatype.hpp"
#include "gradsync/backend/mpi/mpi_options.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync::detail::mpi {

/// The native_* members the Native algorithm calls, mixed into `Self` (the
/// Mpi Endpoint, which befriends it): they use its call agreement (settle),
/// its deadline-bound wait on one request (poll), its error reporting
/// (check) and its NativeBuffers.
template <class Self>
class NativeCollectives {
 public:
  template <class T>
  void native_all_reduce(const T* in, T* out, const CallInfo& call, std::chrono::nanoseconds timeout) {
    reduction(&MPI_Iallreduce, "MPI_Iallreduce", in, call.count, out, call, timeout);
  }

  template <class T>
  void native_reduce_scatter(const T* in, T* out, const CallInfo& call, std::chrono::nanoseconds timeout) {
    reduction(&MPI_Ireduce_scatter_block, "MPI_Ireduce_scatter_block", in,
              call.count * static_cast<std::size_t>(self().size()), out, call, timeout);
  }

  template <class T>
  void native_all_gather(const T* in, T* out, const CallInfo& call, std::chrono::nanoseconds timeout) {
    Self& ep = self();
    ep.settle(call, timeout);
    ep.check_count(call.count);
    const std::size_t bytes = call.count * size_of(call.type);
    const int n = static_cast<int>(call.count);
    const auto ranks = static_cast<std::size_t>(ep.size());
    const bool direct = on_caller_buffers();
    std::byte* buf = direct ? reinterpret_cast<std::byte*>(out) : ep.native_.get(bytes * ranks);
    // In place (`in` is out's own block) needs no copy on the caller's buffers.
    std::byte* mine = buf + bytes * static_cast<std::size_t>(ep.rank());
    if (bytes && static_cast<const void*>(in) != mine) std::memcpy(mine, in, bytes);
    MPI_Request req = MPI_REQUEST_NULL;
    ep.check(MPI_Iallgather(MPI_IN_PLACE, n, datatype(call.type), buf, n, datatype(call.type), ep.mpi_comm(), &req),
             "MPI_Iallgather");
    ep.poll(req, call, timeout, "MPI_Iallgather", !direct);
    ep.waits_.untold();
    if (!direct && bytes) std::memcpy(out, buf, bytes * ranks);
  }

  template <class T>
  void native_broadcast(T* data, const CallInfo& call, std::chrono::nanoseconds timeout) {
    Self& ep = self();
    ep.settle(call, timeout);
    ep.check_count(call.count);
    const std::size_t bytes = call.count * size_of(call.type);
    const bool direct = on_caller_buffers();
    std::byte* buf = direct ? reinterpret_cast<std::byte*>(data) : ep.native_.get(bytes);
    const bool root = call.root == ep.rank();
    if (!direct && root && bytes) std::memcpy(buf, data, bytes);
    MPI_Request req = MPI_REQUEST_NULL;
    ep.check(MPI_Ibcast(buf, static_cast<int>(call.count), datatype(call.type), call.root, ep.mpi_comm(), &req),
             "MPI_Ibcast");
    ep.poll(req, call, timeout, "MPI_Ibcast", !direct);
    ep.waits_.untold();
    if (!direct && !root && bytes) std::memcpy(data, buf, bytes);
  }

 private:
  Self& self() noexcept { return static_cast<Self&>(*this); }

  /// Whether Native may hand MPI the caller's buffers: only when a failure
  /// ends the job, so no caller code runs while MPI may still use them.
  bool on_caller_buffers() noexcept { return self().failure_policy == MpiFailurePolicy::abort_job; }

  /// MPI_Iallreduce and MPI_Ireduce_scatter_block take the same arguments,
  /// and both end with call.count results to finish (integer Avg).
  using StartReduction = int (*)(const void*, void*, int, MPI_Datatype, MPI_Op, MPI_Comm, MPI_Request*);

  /// A native reduction of `in_count` elements in, call.count out. MPI always
  /// runs it out of place: Open MPI's in-place MPI_Iallreduce is 1.2-3x
  /// slower. So an in-place call lands in the endpoint's buffer and is copied
  /// back, even on the caller's buffers; otherwise those need no copy.
  template <class T>
  void reduction(StartReduction start, const char* name, const T* in, std::size_t in_count, T* out,
                 const CallInfo& call, std::chrono::nanoseconds timeout) {
    Self& ep = self();
    ep.settle(call, timeout);
    ep.check_count(call.count);
    const std::size_t unit = size_of(call.type);
    const std::size_t in_bytes = in_count * unit, out_bytes = call.count * unit;
    const bool direct = on_caller_buffers();
    const bool stage_in = !direct, stage_out = !direct || static_cast<const void*>(in) == out;
    std::byte* buf = (stage_in || stage_out) ? ep.native_.get((stage_in ? in_bytes : 0) + out_bytes) : nullptr;
    const void* send = in;
    void* recv = out;
    if (stage_in) {
      if (in_bytes) std::memcpy(buf, in, in_bytes);
      send = buf;
    }
    if (stage_out) recv = buf + (stage_in ? in_bytes : 0);
    MPI_Request req = MPI_REQUEST_NULL;
    ep.check(start(send, recv, static_cast<int>(call.count), datatype(call.type), op(call.op, call.type),
                   ep.mpi_comm(), &req),
             name);
    ep.poll(req, call, timeout, name, buf != nullptr);
    ep.waits_.untold();
    if (stage_out && out_bytes) std::memcpy(out, recv, out_bytes);
    ep.local_finish(out, call.count, call.type, call.op);
  }
};

}  // namespace gradsync::detail::mpi

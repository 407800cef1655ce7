#pragma once
/// \file Agreement: how Nccl ranks check, before each call, that they all make the same call.
///
/// NCCL cannot catch a disagreement by itself: ranks that pass different
/// counts to ncclAllReduce read and write past each other's buffers or hang
/// in the kernel, where no host deadline can reach them. So before a call
/// enqueues any data work, every rank contributes its call (a 64-byte
/// detail::WireCall) to one ncclAllGather of fixed size on a communicator of
/// its own, split from the data communicator at construction, on a stream of
/// its own; the host waits for that gather alone, with the deadline, and
/// compares. The gather has the same shape whatever the call is, so it cannot
/// itself mismatch: a rank that skipped a call, or called another collective,
/// count, type, op, root, algorithm or chunking, is named on every rank as
/// `InvalidArgument` before any data moves.
///
/// Because it has its own communicator and stream, the gather never waits for
/// the data stream: the host blocks until every rank has *started* the call,
/// not until earlier collectives are done, and collectives stay asynchronous.
/// Every rank issues the gather of call k before the data of call k and after
/// the data of call k-1, so the two communicators see their work in one order
/// on every rank (NCCL's rule for several communicators on one GPU).

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <thread>
#include <utility>

#include "gradsync/backend/nccl/error.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/flight_signal.hpp"
#include "gradsync/core/rank_names.hpp"
#include "gradsync/core/wire_call.hpp"

namespace gradsync::detail::nccl {

class Agreement {
 public:
  /// Calls are not checked.
  Agreement() = default;

  /// Takes ownership of `control`, a communicator of the same ranks as the
  /// data communicator (ncclCommSplit of it), used for nothing else.
  Agreement(ncclComm_t control, int rank, int size, int device) : comm_(control), rank_(rank), size_(size) {
    DeviceGuard guard(device);
    try {
      check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      check_cuda(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      // Slot `size` is this rank's own call; slots 0..size-1 what was gathered.
      const std::size_t bytes = sizeof(WireCall) * (static_cast<std::size_t>(size_) + 1);
      check_cuda(cudaMalloc(&device_calls_, bytes), "cudaMalloc");
      check_cuda(cudaMallocHost(reinterpret_cast<void**>(&host_calls_), bytes), "cudaMallocHost");
    } catch (...) {
      release();
      throw;
    }
  }
  Agreement(const Agreement&) = delete;
  Agreement& operator=(const Agreement&) = delete;
  Agreement(Agreement&& o) noexcept
      : comm_(std::exchange(o.comm_, nullptr)),
        rank_(o.rank_),
        size_(o.size_),
        stream_(std::exchange(o.stream_, nullptr)),
        done_(std::exchange(o.done_, nullptr)),
        device_calls_(std::exchange(o.device_calls_, nullptr)),
        host_calls_(std::exchange(o.host_calls_, nullptr)) {}
  Agreement& operator=(Agreement&& o) noexcept {
    if (this != &o) {
      release();
      comm_ = std::exchange(o.comm_, nullptr);
      rank_ = o.rank_;
      size_ = o.size_;
      stream_ = std::exchange(o.stream_, nullptr);
      done_ = std::exchange(o.done_, nullptr);
      device_calls_ = std::exchange(o.device_calls_, nullptr);
      host_calls_ = std::exchange(o.host_calls_, nullptr);
    }
    return *this;
  }
  ~Agreement() { release(); }

  /// Whether calls are checked (a communicator of one rank has nobody to disagree with).
  bool active() const noexcept { return comm_ != nullptr && size_ > 1; }

  /// Blocks until every rank has published the call it is starting, then
  /// throws InvalidArgument naming two calls if they differ (every rank
  /// does, so the communicators stay in step), the ranks as `names` names
  /// them. Past the deadline, or on an NCCL error, this aborts the control
  /// communicator and throws Timeout or Error; the caller must abort the
  /// data communicator too (a peer may be waiting inside it).
  void check(const CallInfo& call, std::chrono::nanoseconds timeout, const RankNames& names) {
    WireCall* mine = host_calls_ + size_;
    *mine = WireCall::of(call);
    try {
      auto* gathered = static_cast<std::byte*>(device_calls_);
      std::byte* own = gathered + sizeof(WireCall) * static_cast<std::size_t>(size_);
      check_cuda(cudaMemcpyAsync(own, mine, sizeof(WireCall), cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
      check_nccl(ncclAllGather(own, gathered, sizeof(WireCall), ncclUint8, comm_, stream_), "ncclAllGather", comm_);
      check_cuda(cudaMemcpyAsync(host_calls_, gathered, sizeof(WireCall) * static_cast<std::size_t>(size_),
                                 cudaMemcpyDeviceToHost, stream_),
                 "cudaMemcpyAsync");
      check_cuda(cudaEventRecord(done_, stream_), "cudaEventRecord");
      wait(call, timeout, names);
    } catch (...) {
      // The gather may never end; NCCL's abort is what stops its kernel.
      abort();
      throw;
    }
    if (auto what = disagreement(rank_, *mine, std::span<const WireCall>(host_calls_, static_cast<std::size_t>(size_)),
                                 names, call.label.names)) {
      throw InvalidArgument(*what);
    }
  }

  /// Gives the control communicator up at once (its gather may never end).
  void abort() noexcept {
    if (!comm_) return;
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  /// Frees everything (on the device that is current). The stream is idle
  /// first: check() always waits for its gather or aborts the communicator,
  /// which ends the gather's kernel.
  void release() noexcept {
    if (stream_) cudaStreamSynchronize(stream_);
    if (comm_) ncclCommDestroy(comm_);
    if (host_calls_) cudaFreeHost(host_calls_);
    if (device_calls_) cudaFree(device_calls_);
    if (done_) cudaEventDestroy(done_);
    if (stream_) cudaStreamDestroy(stream_);
    host_calls_ = nullptr;
    device_calls_ = nullptr;
    done_ = nullptr;
    stream_ = nullptr;
    comm_ = nullptr;
  }

 private:
  void wait(const CallInfo& call, std::chrono::nanoseconds timeout, const RankNames& names) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int spins = 0;; ++spins) {
      const cudaError_t q = cudaEventQuery(done_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) check_cuda(q, ("cudaEventQuery in the agreement on " + describe(call)).c_str());
      ncclResult_t async = ncclSuccess;
      check_nccl(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError", comm_);
      if (async != ncclSuccess && async != ncclInProgress) {
        throw Error("gradsync: " + names.who(rank_) + ": NCCL failed while the ranks compared " +
                    describe(call) + ": " + nccl_message(async, comm_));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        // An all-gather cannot say who is missing; the peers' own messages do
        // (each names the call it was in, or its own failure).
        throw Timeout("gradsync: " + names.who(rank_) + " timed out after " +
                      std::to_string(std::chrono::duration<double>(timeout).count()) +
                      " s waiting for every rank to start " + describe(call) +
                      " (a peer has not started it: it is late, it failed, or its communicator was destroyed)");
      }
      // A check is a few microseconds when ranks are in step; past that, a
      // peer is computing and the host can give its core away.
      if (spins > 1000) {
        // A rank stuck here writes its flight record when the dump signal comes.
        poll_flight_signal();
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }

  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  void* device_calls_ = nullptr;
  WireCall* host_calls_ = nullptr;
};

}  // namespace gradsync::detail::nccl

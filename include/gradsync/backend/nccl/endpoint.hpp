#pragma once
/// \file One rank's end of the NCCL transport: one GPU, one CUDA stream.
///
/// Everything is stream-ordered: a collective returns once its work is
/// enqueued, and the host waits only in barrier(), synchronize() and Event.
/// Point-to-point follows OpQueue's rules (see op_queue.hpp): posted
/// operations are issued as one ncclGroupStart/End batch when wait_any has
/// no completed token left, and tokens are reported FIFO. A recv_reduce
/// lands in pooled scratch and the reduce kernel (dst = op(dst, scratch))
/// runs right after the batch on the same stream.
///
/// Ordering invariant: NCCL pairs the k-th send from A to B with the k-th
/// receive at B from A. That is correct only for algorithms whose posts,
/// under FIFO completion, agree in tag order on both sides of every pair and
/// never wait on a later batch; test/nccl/test_nccl_matching.cpp checks this
/// per algorithm: Ring, Tree (its double-tree AllReduce included) and
/// RecursiveHalvingDoubling, and the rank-ordered (deterministic)
/// reduce-scatter, all hold it; a new algorithm must pass that test before
/// it may run here.

#include <cuda_runtime.h>
#include <nccl.h>
#include <thrust/execution_policy.h>

#include <chrono>
#include <optional>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "gradsync/backend/nccl/agreement.hpp"
#include "gradsync/backend/nccl/datatype.hpp"
#include "gradsync/backend/nccl/error.hpp"
#include "gradsync/backend/nccl/kernels.cuh"
#include "gradsync/backend/nccl/native.hpp"
#include "gradsync/backend/nccl/op_queue.hpp"
#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/flight_signal.hpp"
#include "gradsync/core/local_reduce.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/rank_names.hpp"

namespace gradsync::detail::nccl {

/// Device memory that only grows; freed in stream order.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;
  ~DeviceBuffer() { release(); }

  void release() noexcept {
    if (data_) cudaFree(data_);
    data_ = nullptr;
    bytes_ = 0;
  }

  void* reserve(std::size_t bytes, cudaStream_t stream) {
    if (bytes > bytes_) {
      if (data_) check_cuda(cudaFreeAsync(data_, stream), "cudaFreeAsync");
      data_ = nullptr;
      bytes_ = 0;
      // Grow by half again, so a slowly growing size reallocates rarely.
      const std::size_t want = bytes + bytes / 2;
      check_cuda(cudaMallocAsync(&data_, want, stream), "cudaMallocAsync");
      bytes_ = want;
    }
    return data_;
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Native's collectives, NCCL's own, are mixed in from NativeCollectives.
class Endpoint : public NativeCollectives<Endpoint> {
 public:
  /// Takes ownership of `comm` (a communicator on `device`) and creates a
  /// non-blocking stream for it. With `control` (a communicator of the same
  /// ranks, split from `comm`, also owned from here on) every call is first
  /// checked for agreement (see agreement.hpp); without, calls are trusted.
  Endpoint(ncclComm_t comm, int device, ncclComm_t control = nullptr) : comm_(comm), device_(device) {
    DeviceGuard guard(device_);
    check_nccl(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank", comm_);
    check_nccl(ncclCommCount(comm_, &size_), "ncclCommCount", comm_);
    if (control) agreement_ = Agreement(control, rank_, size_, device_);
    check_cuda(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    stream_ = own_stream_;
    check_cuda(cudaEventCreateWithFlags(&switch_event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    check_cuda(cudaMalloc(&barrier_word_, sizeof(int)), "cudaMalloc");
  }
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  Endpoint(Endpoint&& o) noexcept
      : comm_(std::exchange(o.comm_, nullptr)),
        device_(o.device_),
        rank_(o.rank_),
        size_(o.size_),
        names_(std::move(o.names_)),
        own_stream_(std::exchange(o.own_stream_, nullptr)),
        stream_(o.stream_),
        switch_event_(std::exchange(o.switch_event_, nullptr)),
        barrier_word_(std::exchange(o.barrier_word_, nullptr)),
        agreement_(std::move(o.agreement_)),
        queue_(std::move(o.queue_)),
        recv_scratch_(std::move(o.recv_scratch_)),
        scratch_(std::move(o.scratch_)),
        aborted_(o.aborted_),
        issued_seq_(o.issued_seq_),
        checked_seq_(o.checked_seq_) {}
  Endpoint& operator=(Endpoint&&) = delete;
  ~Endpoint() {
    if (!comm_ && !own_stream_) return;
    DeviceGuard guard(device_);
    if (own_stream_) cudaStreamSynchronize(own_stream_);
    agreement_.release();
    recv_scratch_.release();
    for (auto& b : scratch_) b.release();
    if (barrier_word_) cudaFree(barrier_word_);
    if (switch_event_) cudaEventDestroy(switch_event_);
    if (own_stream_) cudaStreamDestroy(own_stream_);
    // An aborted communicator is already gone (abort() released it).
    if (comm_) ncclCommDestroy(comm_);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  /// How errors name this communicator's ranks.
  const RankNames& names() const noexcept { return names_; }
  int device() const noexcept { return device_; }
  ncclComm_t nccl_comm() const noexcept { return comm_; }
  cudaStream_t stream() const noexcept { return stream_; }

  /// Moves later work to `s`. Work already enqueued on the old stream comes
  /// first: `s` waits for it, so scratch buffers are never shared by two
  /// streams at once and NCCL sees this communicator's calls in order.
  void set_stream(cudaStream_t s) {
    if (s == stream_) return;
    DeviceGuard guard(device_);
    check_cuda(cudaEventRecord(switch_event_, stream_), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(s, switch_event_, 0), "cudaStreamWaitEvent");
    stream_ = s;
  }

  void post_send(const void* data, std::size_t count, DataType type, int peer, std::uint32_t tag, std::uint32_t token,
                 const CallInfo& call) {
    check_call(call);
    queue_.post({PostedOp::send, data, nullptr, count, type, peer, tag, token, OpKind::sum});
  }

  void post_recv(void* data, std::size_t count, DataType type, int peer, std::uint32_t tag, std::uint32_t token,
                 const CallInfo& call, OpKind reduce_op, bool reduce) {
    check_call(call);
    queue_.post({reduce ? PostedOp::recv_reduce : PostedOp::recv, nullptr, data, count, type, peer, tag, token, reduce_op});
  }

  std::size_t pending() const noexcept { return queue_.pending(); }

  /// Before a call enqueues anything: every rank must be making the same
  /// call (when checked). A disagreement throws InvalidArgument on every rank
  /// and leaves the communicator in step; a timeout or an NCCL error aborts it.
  void begin_call(const CallInfo& call, std::chrono::nanoseconds timeout) {
    if (!agreement_.active()) return;
    check_usable(call);
    DeviceGuard guard(device_);
    try {
      agreement_.check(call, timeout, names_);
    } catch (const InvalidArgument&) {
      throw;
    } catch (...) {
      abort();
      throw;
    }
  }

  /// Never blocks on the GPU: a flushed batch is complete in stream order.
  std::uint32_t wait_any(const CallInfo& call, std::chrono::nanoseconds) {
    return queue_.next(call, names_, rank_, [&](std::span<const PostedOp> batch) { issue(batch, call); });
  }

  /// A one-int all-reduce, then a host wait with the deadline.
  void barrier(const CallInfo& call, std::chrono::nanoseconds timeout) {
    DeviceGuard guard(device_);
    check_usable(call);
    check_nccl(ncclAllReduce(barrier_word_, barrier_word_, 1, ncclInt32, ncclSum, comm_, stream_), "ncclAllReduce",
               comm_);
    synchronize(call, timeout);
  }

  /// This rank's end of a sub-communicator of the ranks passing `color`
  /// (see Communicator::split), by ncclCommSplit (ordered by key, then rank;
  /// none for a negative color). ncclCommSplit takes no deadline, so it is
  /// entered only once every rank is known to be in this same call: after the
  /// call agreement (with check_calls off, a barrier), which has one. The
  /// child drives the same GPU on a stream of its own that starts after the
  /// work enqueued here so far, and checks its calls when this one does.
  /// `name` names the group in its errors (RankNames::split).
  std::optional<Endpoint> split(int color, int key, const CallInfo& call, std::chrono::nanoseconds timeout,
                                std::string_view name) {
    DeviceGuard guard(device_);
    if (agreement_.active()) {
      check_usable(call);
    } else {
      barrier(call, timeout);
    }
    ncclComm_t sub = nullptr;
    check_nccl(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr), "ncclCommSplit",
               comm_);
    if (!sub) return std::nullopt;
    ncclComm_t control = nullptr;
    if (agreement_.active()) {
      int sub_rank = 0;
      int sub_size = 1;
      ncclResult_t rc = ncclCommUserRank(sub, &sub_rank);
      if (rc == ncclSuccess) rc = ncclCommCount(sub, &sub_size);
      // Every member of the child splits the child once more, so all take
      // this branch or none (they share this communicator's options).
      if (rc == ncclSuccess && sub_size > 1) rc = ncclCommSplit(sub, 0, sub_rank, &control, nullptr);
      if (rc != ncclSuccess) {
        ncclCommDestroy(sub);
        check_nccl(rc, "ncclCommSplit (the child's call-agreement communicator)");
      }
    }
    std::optional<Endpoint> child(std::in_place, sub, device_, control);
    // The child's first work waits for what this communicator enqueued
    // before the split (the user's buffers may be in flight there).
    check_cuda(cudaEventRecord(switch_event_, stream_), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(child->stream_, switch_event_, 0), "cudaStreamWaitEvent");
    // Its errors name the members' world ranks once they are known; NCCL
    // keeps no record of which of this communicator's ranks a split put
    // together, so the members tell each other.
    child->names_ = names_.split_unmapped(color, name);
    const std::vector<int> members = child->gather_ranks(rank_, call, timeout);
    child->names_ = names_.split(members, color, name);
    return child;
  }

  void local_copy(void* dst, const void* src, std::size_t count, DataType type) {
    if (dst == src || count == 0) return;
    DeviceGuard guard(device_);
    check_cuda(cudaMemcpyAsync(dst, src, count * size_of(type), cudaMemcpyDefault, stream_), "cudaMemcpyAsync");
  }
  void local_reduce(void* dst, const void* src, std::size_t count, DataType type, OpKind op) {
    DeviceGuard guard(device_);
    reduce_erased(thrust::cuda::par_nosync.on(stream_), type, op, dst, src, count);
  }
  void local_finish(void* data, std::size_t count, DataType type, OpKind op) {
    DeviceGuard guard(device_);
    finish_erased(thrust::cuda::par_nosync.on(stream_), type, op, data, count, size_);
  }

  /// Drops what was posted. If this call already issued point-to-point
  /// work, the peers' matching is broken: the communicator is aborted so
  /// their operations fail instead of hanging, and later calls throw.
  void fail(const CallInfo& call, std::string_view, FailureKind) noexcept {
    queue_.clear();
    if (call.seq != 0 && issued_seq_ == call.seq) abort();
  }

  /// Per-rank device work buffers for algorithms (CallView::scratch).
  void* scratch(std::size_t bytes, std::size_t slot) {
    if (slot >= scratch_.size()) scratch_.resize(slot + 1);
    DeviceGuard guard(device_);
    return scratch_[slot].reserve(bytes ? bytes : 1, stream_);
  }

  /// Blocks until the stream's work is done, polling NCCL for errors. On a
  /// deadline or an error the communicator is aborted and this throws.
  void synchronize(const CallInfo& call, std::chrono::nanoseconds timeout) {
    DeviceGuard guard(device_);
    cudaEvent_t done = nullptr;
    check_cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    const cudaError_t rec = cudaEventRecord(done, stream_);
    if (rec != cudaSuccess) {
      cudaEventDestroy(done);
      check_cuda(rec, "cudaEventRecord");
    }
    try {
      wait_event(done, describe(call), timeout);
    } catch (...) {
      cudaEventDestroy(done);
      throw;
    }
    cudaEventDestroy(done);
  }

  /// Polls `event` with a deadline; see synchronize().
  void wait_event(cudaEvent_t event, const std::string& what, std::chrono::nanoseconds timeout) {
    if (!comm_) throw Aborted("gradsync: " + names_.who(rank_) + " cannot wait for " + what +
                              ": this Nccl communicator was aborted after an earlier failure");
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int spins = 0;; ++spins) {
      const cudaError_t q = cudaEventQuery(event);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) {
        abort();
        check_cuda(q, ("cudaEventQuery in " + what).c_str());
      }
      ncclResult_t async = ncclSuccess;
      check_nccl(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError", comm_);
      if (async != ncclSuccess && async != ncclInProgress) {
        const std::string msg = nccl_message(async, comm_);
        abort();
        throw Error("gradsync: " + names_.who(rank_) + ": NCCL failed in " + what + ": " + msg);
      }
      if (std::chrono::steady_clock::now() > deadline) {
        abort();
        throw Timeout("gradsync: " + names_.who(rank_) + " timed out after " +
                      std::to_string(std::chrono::duration<double>(timeout).count()) + " s waiting for " + what +
                      " on GPU " + std::to_string(device_) +
                      " (a peer has not joined it; the NCCL communicator was aborted)");
      }
      if (spins > 1000) {
        // A rank stuck here writes its flight record when the dump signal comes.
        poll_flight_signal();
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

 private:
  // Native's collectives check, as every call does, that this communicator
  // was not aborted.
  friend class NativeCollectives<Endpoint>;

  static constexpr std::size_t align = 256;

  /// Every member's `mine` (its rank in the communicator this one was split
  /// from), in this communicator's rank order: one all-gather of an int,
  /// waited for with the deadline like a barrier.
  std::vector<int> gather_ranks(int mine, const CallInfo& call, std::chrono::nanoseconds timeout) {
    DeviceGuard guard(device_);
    const std::size_t n = static_cast<std::size_t>(size_);
    int* host = nullptr;
    check_cuda(cudaMallocHost(reinterpret_cast<void**>(&host), sizeof(int) * (n + 1)), "cudaMallocHost");
    // Freed once the stream is idle: a copy into it may still be queued
    // after a wait that gave up (the abort ends the gather, not the copy).
    struct FreeHost {
      int* p;
      cudaStream_t s;
      ~FreeHost() {
        cudaStreamSynchronize(s);
        cudaFreeHost(p);
      }
    } free_host{host, stream_};
    auto* device = static_cast<int*>(scratch(sizeof(int) * (n + 1), 0));
    host[n] = mine;
    check_cuda(cudaMemcpyAsync(device + n, host + n, sizeof(int), cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
    check_nccl(ncclAllGather(device + n, device, 1, ncclInt32, comm_, stream_), "ncclAllGather", comm_);
    check_cuda(cudaMemcpyAsync(host, device, sizeof(int) * n, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync");
    synchronize(call, timeout);
    return std::vector<int>(host, host + n);
  }

  void check_usable(const CallInfo& call) const {
    if (aborted_) {
      throw Aborted("gradsync: " + names_.who(rank_) + " cannot run " + describe(call) +
                    ": this Nccl communicator was aborted after an earlier failure");
    }
  }

  /// Runs once per call, at its first post, before anything is issued.
  void check_call(const CallInfo& call) {
    if (checked_seq_ == call.seq) return;
    check_usable(call);
    checked_seq_ = call.seq;
  }

  void issue(std::span<const PostedOp> batch, const CallInfo& call) {
    DeviceGuard guard(device_);
    std::size_t need = 0;
    for (const PostedOp& op : batch)
      if (op.kind == PostedOp::recv_reduce) need += (op.count * size_of(op.type) + align - 1) / align * align;
    auto* landing = static_cast<std::byte*>(need ? recv_scratch_.reserve(need, stream_) : nullptr);
    issued_seq_ = call.seq;
    check_nccl(ncclGroupStart(), "ncclGroupStart", comm_);
    std::size_t off = 0;
    ncclResult_t rc = ncclSuccess;
    for (const PostedOp& op : batch) {
      const ncclDataType_t t = datatype(op.type);
      if (op.kind == PostedOp::send) {
        rc = ncclSend(op.src, op.count, t, op.peer, comm_, stream_);
      } else if (op.kind == PostedOp::recv) {
        rc = ncclRecv(op.dst, op.count, t, op.peer, comm_, stream_);
      } else {
        rc = ncclRecv(landing + off, op.count, t, op.peer, comm_, stream_);
        off += (op.count * size_of(op.type) + align - 1) / align * align;
      }
      if (rc != ncclSuccess) break;
    }
    const ncclResult_t end = ncclGroupEnd();
    check_nccl(rc, "ncclSend/ncclRecv", comm_);
    check_nccl(end, "ncclGroupEnd", comm_);
    off = 0;
    for (const PostedOp& op : batch) {
      if (op.kind != PostedOp::recv_reduce) continue;
      reduce_erased(thrust::cuda::par_nosync.on(stream_), op.type, op.op, op.dst, landing + off, op.count);
      off += (op.count * size_of(op.type) + align - 1) / align * align;
    }
  }

  void abort() noexcept {
    agreement_.abort();
    if (aborted_ || !comm_) return;
    aborted_ = true;
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  ncclComm_t comm_ = nullptr;
  int device_ = 0;
  int rank_ = 0;
  int size_ = 1;
  RankNames names_;  ///< the world's until split names a group
  cudaStream_t own_stream_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t switch_event_ = nullptr;
  void* barrier_word_ = nullptr;
  Agreement agreement_;
  OpQueue queue_;
  DeviceBuffer recv_scratch_;
  std::vector<DeviceBuffer> scratch_;
  bool aborted_ = false;
  std::uint64_t issued_seq_ = 0;
  std::uint64_t checked_seq_ = 0;
};

}  // namespace gradsync::detail::nccl

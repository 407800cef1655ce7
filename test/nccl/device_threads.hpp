#pragma once
/// \file DeviceThreads: several ranks on one GPU, for testing gradsync's own
/// algorithms on device memory where NCCL can only run one rank. Test
/// scaffolding, not part of the library.
///
/// Ranks are threads, as on Threads, and reuse its transport unchanged
/// (mailboxes, tag matching, deadlines, aborts); only the bytes move
/// differently: a receive copies straight out of the sender's device
/// buffer with cudaMemcpy (unified addressing), and reductions are the
/// Nccl backend's Thrust kernels, synchronised before they return, so the
/// Threads transport's "done means done" still holds. Not a production
/// path: it tests the algorithms, the kernels and the device scratch.

#include <cuda_runtime.h>
#include <thrust/execution_policy.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "gradsync/backend/nccl/endpoint.hpp"
#include "gradsync/backend/nccl/error.hpp"
#include "gradsync/backend/nccl/kernels.cuh"
#include "gradsync/backend/threads/endpoint.hpp"
#include "gradsync/backend/threads/world.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/cost_model.hpp"

namespace gradsync::detail::nccl {

/// The Threads transport's memory policy on the current GPU. The policy's
/// functions cannot throw, so a CUDA failure ends the test run loudly.
inline void device_or_die(cudaError_t rc, const char* what) noexcept {
  if (rc == cudaSuccess) return;
  std::fprintf(stderr, "gradsync DeviceThreads: %s failed: %s\n", what, cudaGetErrorString(rc));
  std::abort();
}

inline threads::Memory device_memory() {
  threads::Memory m;
  m.copy = [](void* dst, const void* src, std::size_t bytes) {
    device_or_die(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cudaStreamPerThread), "cudaMemcpyAsync");
    device_or_die(cudaStreamSynchronize(cudaStreamPerThread), "cudaStreamSynchronize");
  };
  m.reduce = [](DataType type, OpKind op, void* dst, const void* src, std::size_t n) {
    reduce_erased(thrust::cuda::par_nosync.on(cudaStreamPerThread), type, op, dst, src, n);
    device_or_die(cudaStreamSynchronize(cudaStreamPerThread), "reduce kernel");
  };
  m.finish = [](DataType type, OpKind op, void* data, std::size_t n, int world) {
    finish_erased(thrust::cuda::par_nosync.on(cudaStreamPerThread), type, op, data, n, world);
    device_or_die(cudaStreamSynchronize(cudaStreamPerThread), "finish kernel");
  };
  return m;
}

/// Threads' endpoint with device memory; no Native (its shared-memory path
/// reads buffers on the host).
class DeviceThreadsEndpoint {
 public:
  DeviceThreadsEndpoint(std::shared_ptr<threads::World> world, int rank)
      : inner_(std::move(world), rank, device_memory()) {}

  int rank() const noexcept { return inner_.rank(); }
  int size() const noexcept { return inner_.size(); }
  void post_send(const void* p, std::size_t n, DataType t, int peer, std::uint32_t tag, std::uint32_t token,
                 const CallInfo& call) {
    inner_.post_send(p, n, t, peer, tag, token, call);
  }
  void post_recv(void* p, std::size_t n, DataType t, int peer, std::uint32_t tag, std::uint32_t token,
                 const CallInfo& call, OpKind op, bool reduce) {
    inner_.post_recv(p, n, t, peer, tag, token, call, op, reduce);
  }
  std::uint32_t wait_any(const CallInfo& call, std::chrono::nanoseconds timeout) { return inner_.wait_any(call, timeout); }
  std::size_t pending() const noexcept { return inner_.pending(); }
  void barrier(const CallInfo& call, std::chrono::nanoseconds timeout) { inner_.barrier(call, timeout); }
  void local_copy(void* d, const void* s, std::size_t n, DataType t) { inner_.local_copy(d, s, n, t); }
  void local_reduce(void* d, const void* s, std::size_t n, DataType t, OpKind op) { inner_.local_reduce(d, s, n, t, op); }
  void local_finish(void* d, std::size_t n, DataType t, OpKind op) { inner_.local_finish(d, n, t, op); }
  void fail(const CallInfo& call, std::string_view why, FailureKind kind) noexcept { inner_.fail(call, why, kind); }
  void begin_call(const CallInfo& call, std::chrono::nanoseconds timeout) { inner_.begin_call(call, timeout); }
  void end_call(const CallInfo& call, std::chrono::nanoseconds timeout) { inner_.end_call(call, timeout); }

  /// Device work buffers (CallView::scratch); synchronous, like the rest.
  void* scratch(std::size_t bytes, std::size_t slot) {
    if (slot >= scratch_.size()) scratch_.resize(slot + 1);
    void* p = scratch_[slot].reserve(bytes ? bytes : 1, cudaStreamPerThread);
    check_cuda(cudaStreamSynchronize(cudaStreamPerThread), "cudaStreamSynchronize");
    return p;
  }

 private:
  threads::Endpoint inner_;
  std::vector<DeviceBuffer> scratch_;
};

}  // namespace gradsync::detail::nccl

namespace gradsync {

/// Test backend: ranks are threads sharing one GPU (see the file comment).
struct DeviceThreads {
  using Endpoint = detail::nccl::DeviceThreadsEndpoint;
  static constexpr CostModel cost_model{};
};

/// Runs `body(Communicator<DeviceThreads>&)` on `world_size` threads, all on
/// GPU `device`; rethrows the first failure, as run_threads does.
template <class F>
void run_device_threads(int world_size, int device, std::chrono::nanoseconds timeout, F&& body) {
  auto world = std::make_shared<detail::threads::World>(world_size);
  std::mutex mutex;
  std::exception_ptr first;
  std::exception_ptr reaction;
  auto rank_main = [&](int r) {
    detail::nccl::check_cuda(cudaSetDevice(device), "cudaSetDevice");
    // The communicator outlives the handler, as in run_threads: its
    // destruction tells the peers this rank left.
    Communicator<DeviceThreads> comm{DeviceThreads::Endpoint(world, r)};
    comm.set_timeout(timeout);
    try {
      body(comm);
    } catch (const Aborted&) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!reaction) reaction = std::current_exception();
    } catch (const std::exception& e) {
      world->abort(r, detail::RankNames::world(), comm.sequence() + 1, e.what());
      std::lock_guard<std::mutex> lock(mutex);
      if (!first) first = std::current_exception();
    } catch (...) {
      world->abort(r, detail::RankNames::world(), comm.sequence() + 1, "unknown exception");
      std::lock_guard<std::mutex> lock(mutex);
      if (!first) first = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < world_size; ++r) threads.emplace_back(rank_main, r);
  rank_main(0);
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
  if (reaction) std::rethrow_exception(reaction);
}

}  // namespace gradsync

#pragma once
/// \file PinnedHostSpace: ShardedTrainer's offload space on a GPU, page-locked host memory.

#include <cuda_runtime.h>

#include <cstddef>

#include "gradsync/backend/nccl/error.hpp"
#include "gradsync/core/offload_space.hpp"

namespace gradsync {

/// Offload for a GPU backend: shards in page-locked (pinned) host memory
/// (cudaHostAlloc), which the host's optimizer steps in place and which the
/// GPU's copy engines reach by DMA, so cudaMemcpyAsync on this space's own
/// stream overlaps kernels and NCCL work on other streams. wait()
/// synchronizes that stream. Copies are issued by the progress worker, on
/// the device that was current when the space was made.
///
/// Compiled with the Nccl backend; ShardedTrainer itself still requires a
/// host-memory backend, so on a GPU this is the offload side waiting for a
/// device-memory trainer.
class PinnedHostSpace final : public OffloadSpace {
 public:
  PinnedHostSpace() {
    detail::nccl::check_cuda(cudaGetDevice(&device_), "cudaGetDevice");
    detail::nccl::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                             "cudaStreamCreateWithFlags (PinnedHostSpace)");
  }
  PinnedHostSpace(const PinnedHostSpace&) = delete;
  PinnedHostSpace& operator=(const PinnedHostSpace&) = delete;
  ~PinnedHostSpace() override {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }

  const char* name() const noexcept override { return "pinned host"; }

  void* allocate(std::size_t bytes) override {
    void* p = nullptr;
    // cudaHostAlloc returns page-aligned memory, more than the 64 bytes promised.
    detail::nccl::check_cuda(cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocDefault),
                             "cudaHostAlloc (PinnedHostSpace)");
    if (bytes != 0) detail::nccl::check_cuda(cudaMemset(p, 0, bytes), "cudaMemset (PinnedHostSpace)");
    return p;
  }
  void deallocate(void* p, std::size_t) noexcept override {
    if (p != nullptr) cudaFreeHost(p);
  }
  void copy_in(void* compute, const void* offloaded, std::size_t bytes) override {
    detail::nccl::DeviceGuard on(device_);
    detail::nccl::check_cuda(cudaMemcpyAsync(compute, offloaded, bytes, cudaMemcpyDefault, stream_),
                             "cudaMemcpyAsync to the device (PinnedHostSpace::copy_in)");
  }
  void copy_out(void* offloaded, const void* compute, std::size_t bytes) override {
    detail::nccl::DeviceGuard on(device_);
    detail::nccl::check_cuda(cudaMemcpyAsync(offloaded, compute, bytes, cudaMemcpyDefault, stream_),
                             "cudaMemcpyAsync to pinned host memory (PinnedHostSpace::copy_out)");
  }
  void wait() override {
    detail::nccl::check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (PinnedHostSpace)");
  }

  cudaStream_t stream() const noexcept { return stream_; }

 private:
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
};

}  // namespace gradsync

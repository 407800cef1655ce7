#pragma once
/// \file NcclDeviceCommunicator: a Communicator<Nccl> behind the DeviceCommunicator interface, for LibTorch's DDP.
///
/// Include it from a CUDA translation unit (nvcc, like every user of
/// gradsync/backend/nccl.hpp); it includes no torch header, so the model's
/// translation unit, compiled by the host compiler, sees only
/// gradsync/integration/torch/device_communicator.hpp (see there why).
///
///   // comms.cu
///   std::unique_ptr<gradsync::DeviceCommunicator> wrap(gradsync::Communicator<gradsync::Nccl>& c) {
///     return gradsync::torch_device_communicator(c);
///   }
///   // train.cpp
///   gradsync::DistributedDataParallel ddp(*wrapped, net);   // net on cuda:<c's device>

#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/backend/nccl.hpp"
#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/collective/broadcast.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/endpoint_of.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/core/visit.hpp"
#include "gradsync/integration/torch/device_communicator.hpp"
#include "gradsync/train/common/hash_bytes.hpp"

namespace gradsync {

/// A Communicator<Nccl> (borrowed: it must outlive this) as a
/// DeviceCommunicator whose gradient collectives run `Algo` with `options`.
/// Ordering is by CUDA events only: a gradient stream's work up to now is
/// recorded and the communicator's stream waits on it, and back.
template <class Algo = Auto>
class NcclDeviceCommunicator final : public DeviceCommunicator {
 public:
  explicit NcclDeviceCommunicator(Communicator<Nccl>& comm, Options options = {}) : comm_(comm), o_(options) {
    detail::nccl::DeviceGuard guard(device());
    detail::nccl::check_cuda(cudaEventCreateWithFlags(&computed_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    const cudaError_t rc = cudaEventCreateWithFlags(&reduced_, cudaEventDisableTiming);
    if (rc != cudaSuccess) cudaEventDestroy(computed_);
    detail::nccl::check_cuda(rc, "cudaEventCreateWithFlags");
  }
  ~NcclDeviceCommunicator() override {
    cudaEventDestroy(computed_);
    cudaEventDestroy(reduced_);
    release_scratch();
  }

  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  int device() const override { return detail::endpoint_of(comm_).device(); }

  void wait_for(void* stream) override {
    detail::nccl::DeviceGuard guard(device());
    detail::nccl::check_cuda(cudaEventRecord(computed_, cuda_stream(stream)), "cudaEventRecord (the gradients' stream)");
    detail::nccl::check_cuda(cudaStreamWaitEvent(detail::endpoint_of(comm_).stream(), computed_, 0),
                             "cudaStreamWaitEvent (the communicator's stream)");
  }

  void all_reduce_mean(void* data, std::size_t count, DataType type) override {
    detail::nccl::DeviceGuard guard(device());
    visit(type, [&]<class T>(T) { AllReduce<Algo>{o_}(comm_, std::span<T>(static_cast<T*>(data), count), Avg{}); });
  }

  void broadcast(void* data, std::size_t count, DataType type, int root) override {
    detail::nccl::DeviceGuard guard(device());
    visit(type, [&]<class T>(T) { Broadcast<Algo>{o_}(comm_, std::span<T>(static_cast<T*>(data), count), root); });
  }

  void join(void* stream) override {
    detail::nccl::DeviceGuard guard(device());
    detail::nccl::check_cuda(cudaEventRecord(reduced_, detail::endpoint_of(comm_).stream()),
                             "cudaEventRecord (the communicator's stream)");
    detail::nccl::check_cuda(cudaStreamWaitEvent(cuda_stream(stream), reduced_, 0),
                             "cudaStreamWaitEvent (the gradients' stream)");
    synchronize(comm_);
  }

  void max_flags(std::span<std::int32_t> flags) override {
    if (size() == 1 || flags.empty()) return;
    const std::vector<std::int64_t> m = max_min(std::vector<std::int64_t>(flags.begin(), flags.end()));
    for (std::size_t i = 0; i < flags.size(); ++i) flags[i] = static_cast<std::int32_t>(m[i]);
  }

  /// Two rounds of Max over [x, ~x] (which gives both the max and the min
  /// of x): the line counts with a fingerprint of the whole table, then,
  /// only when those differ while the counts agree, one hash per line, so
  /// the first line that differs is found on every rank alike and each rank
  /// names its own version of it.
  void check_agree(const std::vector<std::string>& declared, std::string_view who, std::string_view fix) override {
    if (size() == 1) return;
    std::vector<std::int64_t> lines;
    std::uint64_t whole = 0x756e697473616772ull;
    for (const std::string& s : declared) {
      lines.push_back(std::bit_cast<std::int64_t>(detail::hash_bytes(s.data(), s.size(), 0x6c696e65ull)));
      whole = detail::hash_bytes(s.data(), s.size(), whole);
    }
    const auto n = static_cast<std::int64_t>(declared.size());
    const std::vector<std::int64_t> head = max_min({n, std::bit_cast<std::int64_t>(whole)});
    std::string what;
    if (head[0] != head[2]) {
      what = "they declared between " + std::to_string(head[2]) + " and " + std::to_string(head[0]) +
             " parameters and buffers; this rank declared " + std::to_string(n);
    } else if (head[1] != head[3]) {
      const std::vector<std::int64_t> each = max_min(lines);
      for (std::size_t i = 0; i < lines.size() && what.empty(); ++i) {
        if (each[i] != each[lines.size() + i]) {
          what = "they differ first at entry " + std::to_string(i) + ", which this rank declared as " + declared[i];
        }
      }
    }
    if (!what.empty()) {
      throw InvalidArgument("gradsync: " + std::string(who) + " on rank " + std::to_string(rank()) +
                            ": the ranks wrapped different modules: " + what + ". " + std::string(fix));
    }
  }

 private:
  static cudaStream_t cuda_stream(void* s) noexcept { return s ? static_cast<cudaStream_t>(s) : cudaStreamLegacy; }

  /// x's element-wise maximum then minimum over the ranks (2·x.size() values).
  std::vector<std::int64_t> max_min(std::vector<std::int64_t> x) {
    const std::size_t n = x.size();
    for (std::size_t i = 0; i < n; ++i) x.push_back(~x[i]);
    detail::nccl::DeviceGuard guard(device());
    const std::size_t bytes = x.size() * sizeof(std::int64_t);
    reserve_scratch(bytes);
    auto* host = static_cast<std::int64_t*>(scratch_host_);
    std::copy(x.begin(), x.end(), host);
    const cudaStream_t s = detail::endpoint_of(comm_).stream();
    detail::nccl::check_cuda(cudaMemcpyAsync(scratch_device_, host, bytes, cudaMemcpyHostToDevice, s),
                             "cudaMemcpyAsync");
    AllReduce<Auto>{}(comm_, std::span<std::int64_t>(static_cast<std::int64_t*>(scratch_device_), x.size()), Max{});
    detail::nccl::check_cuda(cudaMemcpyAsync(host, scratch_device_, bytes, cudaMemcpyDeviceToHost, s),
                             "cudaMemcpyAsync");
    synchronize(comm_);
    std::copy(host, host + x.size(), x.begin());
    for (std::size_t i = 0; i < n; ++i) x[n + i] = ~x[n + i];
    return x;
  }

  /// max_min's device and pinned host buffers of at least `bytes`, kept
  /// between calls: cudaFree would synchronise the device in every synced
  /// backward that max_flags serves. Pinned, because a copy from or to
  /// pageable memory may block the host on the stream's earlier work, a
  /// wait without the deadline.
  void reserve_scratch(std::size_t bytes) {
    if (bytes <= scratch_bytes_) return;
    release_scratch();
    detail::nccl::check_cuda(cudaMalloc(&scratch_device_, bytes), "cudaMalloc (agreement scratch)");
    detail::nccl::check_cuda(cudaMallocHost(&scratch_host_, bytes), "cudaMallocHost (agreement scratch)");
    scratch_bytes_ = bytes;
  }
  void release_scratch() noexcept {
    if (scratch_device_) cudaFree(scratch_device_);
    if (scratch_host_) cudaFreeHost(scratch_host_);
    scratch_device_ = scratch_host_ = nullptr;
    scratch_bytes_ = 0;
  }

  Communicator<Nccl>& comm_;
  Options o_;
  void* scratch_device_ = nullptr;
  void* scratch_host_ = nullptr;
  std::size_t scratch_bytes_ = 0;
  cudaEvent_t computed_ = nullptr;
  cudaEvent_t reduced_ = nullptr;
};

/// `comm` as the DeviceCommunicator that DistributedDataParallel takes for
/// CUDA tensors; `comm` must outlive what this returns.
template <class Algo = Auto>
std::unique_ptr<DeviceCommunicator> torch_device_communicator(Communicator<Nccl>& comm, Options options = {}) {
  return std::make_unique<NcclDeviceCommunicator<Algo>>(comm, options);
}

}  // namespace gradsync

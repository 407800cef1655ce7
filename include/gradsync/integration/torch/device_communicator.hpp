#pragma once
/// \file DeviceCommunicator: what DistributedDataParallel needs of a communicator over GPU memory, without CUDA headers.
///
/// LibTorch 1.13's headers do not compile as C++20 under nvcc (its EDG front
/// end rejects ATen/core/List.h: a std::vector<c10::IValue> destroyed while
/// IValue is incomplete, which g++ accepts), and the Nccl backend's
/// collectives are CUDA code that only nvcc compiles. So the two meet
/// through this interface: a CUDA translation unit wraps its
/// Communicator<Nccl> (gradsync/integration/torch/nccl_device_communicator.hpp,
/// no torch there), and the g++ translation unit that holds the model hands
/// the wrapper to DistributedDataParallel (no CUDA or NCCL there).
///
/// Streams are passed as `void*` holding a `cudaStream_t`; nullptr is CUDA's
/// legacy default stream, which is where LibTorch launches its kernels
/// unless the program made another stream current.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradsync/core/types.hpp"

namespace gradsync {

/// One rank of a communicator over the memory of one CUDA device, as
/// DistributedDataParallel uses it. Collectives are enqueued on the
/// communicator's own stream and return at once; `wait_for` and `join` order
/// them against the stream that computes the gradients.
class DeviceCommunicator {
 public:
  DeviceCommunicator() = default;
  DeviceCommunicator(const DeviceCommunicator&) = delete;
  DeviceCommunicator& operator=(const DeviceCommunicator&) = delete;
  virtual ~DeviceCommunicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// The CUDA device whose memory this rank's collectives work on.
  virtual int device() const = 0;
  /// The next collectives start after the work enqueued so far on `stream`.
  virtual void wait_for(void* stream) = 0;
  /// Sum over ranks divided by the world size, in place, of `count`
  /// elements of `type` at device address `data`.
  virtual void all_reduce_mean(void* data, std::size_t count, DataType type) = 0;
  /// Rank `root`'s `count` elements of `type` at device address `data`, everywhere.
  virtual void broadcast(void* data, std::size_t count, DataType type, int root) = 0;
  /// `stream` waits for every collective enqueued so far, and the host waits
  /// for them too, within the communicator's deadline: a failed or stuck
  /// collective throws here (Error, Timeout), not in a later kernel.
  virtual void join(void* stream) = 0;
  /// The element-wise maximum over the ranks of `flags`, host memory, in
  /// place, the host waiting for it (within the deadline). Collective.
  virtual void max_flags(std::span<std::int32_t> flags) = 0;
  /// Throws InvalidArgument on every rank unless every rank passed the same
  /// `declared` lines; `who` names the caller and `fix` ends the message.
  /// Collective.
  virtual void check_agree(const std::vector<std::string>& declared, std::string_view who, std::string_view fix) = 0;
};

}  // namespace gradsync

// Communicators on every visible GPU for the LibTorch DDP test, built in a
// CUDA translation unit (torch_nccl_world.cu) and used from a host-compiled
// one: LibTorch 1.13's headers do not compile under nvcc as C++20, so the
// test's torch side sees only this header and DeviceCommunicator.

#pragma once

#include <memory>

#include <gradsync/integration/torch/device_communicator.hpp>

namespace test {

/// One Communicator<Nccl> per GPU 0..size−1 (ncclCommInitAll), each wrapped
/// as a DeviceCommunicator; use rank r from its own thread.
class TorchNcclWorld {
 public:
  virtual ~TorchNcclWorld() = default;
  virtual int size() const = 0;
  virtual gradsync::DeviceCommunicator& rank(int r) = 0;
};

/// The CUDA devices this process sees (0 when CUDA reports none or fails).
int visible_gpus();

std::unique_ptr<TorchNcclWorld> make_torch_nccl_world(int size);

}  // namespace test

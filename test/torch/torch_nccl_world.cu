// The CUDA half of test_torch_ddp_nccl.cpp: see torch_nccl_world.hpp.

#include "torch_nccl_world.hpp"

#include <cuda_runtime.h>

#include <memory>
#include <numeric>
#include <vector>

#include <gradsync/backend/nccl.hpp>
#include <gradsync/integration/torch/nccl_device_communicator.hpp>

namespace test {

namespace {

class World final : public TorchNcclWorld {
 public:
  explicit World(int size) {
    std::vector<int> devices(static_cast<std::size_t>(size));
    std::iota(devices.begin(), devices.end(), 0);
    comms_ = gradsync::nccl_communicators(devices);
    for (auto& c : comms_) wrapped_.push_back(gradsync::torch_device_communicator(c));
  }
  int size() const override { return static_cast<int>(comms_.size()); }
  gradsync::DeviceCommunicator& rank(int r) override { return *wrapped_[static_cast<std::size_t>(r)]; }

 private:
  std::vector<gradsync::Communicator<gradsync::Nccl>> comms_;
  std::vector<std::unique_ptr<gradsync::DeviceCommunicator>> wrapped_;
};

}  // namespace

int visible_gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

std::unique_ptr<TorchNcclWorld> make_torch_nccl_world(int size) { return std::make_unique<World>(size); }

}  // namespace test

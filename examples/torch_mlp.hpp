#pragma once
// The LibTorch MLP 784-hidden-hidden-10 of examples/libtorch_ddp.cpp.
// bench/libtorch_fsdp_step.cpp times the same layers (its hidden ones as
// fully_shard units), and bench/torch_ddp_peer.py mirrors them.

#include <torch/torch.h>

namespace example {

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int hidden)
      : fc1(register_module("fc1", torch::nn::Linear(784, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, 10))) {}
  torch::Tensor forward(torch::Tensor x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Net);

}  // namespace example

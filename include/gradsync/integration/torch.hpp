#pragma once
/// \file The opt-in LibTorch integration: DistributedDataParallel for torch::nn::Module, tensors as buffers.
///
/// Include it next to <torch/torch.h> and link LibTorch (torch, torch_cpu,
/// c10); gradsync/gradsync.hpp never includes it, so the rest of the library
/// builds without torch.

#include "gradsync/integration/torch/distributed_data_parallel.hpp"
#include "gradsync/integration/torch/distributed_sampler.hpp"
#include "gradsync/integration/torch/tensor.hpp"

#pragma once
/// \file The opt-in LibTorch integration: DistributedDataParallel for torch::nn::Module, tensors as buffers.
///
/// Include it next to <torch/torch.h> and link LibTorch (torch, torch_cpu,
/// c10); gradsync/gradsync.hpp never includes it, so the rest of the library
/// builds without torch. For CUDA tensors on Nccl, a CUDA translation unit
/// also includes gradsync/integration/torch/nccl_device_communicator.hpp
/// (never this header: see device_communicator.hpp).

#include "gradsync/integration/torch/device_communicator.hpp"
#include "gradsync/integration/torch/distributed_data_parallel.hpp"
#include "gradsync/integration/torch/distributed_sampler.hpp"
#include "gradsync/integration/torch/tensor.hpp"

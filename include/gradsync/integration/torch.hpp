#pragma once
/// \file The opt-in LibTorch integration: DistributedDataParallel and fully_shard for torch::nn::Module, tensors as buffers.
///
/// Include it and link LibTorch (torch, torch_cpu, c10); it brings
/// <torch/torch.h>, the whole C++ frontend. gradsync/gradsync.hpp never
/// includes it, so the rest of the library builds without torch. For CUDA
/// tensors on Nccl, a CUDA translation unit also includes
/// gradsync/integration/torch/nccl_device_communicator.hpp (never this
/// header: see device_communicator.hpp).

// The frontend a user of DistributedDataParallel writes against (nn, optim,
// data); the headers below include only the parts they use, so that one of
// them alone parses in 2 to 10 s instead of 16.
#include <torch/torch.h>

#include "gradsync/integration/torch/device_communicator.hpp"
#include "gradsync/integration/torch/distributed_data_parallel.hpp"
#include "gradsync/integration/torch/distributed_sampler.hpp"
#include "gradsync/integration/torch/full_state_dict.hpp"
#include "gradsync/integration/torch/fully_shard.hpp"
#include "gradsync/integration/torch/fully_shard_no_sync.hpp"
#include "gradsync/integration/torch/fully_shard_options.hpp"
#include "gradsync/integration/torch/fully_shard_persistent_bytes.hpp"
#include "gradsync/integration/torch/load_sharded_state_dict.hpp"
#include "gradsync/integration/torch/save_full_state_dict.hpp"
#include "gradsync/integration/torch/save_sharded_state_dict.hpp"
#include "gradsync/integration/torch/sharded_module.hpp"
#include "gradsync/integration/torch/tensor.hpp"
#include "gradsync/integration/torch/torch_clip_grad_norm.hpp"

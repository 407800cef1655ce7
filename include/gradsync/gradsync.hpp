#pragma once
/// \file The umbrella header: the collectives (gradsync/collectives.hpp: the
/// core, the Threads backend, every algorithm and primitive) and the trainers.
/// It never includes MPI, NCCL or CUDA headers; those backends are opt-in
/// through their own headers.

#include "gradsync/collectives.hpp"
#include "gradsync/core/host_offload_space.hpp"
#include "gradsync/train/common/model.hpp"
#include "gradsync/train/data/distributed_sampler.hpp"
#include "gradsync/train/data/lr_scaling.hpp"
#include "gradsync/train/ddp/grad_sync.hpp"
#include "gradsync/train/ddp/replicated_trainer.hpp"
#include "gradsync/train/fsdp/sharded_trainer.hpp"
#include "gradsync/train/optim/adam.hpp"
#include "gradsync/train/optim/adamw.hpp"
#include "gradsync/train/optim/optimizer.hpp"
#include "gradsync/train/optim/sgd.hpp"

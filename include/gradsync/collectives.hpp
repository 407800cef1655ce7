#pragma once
/// \file The collectives without the trainers: the core, the Threads backend,
/// every algorithm and primitive, and ProgressWorker. For a program that only
/// moves buffers (a trainer of its own, a benchmark) it parses in about two
/// thirds of gradsync.hpp's time. Like gradsync.hpp it never includes MPI,
/// NCCL or CUDA headers; those backends are opt-in through their own headers.

#include "gradsync/algorithm/auto.hpp"
#include "gradsync/algorithm/native.hpp"
#include "gradsync/algorithm/recursive_halving_doubling.hpp"
#include "gradsync/algorithm/ring.hpp"
#include "gradsync/algorithm/tags.hpp"
#include "gradsync/algorithm/tree.hpp"
#include "gradsync/backend/threads.hpp"
#include "gradsync/collective/all_gather.hpp"
#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/collective/broadcast.hpp"
#include "gradsync/collective/progress_worker.hpp"
#include "gradsync/collective/reduce_scatter.hpp"
#include "gradsync/core/backend_traits.hpp"
#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/cost_model.hpp"
#include "gradsync/core/denormals.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/float16.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/request.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/core/visit.hpp"

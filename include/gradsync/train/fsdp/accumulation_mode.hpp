#pragma once
/// \file AccumulationMode: how ShardedTrainer::accumulate() keeps a micro-step's gradient.

#include <cstdint>

namespace gradsync {

/// How ShardedTrainer keeps the gradients of accumulate()'s micro-steps
/// until the step() that ends them (PyTorch FSDP offers both: backward
/// without `no_sync()`, or inside it).
enum class AccumulationMode : std::uint8_t {
  /// Every micro-step reduce-scatters its gradient and adds the averaged
  /// shard into this rank's gradient shard: memory stays 1/N, and each
  /// micro-step costs a reduction (DeepSpeed ZeRO-3 can do only this).
  /// Under NoShard the backward adds into the gradient itself, so each
  /// micro-step all-reduces the running sum with its own part: with
  /// reduce_dtype bfloat16 that sum is rounded to bfloat16 at every
  /// micro-step (its error grows with K); NoSync, which costs NoShard no
  /// memory, rounds once.
  Sharded,
  /// FSDP's `no_sync()`: micro-steps communicate no gradient; each unit keeps
  /// its whole unsharded gradient (Ψ more elements per rank, padding
  /// included, for the whole accumulation) until step()'s backward reduces
  /// the sum. One reduction per step, as ReplicatedTrainer::accumulate().
  NoSync,
};

}  // namespace gradsync

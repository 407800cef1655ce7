#pragma once
/// \file CheckpointOptions: which of the two checkpoint layouts save_checkpoint writes.

#include <cstdint>

namespace gradsync {

/// The layouts of a training checkpoint; both load into either trainer at
/// any world size.
enum class CheckpointFormat : std::uint8_t {
  /// One safetensors file of full tensors (`path`, or `path/checkpoint-<generation>.safetensors`):
  /// rank 0 writes it, gathering a sharded trainer's units one at a time.
  full,
  /// A directory: every rank that holds a distinct shard writes the element
  /// ranges it owns (`checkpoint-<generation>-rankRRRRR-of-NNNNN.safetensors`), and
  /// `checkpoint-<generation>.index.json` maps each tensor to its pieces; no rank gathers.
  sharded,
};

/// How save_checkpoint writes.
struct CheckpointOptions {
  CheckpointFormat format = CheckpointFormat::full;
};

}  // namespace gradsync

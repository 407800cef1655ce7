#pragma once
/// \file GradSyncOptions and what goes with them: compression, averaging, statistics.

#include <cstddef>
#include <cstdint>

#include "gradsync/core/options.hpp"

namespace gradsync {

/// How gradients travel.
enum class Compression : std::uint8_t {
  /// As they are.
  none,
  /// Cast to bfloat16, reduce, take the mean, cast back: half the bytes,
  /// about three significant digits (PyTorch's bf16_compress_hook).
  bf16,
};

/// Options of GradSync, with PyTorch DDP's defaults.
struct GradSyncOptions {
  /// Largest bucket, in bytes of gradient (PyTorch: bucket_cap_mb = 25).
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  /// The first bucket (the last layers) is small, so communication starts
  /// as early as possible in backward.
  std::size_t first_bucket_cap_bytes = std::size_t{1} << 20;
  Compression compression = Compression::none;
  /// A unit that got no ready() in a synced backward contributes zeros
  /// (unless it accumulated a gradient under no_sync). Off: finish() throws
  /// an error naming the unit. A unit unused on every rank gets a zero
  /// gradient, which a trainer's optimizer then steps (momentum, Adam's
  /// moments and weight decay still move it): PyTorch skips a parameter
  /// whose .grad is None, which zero_grad(set_to_none=True) leaves it.
  bool find_unused_parameters = false;
  /// Launch each bucket as soon as its gradients are ready. Off: launch all
  /// of them in finish(), for measuring what overlap buys.
  bool overlap = true;
  /// Passed to every bucket's collective; `deterministic` makes the averaged
  /// gradients bitwise independent of the bucket sizes. Its `label` is
  /// replaced by each bucket's own (sync count, bucket, learning rate).
  Options collective{};
};

/// How the next synced backward is averaged. By default every rank's
/// gradient counts once and the result is the mean over all ranks.
struct Averaging {
  /// Applied to this rank's gradient before the reduction: 1/K after K
  /// accumulated micro-steps.
  double local_scale = 1.0;
  /// The reduced sum is divided by this; 0 means the world size. A join
  /// (uneven inputs) divides by the number of ranks that still had data.
  int divisor = 0;
};

/// What GradSync measured, summed since construction or reset_stats().
struct GradSyncStats {
  std::size_t syncs = 0;
  /// Buckets that started before finish(), i.e. overlapped with backward.
  std::size_t buckets_launched_early = 0;
  std::size_t buckets_launched = 0;
  /// Time spent in bucket collectives (pack, reduce, unpack), on the progress
  /// worker or, for the buckets finish() runs itself, on the caller's thread.
  double comm_seconds = 0;
  /// Time finish() blocked waiting for them: the communication backward did not hide.
  double wait_seconds = 0;
};

}  // namespace gradsync

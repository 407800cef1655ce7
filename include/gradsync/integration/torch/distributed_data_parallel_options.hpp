#pragma once
/// \file DistributedDataParallelOptions: how gradsync's LibTorch DistributedDataParallel buckets, checks and orders.

#include <cstddef>

#include "gradsync/core/options.hpp"
#include "gradsync/train/common/on_nonfinite.hpp"

namespace gradsync {

/// Options of DistributedDataParallel, with PyTorch DDP's defaults.
struct DistributedDataParallelOptions {
  /// Largest bucket, in bytes of gradient (PyTorch: bucket_cap_mb = 25).
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  /// The first bucket (the last layers, whose gradients come first) is
  /// small, so communication starts early in backward.
  std::size_t first_bucket_cap_bytes = std::size_t{1} << 20;
  /// A parameter that got no gradient in a synced backward contributes
  /// zeros. Off: that backward throws InvalidArgument naming it.
  bool find_unused_parameters = false;
  /// Broadcast rank 0's buffers (BatchNorm statistics...) before a forward
  /// through operator(), when PyTorch's DDP would: before the first, and
  /// before each that follows a forward run with gradients enabled and
  /// outside no_sync(). A forward under torch::NoGradGuard or no_sync()
  /// leaves the next one on this rank's own buffers. Construction broadcasts
  /// the buffers whatever this says.
  bool broadcast_buffers = true;
  /// What a NaN or ±Inf in the averaged gradient of a synced backward does.
  /// The average is the same on every rank (a NaN or Inf from any rank is
  /// carried by the sum), so every rank finds the same parameter with no
  /// further communication. On CPU tensors each bucket, reduced in place, is
  /// read once more on the thread that reduced it (about 0.2 ms per 1.9M
  /// floats, docs/PERFORMANCE.md); on CUDA tensors it is one
  /// torch::isfinite reduction of the flat gradient and a copy of its
  /// verdict to the host, after the wait for the reductions.
  ///   - throw_error: backward() throws gradsync::Error on every rank, naming
  ///     the step (the count of synced backwards) and the first parameter, in
  ///     registration order, whose averaged gradient holds a NaN or an Inf;
  ///     the gradients are zeroed first, so the model and optimizer are
  ///     untouched and the next step starts clean.
  ///   - skip_step: the gradients are zeroed and step_is_finite() is false
  ///     until the next synced backward, on every rank: call
  ///     `ddp.step(optimizer)` (or `if (ddp.step_is_finite()) optimizer.step();`)
  ///     so the optimizer's state (Adam's moments and step count) stays as it
  ///     was, as torch.cuda.amp.GradScaler::step skips optimizer.step().
  ///   - ignore: no check; the gradients are left as reduced.
  /// Every rank must pass the same value (checked at construction).
  OnNonfinite on_nonfinite = OnNonfinite::throw_error;
  /// Passed to every collective; `deterministic` sums in rank order. Its
  /// `label` is replaced by each bucket's own.
  Options collective{};
  /// CUDA tensors only: the cudaStream_t LibTorch computes on, which the
  /// reductions are ordered against. nullptr is the legacy default stream,
  /// LibTorch's own default; pass `at::cuda::getCurrentCUDAStream().stream()`
  /// if the program runs its model on another stream.
  void* cuda_stream = nullptr;
};

}  // namespace gradsync

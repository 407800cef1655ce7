#pragma once
/// \file OnNonfinite: what a trainer does when a step's averaged gradient or loss is not finite.

#include <cstdint>

namespace gradsync {

/// What a trainer does when a step goes non-finite: a NaN or ±Inf in the
/// averaged gradient, or a NaN or ±Inf loss on any rank (what the model's
/// forward_backward returned, in that step or one of its accumulate()
/// micro-steps). The gradient is checked after the reduction, in the pass
/// that already reads each reduced element (a result reduced in place, whose
/// last pass is the algorithm's, is read once more), so a NaN from any rank
/// is seen wherever the reduction carries it; one 16-byte all-reduce per step then
/// agrees on the verdict and on the first unit that went non-finite, so
/// every rank takes the same decision. `ignore` makes neither (but see it).
enum class OnNonfinite : std::uint8_t {
  /// Every rank throws gradsync::Error from forward_backward() (or step(),
  /// or ReplicatedTrainer::join() on a rank that joined: call it again to
  /// go on matching the others' steps),
  /// naming the step, the first unit (in declaration order) whose averaged
  /// gradient holds a NaN or Inf, or the first rank whose loss did, before
  /// the optimizer runs: parameters and optimizer state are as before the
  /// step, the step count does not move, and the step's gradient is
  /// dropped, so training may go on (with a smaller learning rate, say).
  throw_error,
  /// Every rank skips the optimizer update of that step, as mixed-precision
  /// loss scaling does: the gradient is dropped, parameters and optimizer
  /// state (Adam's step count included) stay as they were. The step still
  /// counts in step_count() (the iteration happened, as PyTorch's
  /// GradScaler skips optimizer.step() but not the loop); TrainerStats::
  /// skipped_steps counts the steps skipped and StepStats::skipped says
  /// whether last_step() was one.
  skip_step,
  /// No check: a non-finite gradient reaches the optimizer. Each step of a
  /// trainer (ReplicatedTrainer, ShardedTrainer; not LibTorch's DDP, whose
  /// no_sync backwards are counted in its labels) still ends with one
  /// 8-byte all-reduce (none at N = 1) that agrees on its number of
  /// micro-batches (accumulate() calls and the step's own), which the
  /// agreement on finite values otherwise carries: ranks that took
  /// different numbers would weigh their micro-batches differently (or
  /// match one rank's extra micro-step with their step), and all throw
  /// InvalidArgument instead.
  ignore,
};

/// "throw_error", "skip_step", "ignore": how errors and the agreement name it.
constexpr const char* name(OnNonfinite o) noexcept {
  switch (o) {
    case OnNonfinite::throw_error: return "throw_error";
    case OnNonfinite::skip_step: return "skip_step";
    case OnNonfinite::ignore: return "ignore";
  }
  return "?";
}

}  // namespace gradsync

#pragma once
/// \file The linear learning-rate scaling rule (Goyal et al. 2017).

#include <cmath>
#include <cstddef>
#include <string>

#include "gradsync/core/error.hpp"

namespace gradsync {

/// The learning rate for `effective_batch` samples per step, given one that
/// works at `base_batch`: lr scales with the batch. 0.1 at 64 becomes 0.4
/// at 256 (4 ranks of 64). Large scale-ups want a warm-up as well.
inline double linear_scaled_lr(double base_lr, std::size_t base_batch, std::size_t effective_batch) {
  if (base_batch == 0 || effective_batch == 0) {
    throw InvalidArgument("gradsync: linear_scaled_lr expects positive batch sizes, got base " +
                          std::to_string(base_batch) + " and effective " + std::to_string(effective_batch));
  }
  if (!std::isfinite(base_lr) || base_lr < 0) {
    throw InvalidArgument("gradsync: linear_scaled_lr expects a finite base learning rate not below 0, got " +
                          std::to_string(base_lr));
  }
  return base_lr * static_cast<double>(effective_batch) / static_cast<double>(base_batch);
}

}  // namespace gradsync

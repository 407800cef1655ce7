#pragma once
/// \file The arithmetic of gradient clipping that both trainers share: a
/// norm of order p (or the inf-norm) from partial sums, and the scale that
/// brings it to max_norm.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>

#include "gradsync/core/error.hpp"

namespace gradsync::detail {

/// p must be positive (or infinity, the largest magnitude).
inline void check_norm_order(const char* who, double max_norm, double p) {
  if (!(p > 0)) {
    throw InvalidArgument(std::string("gradsync: ") + who +
                          "::clip_grad_norm expects a norm order p > 0 (or infinity), got " + std::to_string(p));
  }
  if (!(max_norm >= 0) || std::isinf(max_norm)) {
    throw InvalidArgument(std::string("gradsync: ") + who +
                          "::clip_grad_norm expects a finite max_norm >= 0, got " + std::to_string(max_norm));
  }
}

/// The larger of two partials of order ∞, NaN if either is: std::max (and
/// MPI_MAX) keep the first operand whenever a comparison with NaN is false,
/// so a NaN gradient would vanish from the norm, as a sum never lets it.
inline double max_keeping_nan(double a, double b) noexcept {
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN() : std::max(a, b);
}

/// A partial of order ∞ as two doubles that any Max all-reduce combines
/// without losing a NaN: the partial with NaN as 0, and 1 where it was NaN.
/// combined_inf_partial reads the result back.
inline std::array<double, 2> inf_partial_for_max(double partial) noexcept {
  return std::isnan(partial) ? std::array<double, 2>{0.0, 1.0} : std::array<double, 2>{partial, 0.0};
}
inline double combined_inf_partial(const std::array<double, 2>& combined) noexcept {
  return combined[1] != 0 ? std::numeric_limits<double>::quiet_NaN() : combined[0];
}

/// Σ|g|^p over `grads`, in double; for p = ∞ the largest |g|, NaN if any g
/// is NaN (as PyTorch's norm). Partials of disjoint shards combine by Sum
/// (for ∞: max_keeping_nan, or Max over inf_partial_for_max).
template <class T>
double norm_partial(std::span<const T> grads, double p) {
  double acc = 0;
  if (std::isinf(p)) {
    for (const T g : grads) acc = max_keeping_nan(acc, std::abs(static_cast<double>(g)));
  } else if (p == 2) {
    for (const T g : grads) acc += static_cast<double>(g) * static_cast<double>(g);
  } else if (p == 1) {
    for (const T g : grads) acc += std::abs(static_cast<double>(g));
  } else {
    for (const T g : grads) acc += std::pow(std::abs(static_cast<double>(g)), p);
  }
  return acc;
}

/// The norm from the combined partial.
inline double norm_total(double combined, double p) {
  if (std::isinf(p) || p == 1) return combined;
  if (p == 2) return std::sqrt(combined);
  return std::pow(combined, 1 / p);
}

/// PyTorch's rule: scale by max_norm / (norm + 1e-6) when that is below 1.
/// A NaN norm makes the factor NaN, and torch's clamp keeps it: every
/// gradient becomes NaN, rather than the finite ones going on unclipped.
template <class T>
void clip_to(std::span<T> grads, double total, double max_norm) {
  const double coef = max_norm / (total + 1e-6);
  if (coef >= 1) return;
  const T c = static_cast<T>(coef);
  for (T& g : grads) g *= c;
}

}  // namespace gradsync::detail

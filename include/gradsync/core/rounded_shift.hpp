#pragma once
/// \file rounded_shift: dropping a float's low mantissa bits with rounding to
/// nearest, ties to even, as bfloat16 and float16 both do.

#include <cstdint>

namespace gradsync::detail {

/// `u >> N`, rounded to nearest with ties to even rather than truncated:
/// adding one less than half of the dropped range, plus the lowest kept bit,
/// carries into the kept bits exactly when the dropped part is above half,
/// or exactly half with an odd kept part. A carry out of the mantissa
/// raises the exponent, which is the right answer (up to infinity). The sum
/// wraps for `u` within 2^(N-1) of 2^32 (negative NaNs), which callers
/// handle apart.
template <unsigned N>
constexpr std::uint32_t rounded_shift(std::uint32_t u) noexcept {
  static_assert(N > 0 && N < 32);
  return (u + ((std::uint32_t{1} << (N - 1)) - 1u) + ((u >> N) & 1u)) >> N;
}

}  // namespace gradsync::detail

#pragma once
/// \file x[j] = sqrt(x[j]) over a fixed-size block, in vector registers where the target has them.

#include <cmath>
#include <cstddef>
#include <type_traits>

#if defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#endif

namespace gradsync::detail {

/// Replaces each of x[0, W) by its square root, correctly rounded as
/// std::sqrt's (IEEE 754 requires it of both), so results are the same
/// bits on every path.
///
/// Why not a plain loop of std::sqrt: with errno set by math functions (the
/// default of GCC and Clang), std::sqrt is a scalar instruction plus a branch
/// to the library for a negative argument, and no compiler vectorizes it;
/// Adam's step then ran at 1.75 ns per element, scalar sqrt bound, half the
/// memory bound (bench/optim_step). The x86 intrinsics below are the same
/// instructions without errno (no caller passes a negative value: Adam's v is
/// a sum of squares). Elsewhere the loop is std::sqrt's.
template <class T, std::size_t W>
void sqrt_in_place(T* x) noexcept {
#if defined(__AVX__)
  if constexpr (std::is_same_v<T, float> && W % 8 == 0) {
    for (std::size_t j = 0; j < W; j += 8) _mm256_storeu_ps(x + j, _mm256_sqrt_ps(_mm256_loadu_ps(x + j)));
    return;
  } else if constexpr (std::is_same_v<T, double> && W % 4 == 0) {
    for (std::size_t j = 0; j < W; j += 4) _mm256_storeu_pd(x + j, _mm256_sqrt_pd(_mm256_loadu_pd(x + j)));
    return;
  }
#elif defined(__SSE2__)
  if constexpr (std::is_same_v<T, float> && W % 4 == 0) {
    for (std::size_t j = 0; j < W; j += 4) _mm_storeu_ps(x + j, _mm_sqrt_ps(_mm_loadu_ps(x + j)));
    return;
  } else if constexpr (std::is_same_v<T, double> && W % 2 == 0) {
    for (std::size_t j = 0; j < W; j += 2) _mm_storeu_pd(x + j, _mm_sqrt_pd(_mm_loadu_pd(x + j)));
    return;
  }
#endif
  for (std::size_t j = 0; j < W; ++j) x[j] = std::sqrt(x[j]);
}

}  // namespace gradsync::detail

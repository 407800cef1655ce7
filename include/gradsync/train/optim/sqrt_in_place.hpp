#pragma once
/// \file x[j] = sqrt(x[j]) over a fixed-size block, in vector registers where the target has them.

#include <cmath>
#include <cstddef>
#include <type_traits>

#if defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#endif

namespace gradsync::detail {

/// f(x + j) for j = 0, L, 2L, ... below W: one vector register of L lanes each.
template <std::size_t L, std::size_t W, class T, class F>
void for_each_register(T* x, F f) noexcept {
  for (std::size_t j = 0; j < W; j += L) f(x + j);
}

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
/// a sum of squares), 256 bits wide where AVX is on: 128-bit ones there left
/// Adam at 0.6 of the bound on 16M parameters. Elsewhere the loop is std::sqrt's.
template <class T, std::size_t W>
void sqrt_in_place(T* x) noexcept {
  constexpr bool f32 = std::is_same_v<T, float>, f64 = std::is_same_v<T, double>;
#if defined(__AVX__)
  if constexpr (f32 && W % 8 == 0) {
    return for_each_register<8, W>(x, [](float* y) { _mm256_storeu_ps(y, _mm256_sqrt_ps(_mm256_loadu_ps(y))); });
  } else if constexpr (f64 && W % 4 == 0) {
    return for_each_register<4, W>(x, [](double* y) { _mm256_storeu_pd(y, _mm256_sqrt_pd(_mm256_loadu_pd(y))); });
  }
#elif defined(__SSE2__)
  if constexpr (f32 && W % 4 == 0) {
    return for_each_register<4, W>(x, [](float* y) { _mm_storeu_ps(y, _mm_sqrt_ps(_mm_loadu_ps(y))); });
  } else if constexpr (f64 && W % 2 == 0) {
    return for_each_register<2, W>(x, [](double* y) { _mm_storeu_pd(y, _mm_sqrt_pd(_mm_loadu_pd(y))); });
  }
#endif
  for (std::size_t j = 0; j < W; ++j) x[j] = std::sqrt(x[j]);
}

}  // namespace gradsync::detail

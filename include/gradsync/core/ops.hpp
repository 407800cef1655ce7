#pragma once
/// \file Reduction operators: Sum, Avg, Min, Max, Prod.
///
/// An op combines two elements with `apply(a, b)`; `Avg` is a `Sum` whose
/// result is divided by the world size once, at the end (`finish`). bfloat16
/// and float16 operands are widened to float for each step and rounded back, so every
/// algorithm rounds at the same points.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync {

enum class OpKind : std::uint8_t { sum, avg, min, max, prod };

namespace detail {
template <class T, class F>
constexpr T combine(T a, T b, F f) noexcept {
  if constexpr (is_half_storage_v<T>) {
    return T(static_cast<float>(f(static_cast<float>(a), static_cast<float>(b))));
  } else {
    return static_cast<T>(f(a, b));
  }
}
}  // namespace detail

/// Element-wise sum.
struct Sum {
  static constexpr OpKind kind = OpKind::sum;
  static constexpr std::string_view name = "sum";
  template <class T>
  static constexpr T apply(T a, T b) noexcept {
    return detail::combine(a, b, [](auto x, auto y) { return x + y; });
  }
};

/// Sum divided by the world size: what gradient averaging needs. Integers
/// divide with truncation toward zero, as C++ does.
struct Avg {
  static constexpr OpKind kind = OpKind::avg;
  static constexpr std::string_view name = "avg";
  template <class T>
  static constexpr T apply(T a, T b) noexcept {
    return Sum::apply(a, b);
  }
  template <class T>
  static constexpr T finish(T x, int world) noexcept {
    if constexpr (is_half_storage_v<T>) {
      return T(static_cast<float>(x) / static_cast<float>(world));
    } else {
      return static_cast<T>(x / static_cast<T>(world));
    }
  }
};

/// Element-wise minimum.
struct Min {
  static constexpr OpKind kind = OpKind::min;
  static constexpr std::string_view name = "min";
  template <class T>
  static constexpr T apply(T a, T b) noexcept {
    return detail::combine(a, b, [](auto x, auto y) { return std::min(x, y); });
  }
};

/// Element-wise maximum.
struct Max {
  static constexpr OpKind kind = OpKind::max;
  static constexpr std::string_view name = "max";
  template <class T>
  static constexpr T apply(T a, T b) noexcept {
    return detail::combine(a, b, [](auto x, auto y) { return std::max(x, y); });
  }
};

/// Element-wise product.
struct Prod {
  static constexpr OpKind kind = OpKind::prod;
  static constexpr std::string_view name = "prod";
  template <class T>
  static constexpr T apply(T a, T b) noexcept {
    return detail::combine(a, b, [](auto x, auto y) { return x * y; });
  }
};

/// One of the ops above (or a user op shaped like them).
template <class Op>
concept ReduceOp = requires {
  { Op::kind } -> std::convertible_to<OpKind>;
  { Op::template apply<float>(1.0f, 1.0f) } -> std::same_as<float>;
};

/// Ops that need a last pass after the reduction (Avg).
template <class Op>
concept HasFinish = requires { Op::template finish<float>(1.0f, 1); };

namespace detail {

/// dst[i] = op(dst[i], src[i]): the local reduce every algorithm is built on.
template <ReduceOp Op, class T>
void reduce_into(T* __restrict dst, const T* __restrict src, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) dst[i] = Op::apply(dst[i], src[i]);
}

/// dst[i] = op(a[i], b[i]), for out-of-place first steps.
template <ReduceOp Op, class T>
void reduce_to(T* __restrict dst, const T* a, const T* b, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) dst[i] = Op::apply(a[i], b[i]);
}

/// Applies Op::finish (Avg's division) in place; a no-op for other ops.
template <ReduceOp Op, class T>
void finish(T* x, std::size_t n, int world) noexcept {
  if constexpr (HasFinish<Op>) {
    for (std::size_t i = 0; i < n; ++i) x[i] = Op::finish(x[i], world);
  }
}

}  // namespace detail
}  // namespace gradsync

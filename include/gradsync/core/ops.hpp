#pragma once
/// \file Reduction operators: Sum, Avg, Min, Max, Prod.
///
/// An op combines two elements with `apply(a, b)`; `Avg` is a `Sum` whose
/// result is divided by the world size once, at the end (`finish`). bfloat16
/// and float16 operands are widened to float for each step and rounded back, so every
/// algorithm rounds at the same points. Integer sums and products wrap modulo
/// 2^bits (two's complement), computed in the unsigned type: no signed overflow.

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string_view>
#include <type_traits>

#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync {

enum class OpKind : std::uint8_t { sum, avg, min, max, prod };

namespace detail {
template <class T, class F>
constexpr T combine(T a, T b, F f) noexcept {
  if constexpr (detail::is_half_storage_v<T>) {
    return T(static_cast<float>(f(static_cast<float>(a), static_cast<float>(b))));
  } else {
    return static_cast<T>(f(a, b));
  }
}

/// Whether floating-point x has its sign bit set (−0 too).
template <class F>
constexpr bool sign_bit(F x) noexcept {
  if constexpr (sizeof(F) == sizeof(std::uint32_t)) {
    return (std::bit_cast<std::uint32_t>(x) >> 31) != 0;
  } else {
    return (std::bit_cast<std::uint64_t>(x) >> 63) != 0;
  }
}

/// min(x, y) (`Greater`: max(x, y)) whose bits do not depend on the
/// operands' order, as std::min's do (it returns its first operand when a
/// comparison with NaN is false, so a NaN on one rank would survive one
/// algorithm and vanish under another): a NaN operand gives the quiet NaN
/// (whatever its payload), −0 is below +0. Integers: std::min (std::max).
template <bool Greater>
struct Extremum {
  template <class V>
  constexpr V operator()(V x, V y) const noexcept {
    if constexpr (std::is_floating_point_v<V>) {
      if (x != x || y != y) return std::numeric_limits<V>::quiet_NaN();
      if (x == y) return sign_bit(x) != Greater ? x : y;
    }
    return (Greater ? x < y : y < x) ? y : x;
  }
};

/// The unsigned type integer T computes in: at least unsigned int, so that
/// a narrow type is not promoted back to (signed) int before the operation.
template <class T>
using wrap_unsigned_t = std::common_type_t<std::make_unsigned_t<T>, unsigned>;

/// True for the integer types whose sum and product wrap (not bool).
template <class T>
inline constexpr bool wraps_v = std::is_integral_v<T> && !std::is_same_v<T, bool>;

/// `Arith` (std::plus<>, std::multiplies<>) of x and y; for the integers
/// that wrap, modulo 2^bits: unsigned arithmetic is defined to wrap, and the
/// conversion back to a signed type is modulo 2^bits since C++20. It
/// compiles to the same instruction as the signed one, so loops vectorize alike.
template <class Arith>
struct Wrapping {
  template <class V>
  constexpr auto operator()(V x, V y) const noexcept {
    if constexpr (wraps_v<V>) {
      using U = wrap_unsigned_t<V>;
      return static_cast<V>(static_cast<U>(Arith{}(static_cast<U>(x), static_cast<U>(y))));
    } else {
      return Arith{}(x, y);
    }
  }
};

/// What every op has: its kind, and apply(a, b), which combines two
/// elements with `Fn` (on float for bfloat16 and float16: see combine).
template <OpKind Kind, class Fn>
struct ElementwiseOp {
  static constexpr OpKind kind = Kind;
  template <class T>
  static constexpr T apply(T a, T b) noexcept {
    return combine(a, b, Fn{});
  }
};
}  // namespace detail

/// Element-wise sum. Integers wrap modulo 2^bits (two's complement).
struct Sum : detail::ElementwiseOp<OpKind::sum, detail::Wrapping<std::plus<>>> {
  static constexpr std::string_view name = "sum";
};

/// Sum divided by the world size: what gradient averaging needs. Integers
/// take the wrapped sum and divide it by the world size with truncation
/// toward zero, as C++ does. float16 sums in float16 (each step rounded)
/// before the division, so a sum past 65504 is Inf where the mean would not
/// be (NCCL, which the Nccl backend's Native uses, scales each input first):
/// scale by 1/N and Sum where that can happen, as GradSync does with float16
/// gradients.
struct Avg : detail::ElementwiseOp<OpKind::avg, detail::Wrapping<std::plus<>>> {
  static constexpr std::string_view name = "avg";
  template <class T>
  static constexpr T finish(T x, int world) noexcept {
    if constexpr (detail::is_half_storage_v<T>) {
      return T(static_cast<float>(x) / static_cast<float>(world));
    } else {
      return static_cast<T>(x / static_cast<T>(world));
    }
  }
};

/// Element-wise minimum. A NaN operand makes the result the quiet NaN, and
/// −0 is below +0: every algorithm, whatever order it meets the ranks'
/// values in, gives the same bits.
struct Min : detail::ElementwiseOp<OpKind::min, detail::Extremum<false>> {
  static constexpr std::string_view name = "min";
};

/// Element-wise maximum; a NaN operand makes the quiet NaN, +0 is above −0 (see Min).
struct Max : detail::ElementwiseOp<OpKind::max, detail::Extremum<true>> {
  static constexpr std::string_view name = "max";
};

/// Element-wise product. Integers wrap modulo 2^bits (two's complement).
struct Prod : detail::ElementwiseOp<OpKind::prod, detail::Wrapping<std::multiplies<>>> {
  static constexpr std::string_view name = "prod";
};

/// One of the five ops above. Only these: the backends reduce by OpKind (an
/// MPI_Op, an NCCL op, a device kernel), so a user-defined op's own apply()
/// would never run, and a type that merely looked like an op would silently
/// reduce as whatever kind it claimed.
template <class Op>
concept ReduceOp = std::same_as<Op, Sum> || std::same_as<Op, Avg> || std::same_as<Op, Min> ||
                   std::same_as<Op, Max> || std::same_as<Op, Prod>;

namespace detail {

/// Ops that need a last pass after the reduction (Avg).
template <class Op>
concept HasFinish = requires { Op::template finish<float>(1.0f, 1); };

/// Elements per block of the local kernels below: one 64-byte cache line.
template <class T>
inline constexpr std::size_t simd_block = 64 / sizeof(T) > 0 ? 64 / sizeof(T) : 1;

/// Calls f(i) for each i in [0, n): in blocks of simd_block<T>, then the tail.
///
/// Why blocks: GCC at -O2 (Meson's debugoptimized, CMake's RelWithDebInfo)
/// vectorizes a loop only when its trip count is a known multiple of the
/// vector width, so the plain loop ran scalar there: 13 GB/s against 42 GB/s
/// for float sum on 256 KiB in cache (bench/reduce_kernel). A fixed-size inner
/// loop vectorizes at any -O level, and the tail is under one block.
template <class T, class F>
void for_each_blocked(std::size_t n, F f) noexcept {
  constexpr std::size_t w = simd_block<T>;
  std::size_t i = 0;
  for (; i + w <= n; i += w) {
    for (std::size_t j = 0; j < w; ++j) f(i + j);
  }
  for (; i < n; ++i) f(i);
}

/// dst[i] = op(dst[i], src[i]): the local reduce every algorithm is built on.
template <ReduceOp Op, class T>
void reduce_into(T* __restrict dst, const T* __restrict src, std::size_t n) noexcept {
  for_each_blocked<T>(n, [dst, src](std::size_t i) { dst[i] = Op::apply(dst[i], src[i]); });
}

/// Applies Op::finish (Avg's division) in place; a no-op for other ops.
template <ReduceOp Op, class T>
void finish(T* x, std::size_t n, int world) noexcept {
  if constexpr (HasFinish<Op>) {
    for_each_blocked<T>(n, [x, world](std::size_t i) { x[i] = Op::finish(x[i], world); });
  }
}

}  // namespace detail
}  // namespace gradsync

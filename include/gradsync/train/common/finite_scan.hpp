#pragma once
/// \file detail::FiniteScan: whether any of a run of values is NaN or ±Inf,
/// folded into a loop that already reads them.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include "gradsync/core/types.hpp"

namespace gradsync::detail {

/// A value is NaN or ±Inf exactly when its exponent field is all ones,
/// the largest it can be: so the running maximum of the exponent fields
/// says whether any value seen was. An integer maximum has no branch and
/// no floating-point exception, and compilers vectorise it, so it rides
/// along a copy or a scaling loop at no measurable cost. 16-bit values
/// (bfloat16, float16) are checked as float.
///
/// \tparam T  the element type: float, double, bfloat16 or float16.
template <class T>
struct FiniteScan {
  using checked = std::conditional_t<is_half_storage_v<T>, float, T>;
  static_assert(std::is_same_v<checked, float> || std::is_same_v<checked, double>,
                "gradsync::detail::FiniteScan checks float, double, bfloat16 or float16");
  using word = std::conditional_t<sizeof(checked) == 4, std::uint32_t, std::uint64_t>;
  static constexpr word exponent = sizeof(checked) == 4 ? word(0x7f800000u) : word(0x7ff0000000000000ull);

  /// The state of a scan that has seen nothing.
  static constexpr word start = 0;

  /// `seen` after one more value `x`.
  static word fold(word seen, T x) noexcept {
    return std::max(seen, std::bit_cast<word>(static_cast<checked>(x)) & exponent);
  }
  /// A scan that saw a NaN or an Inf.
  static bool found(word seen) noexcept { return seen == exponent; }

  /// Whether any of `xs` is NaN or ±Inf: one read of each, no branch.
  static bool any(std::span<const T> xs) noexcept {
    word seen = start;
    for (const T x : xs) seen = fold(seen, x);
    return found(seen);
  }
};

}  // namespace gradsync::detail

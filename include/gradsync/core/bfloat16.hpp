#pragma once
/// \file A 16-bit brain float: the top half of an IEEE binary32.

#include <bit>
#include <cstdint>

#include "gradsync/core/rounded_shift.hpp"

namespace gradsync {

/// bfloat16 storage type. Arithmetic happens in float; conversion from float
/// rounds to nearest, ties to even, and keeps NaNs quiet.
struct bfloat16 {
  std::uint16_t bits = 0;

  constexpr bfloat16() = default;
  constexpr bfloat16(float f) noexcept : bits(round_from(f)) {}  // NOLINT: implicit like a float literal

  static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 r;
    r.bits = b;
    return r;
  }

  constexpr explicit operator float() const noexcept {
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  }

  friend constexpr bool operator==(bfloat16 a, bfloat16 b) noexcept { return a.bits == b.bits; }

 private:
  static constexpr std::uint16_t round_from(float f) noexcept {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    const std::uint32_t rounded = detail::rounded_shift<16>(u);
    // A NaN must stay a NaN after truncation, so force a mantissa bit. A
    // select rather than an early return keeps the conversion branch-free,
    // so a loop of them vectorizes.
    const std::uint32_t quiet = (u >> 16) | 0x0040u;
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    return static_cast<std::uint16_t>(nan ? quiet : rounded);
  }
};

static_assert(sizeof(bfloat16) == 2);

}  // namespace gradsync

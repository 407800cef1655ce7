#pragma once
/// \file A 16-bit IEEE binary16 ("half") storage type.

#include <bit>
#include <cstdint>

#include "gradsync/core/rounded_shift.hpp"

namespace gradsync {

/// IEEE 754 binary16 storage. Arithmetic happens in float; conversion from
/// float rounds to nearest, ties to even, with subnormals, infinities and
/// quiet NaNs. Device backends map it to their native half type (ncclFloat16).
struct float16 {
  std::uint16_t bits = 0;

  constexpr float16() = default;
  constexpr float16(float f) noexcept : bits(round_from(f)) {}  // NOLINT: implicit like a float literal

  static constexpr float16 from_bits(std::uint16_t b) noexcept {
    float16 r;
    r.bits = b;
    return r;
  }

  constexpr explicit operator float() const noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
    const std::uint32_t exp = (bits >> 10) & 0x1fu;
    const std::uint32_t man = bits & 0x3ffu;
    if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
    if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
    // Subnormal half: man * 2^-24, exact in float.
    const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }

  friend constexpr bool operator==(float16 a, float16 b) noexcept { return a.bits == b.bits; }

 private:
  static constexpr std::uint16_t round_from(float f) noexcept {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
    const std::uint32_t abs = u & 0x7fffffffu;
    if (abs >= 0x7f800000u) {  // inf or NaN
      return static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u | ((abs >> 13) & 0x3ffu) : 0u));
    }
    if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
    if (abs < 0x38800000u) {
      // Subnormal or zero in half: scale to an integer count of 2^-24 and
      // round to nearest even; 0x4b000000 is 2^23, whose ulp is 1.
      if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
      const float scaled = std::bit_cast<float>(abs) * 16777216.0f;  // * 2^24, exact
      const float rounded = (scaled + 8388608.0f) - 8388608.0f;      // RNE to integer
      return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(rounded));
    }
    // Normal: round the 13 dropped mantissa bits to nearest even, then
    // rebias the exponent from float's 127 to half's 15.
    return static_cast<std::uint16_t>(sign | (detail::rounded_shift<13>(abs) - (112u << 10)));
  }
};

static_assert(sizeof(float16) == 2);

}  // namespace gradsync

#pragma once
/// \file detail::hash_bytes: a fast 64-bit hash of a buffer, for the trainers' debug and agreement checks.

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace gradsync::detail {

/// 64-bit hash of a buffer's bits: a word-at-a-time multiply–xorshift, fast
/// enough to run over a whole model as a debug check. Not cryptographic.
inline std::uint64_t hash_bytes(const void* data, std::size_t bytes, std::uint64_t h) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  constexpr std::uint64_t k = 0x9E3779B97F4A7C15ull;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * k;
    h ^= h >> 29;
  }
  for (; i < bytes; ++i) h = (h ^ p[i]) * k;
  return h ^ (h >> 32);
}

}  // namespace gradsync::detail

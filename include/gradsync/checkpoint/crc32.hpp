#pragma once
/// \file CRC-32 (the zlib / IEEE 802.3 polynomial), the checksum every
/// checkpoint file stores for each tensor it holds.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

namespace gradsync::checkpoint {

namespace detail {

// Slicing-by-8 tables: table[k][b] is the CRC of byte b followed by k zero bytes.
consteval std::array<std::array<std::uint32_t, 256>, 8> crc32_tables() {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c & 1u) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k)
    for (std::size_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  return t;
}

inline constexpr auto crc32_table = crc32_tables();

}  // namespace detail

/// Incremental CRC-32 with the zlib parameters (reflected polynomial
/// 0xEDB88320, initial value and final xor 0xFFFFFFFF), so Python's
/// `zlib.crc32(data)` gives the same number. CRC-32 of "123456789" is 0xCBF43926.
class Crc32 {
 public:
  /// Feeds more bytes; the result is the same however the data is split.
  void update(std::span<const std::byte> bytes) noexcept {
    const auto& t = detail::crc32_table;
    std::uint32_t c = state_;
    const std::byte* p = bytes.data();
    std::size_t n = bytes.size();
    auto u = [](std::byte b) { return static_cast<std::uint32_t>(b); };
    while (n >= 8) {
      std::uint32_t lo = c ^ (u(p[0]) | u(p[1]) << 8 | u(p[2]) << 16 | u(p[3]) << 24);
      c = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
          t[3][u(p[4])] ^ t[2][u(p[5])] ^ t[1][u(p[6])] ^ t[0][u(p[7])];
      p += 8;
      n -= 8;
    }
    for (; n > 0; --n, ++p) c = (c >> 8) ^ t[0][(c ^ u(*p)) & 0xFFu];
    state_ = c;
  }

  /// The checksum of everything fed so far.
  std::uint32_t value() const noexcept { return state_ ^ 0xFFFFFFFFu; }

  /// One-shot checksum of `bytes`.
  static std::uint32_t of(std::span<const std::byte> bytes) noexcept {
    Crc32 c;
    c.update(bytes);
    return c.value();
  }

 private:
  std::uint32_t state_ = 0xFFFFFFFFu;
};

/// Eight lower-case hex digits, the form a checksum takes in `__metadata__`.
inline std::string crc32_hex(std::uint32_t v) {
  std::string s(8, '0');
  for (int i = 7; i >= 0; --i, v >>= 4) s[static_cast<std::size_t>(i)] = "0123456789abcdef"[v & 0xFu];
  return s;
}

/// The checksum back from crc32_hex's form; nothing for any other string.
inline std::optional<std::uint32_t> parse_crc32_hex(const std::string& s) {
  if (s.size() != 8) return std::nullopt;
  std::uint32_t v = 0;
  for (char c : s) {
    v <<= 4;
    if (c >= '0' && c <= '9') v |= static_cast<std::uint32_t>(c - '0');
    else if (c >= 'a' && c <= 'f') v |= static_cast<std::uint32_t>(c - 'a' + 10);
    else return std::nullopt;
  }
  return v;
}

}  // namespace gradsync::checkpoint

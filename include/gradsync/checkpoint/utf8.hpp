#pragma once
/// \file UTF-8 validation: a safetensors header is UTF-8 JSON, so the reader
/// refuses any other bytes in it and the writer any other bytes in a name.

#include <cstddef>
#include <string>
#include <string_view>

namespace gradsync::checkpoint::detail {

/// Bytes in the well-formed UTF-8 sequence that starts at `s[at]`, or 0 if
/// none does (Unicode's table 3-7: no overlong forms, no surrogates, nothing
/// above U+10FFFF, no sequence cut by the end of `s`).
constexpr std::size_t utf8_sequence_length(std::string_view s, std::size_t at) noexcept {
  auto byte = [&](std::size_t k) -> unsigned { return at + k < s.size() ? static_cast<unsigned char>(s[at + k]) : 0u; };
  auto tail = [&](std::size_t k) { return byte(k) >= 0x80 && byte(k) <= 0xBF; };
  const unsigned b0 = byte(0), b1 = byte(1);
  if (at >= s.size()) return 0;
  if (b0 < 0x80) return 1;
  if (b0 >= 0xC2 && b0 <= 0xDF) return tail(1) ? 2 : 0;
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    const unsigned lo = b0 == 0xE0 ? 0xA0 : 0x80, hi = b0 == 0xED ? 0x9F : 0xBF;
    return b1 >= lo && b1 <= hi && tail(2) ? 3 : 0;
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    const unsigned lo = b0 == 0xF0 ? 0x90 : 0x80, hi = b0 == 0xF4 ? 0x8F : 0xBF;
    return b1 >= lo && b1 <= hi && tail(2) && tail(3) ? 4 : 0;
  }
  return 0;
}

/// Offset of the first byte of `s` that does not begin a well-formed UTF-8
/// sequence, or npos when all of `s` is UTF-8.
constexpr std::size_t invalid_utf8_at(std::string_view s) noexcept {
  for (std::size_t i = 0; i < s.size();) {
    const auto n = utf8_sequence_length(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

/// `s` for a message: bytes that are not UTF-8, and control characters, as
/// \xNN, so that a message about a bad name is itself printable text.
inline std::string printable_utf8(std::string_view s) {
  std::string out;
  for (std::size_t i = 0; i < s.size();) {
    const auto n = utf8_sequence_length(s, i);
    const auto c = static_cast<unsigned char>(s[i]);
    if (n == 0 || c < 0x20 || c == 0x7F) {
      out += "\\x";
      out += "0123456789abcdef"[c >> 4];
      out += "0123456789abcdef"[c & 0xF];
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

}  // namespace gradsync::checkpoint::detail

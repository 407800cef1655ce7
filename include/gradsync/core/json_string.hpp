#pragma once
/// \file append_json_string: a string as a JSON literal, for the files gradsync writes.

#include <string>
#include <string_view>

namespace gradsync::detail {

/// Appends `s` as a JSON string literal; bytes >= 0x80 pass through as UTF-8.
inline void append_json_string(std::string& out, std::string_view s) {
  out += '"';
  for (char c : s) {
    auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20) {
      out += "\\u00";
      out += "0123456789abcdef"[u >> 4];
      out += "0123456789abcdef"[u & 0xF];
    } else {
      out += c;
    }
  }
  out += '"';
}

}  // namespace gradsync::detail

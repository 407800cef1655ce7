#pragma once
/// \file The JSON subset checkpoint headers and indexes use: objects, arrays,
/// strings and non-negative integers. The parser is strict (no duplicate
/// keys, no trailing garbage, integers that fit 64 bits) and refuses the rest
/// of JSON (floats, negatives, true/false/null) with a message.

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace gradsync::checkpoint::detail {

/// A parse error; the caller rethrows it naming the file.
class JsonError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A parsed value. Arrays and objects keep their elements in `items` (and an
/// object its keys, in file order, in `keys`): a recursive std::variant of
/// std::pair would need Json complete too early for some standard libraries.
struct Json {
  enum class Kind : std::uint8_t { integer, string, array, object };

  Kind kind = Kind::integer;
  std::uint64_t number = 0;
  std::string text;
  std::vector<Json> items;
  std::vector<std::string> keys;

  bool is_object() const noexcept { return kind == Kind::object; }
  bool is_array() const noexcept { return kind == Kind::array; }
  bool is_string() const noexcept { return kind == Kind::string; }
  bool is_integer() const noexcept { return kind == Kind::integer; }
  const std::string& string() const noexcept { return text; }
  std::uint64_t integer() const noexcept { return number; }
  /// Elements of an array.
  const std::vector<Json>& array() const noexcept { return items; }
  /// Members of an object, in file order.
  std::vector<std::pair<std::string_view, const Json*>> members() const {
    std::vector<std::pair<std::string_view, const Json*>> out;
    for (std::size_t i = 0; i < keys.size(); ++i) out.emplace_back(keys[i], &items[i]);
    return out;
  }
  /// Elements of an array or members of an object.
  std::size_t size() const noexcept { return items.size(); }

  /// The member `key` of an object, or null when absent.
  const Json* find(std::string_view key) const {
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (keys[i] == key) return &items[i];
    return nullptr;
  }
};

class JsonParser {
 public:
  explicit JsonParser(std::string_view text) : s_(text) {}

  Json parse_document() {
    Json v = parse_value(0);
    skip_space();
    if (i_ != s_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  static constexpr int max_depth = 32;

  [[noreturn]] void fail(const std::string& what) const {
    throw JsonError(what + " at byte " + std::to_string(i_));
  }

  void skip_space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }

  void expect(char c) {
    skip_space();
    if (i_ >= s_.size() || s_[i_] != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }

  bool consume(char c) {
    skip_space();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }

  Json parse_value(int depth) {
    if (depth > max_depth) fail("JSON nested too deeply");
    skip_space();
    if (i_ >= s_.size()) fail("unexpected end of JSON");
    char c = s_[i_];
    if (c == '{') return parse_object(depth);
    if (c == '[') return parse_array(depth);
    Json v;
    if (c == '"') {
      v.kind = Json::Kind::string;
      v.text = parse_string();
      return v;
    }
    if (c >= '0' && c <= '9') {
      v.number = parse_integer();
      return v;
    }
    fail("unsupported JSON value (only objects, arrays, strings and non-negative integers are allowed)");
  }

  Json parse_object(int depth) {
    ++i_;
    Json v;
    v.kind = Json::Kind::object;
    if (consume('}')) return v;
    do {
      skip_space();
      if (i_ >= s_.size() || s_[i_] != '"') fail("expected a string key");
      std::string key = parse_string();
      if (v.find(key)) fail("duplicate key \"" + key + "\"");
      expect(':');
      v.keys.push_back(std::move(key));
      v.items.push_back(parse_value(depth + 1));
    } while (consume(','));
    expect('}');
    return v;
  }

  Json parse_array(int depth) {
    ++i_;
    Json v;
    v.kind = Json::Kind::array;
    if (consume(']')) return v;
    do v.items.push_back(parse_value(depth + 1));
    while (consume(','));
    expect(']');
    return v;
  }

  std::uint64_t parse_integer() {
    if (s_[i_] == '0' && i_ + 1 < s_.size() && s_[i_ + 1] >= '0' && s_[i_ + 1] <= '9')
      fail("integer with a leading zero");
    std::uint64_t v = 0;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
      auto d = static_cast<std::uint64_t>(s_[i_] - '0');
      if (v > (UINT64_MAX - d) / 10) fail("integer does not fit 64 bits");
      v = v * 10 + d;
      ++i_;
    }
    if (i_ < s_.size() && (s_[i_] == '.' || s_[i_] == 'e' || s_[i_] == 'E')) fail("non-integer number");
    return v;
  }

  unsigned hex4() {
    if (i_ + 4 > s_.size()) fail("truncated \\u escape");
    unsigned v = 0;
    for (int k = 0; k < 4; ++k, ++i_) {
      char c = s_[i_];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<unsigned>(c - 'A' + 10);
      else fail("bad \\u escape");
    }
    return v;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string parse_string() {
    ++i_;
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("unterminated string");
      char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated string");
      switch (s_[i_++]) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {
            if (i_ + 2 > s_.size() || s_[i_] != '\\' || s_[i_ + 1] != 'u') fail("unpaired surrogate");
            i_ += 2;
            unsigned lo = hex4();
            if (lo < 0xDC00 || lo >= 0xE000) fail("unpaired surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            fail("unpaired surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("bad escape in a string");
      }
    }
  }

  std::string_view s_;
  std::size_t i_ = 0;
};

/// Parses `text` (one JSON value of the subset above).
inline Json parse_json(std::string_view text) { return JsonParser(text).parse_document(); }

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

}  // namespace gradsync::checkpoint::detail

#pragma once
/// \file The JSON subset checkpoint headers and indexes use: objects, arrays,
/// strings and non-negative integers. The parser is strict (UTF-8 only, no
/// duplicate keys, no trailing garbage, integers that fit 64 bits, at most
/// JsonParser::max_depth containers deep) and refuses the rest of JSON
/// (floats, negatives, true/false/null) with a message naming the byte. It
/// takes time linear in the text (n log n in one object's keys), so a hostile
/// file is refused about as fast as a good one is read: values are 24-byte
/// nodes in large blocks, strings are views into the text (unescaped in place).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/checkpoint/utf8.hpp"
#include "gradsync/core/json_string.hpp"

namespace gradsync::checkpoint::detail {

/// A parse error; the caller rethrows it naming the file. what() is
/// "<reason> at byte <offset>".
class JsonError : public std::runtime_error {
 public:
  JsonError(const std::string& reason, std::size_t offset)
      : std::runtime_error(reason + " at byte " + std::to_string(offset)), reason_(reason), offset_(offset) {}

  /// What is wrong, without where.
  const std::string& reason() const noexcept { return reason_; }
  /// The byte of the text where it was found.
  std::size_t offset() const noexcept { return offset_; }

 private:
  std::string reason_;
  std::size_t offset_;
};

/// A parsed value: a view into the JsonDocument that holds it, valid while
/// that document lives. An object's members are values with a key().
class Json {
 public:
  enum class Kind : std::uint8_t { integer, string, array, object };

  Kind kind() const noexcept { return static_cast<Kind>(kind_); }
  bool is_object() const noexcept { return kind() == Kind::object; }
  bool is_array() const noexcept { return kind() == Kind::array; }
  bool is_string() const noexcept { return kind() == Kind::string; }
  bool is_integer() const noexcept { return kind() == Kind::integer; }
  /// The text of a string (empty for other kinds).
  std::string_view string() const noexcept { return is_string() ? std::string_view(u_.chars, len_) : std::string_view(); }
  /// The value of an integer (0 for other kinds).
  std::uint64_t integer() const noexcept { return is_integer() ? u_.number : 0; }
  /// The key of an object's member (empty for other values).
  std::string_view key() const noexcept { return {key_, key_len_}; }
  /// Elements of an array (or members of an object), in file order.
  std::span<const Json> array() const noexcept { return {children(), size()}; }
  /// Members of an object, in file order.
  std::vector<std::pair<std::string_view, const Json*>> members() const {
    std::vector<std::pair<std::string_view, const Json*>> out;
    out.reserve(size());
    for (const auto& m : array()) out.emplace_back(m.key(), &m);
    return out;
  }
  /// Elements of an array or members of an object.
  std::size_t size() const noexcept { return is_array() || is_object() ? len_ : 0; }

  /// The member `key` of an object, or null when absent. Linear: callers
  /// look up a few fixed keys, and iterate members() for the rest.
  const Json* find(std::string_view key) const {
    if (!is_object()) return nullptr;
    for (const auto& m : array())
      if (m.key() == key) return &m;
    return nullptr;
  }

 private:
  friend class JsonParser;

  const Json* children() const noexcept { return size() ? u_.children : nullptr; }

  void set_kind(Kind k) noexcept { kind_ = static_cast<std::uint32_t>(k); }

  // 24 bytes a value (a header holds about 9 a tensor): which member of u_
  // is live follows kind_, and lengths take 30 bits (JsonParser::max_bytes).
  union {
    std::uint64_t number;
    const char* chars;
    // The first of a container's children, which lie next to each other.
    const Json* children;
  } u_{0};
  const char* key_ = nullptr;
  // A string's length or a container's number of children.
  std::uint32_t len_ = 0;
  std::uint32_t key_len_ : 30 = 0;
  std::uint32_t kind_ : 2 = 0;
};
static_assert(sizeof(Json) == 24);

/// A parsed JSON text: owns the text (strings are views into it) and the
/// values. Movable; the values stay where they are.
class JsonDocument {
 public:
  /// The value the text holds (the integer 0 for a default-made document).
  const Json& root() const noexcept { return root_; }
  /// The byte of the text where `member` (an object's member in this
  /// document) starts: its key's opening quote.
  std::size_t offset_of(const Json& member) const noexcept {
    return static_cast<std::size_t>(member.key().data() - text_->data()) - 1;
  }

 private:
  friend class JsonParser;

  std::unique_ptr<std::string> text_;
  // Every value but the root, in blocks that never move.
  std::vector<std::unique_ptr<Json[]>> blocks_;
  Json root_;
};

/// Finds a repeated key among an object's keys. A hash table finds it in one
/// pass; keys chosen so that their hashes collide (a hash table's quadratic
/// case) make some key probe too far, and then sorting decides, in n log n
/// comparisons whatever the keys.
class DuplicateKeys {
 public:
  /// Probes one key may take before sorting decides (0: always sort).
  explicit DuplicateKeys(std::size_t max_probes = 32) : max_probes_(max_probes) {}

  /// The index of the first key (`key(k)` for k < n) equal to an earlier
  /// one, or n when all differ. n must be below 2^32.
  template <class KeyOf>
  std::size_t first(std::size_t n, const KeyOf& key) {
    compared_ = 0;
    std::size_t found = n;
    if (!by_hash_table(n, key, found)) found = by_sorting(n, key);
    return found;
  }

  /// Comparisons of key text the last first() made.
  std::size_t compared() const noexcept { return compared_; }

 private:
  // Open addressing at a load of at most 1/2 (1.5 probes a key on average).
  // A slot holds the hash's high 32 bits and the key's index + 1 (0: empty).
  // False when a key probes more than max_probes_.
  template <class KeyOf>
  bool by_hash_table(std::size_t n, const KeyOf& key, std::size_t& found) {
    std::size_t size = 16;
    while (size < 2 * n) size *= 2;
    slots_.assign(size, {0, 0});
    for (std::size_t k = 0; k < n; ++k) {
      const std::string_view text = key(k);
      const std::uint64_t h = std::hash<std::string_view>{}(text);
      const auto tag = static_cast<std::uint32_t>(h >> 32);
      for (std::size_t slot = h & (size - 1), probes = 0;; slot = (slot + 1) & (size - 1)) {
        auto& [slot_tag, index] = slots_[slot];
        if (index == 0) {
          slots_[slot] = {tag, static_cast<std::uint32_t>(k + 1)};
          break;
        }
        if (slot_tag == tag && (++compared_, key(index - 1) == text)) {
          found = k;
          return true;
        }
        if (++probes > max_probes_) return false;
      }
    }
    return true;
  }

  // Sorts by hash, then keys of equal hash by text.
  template <class KeyOf>
  std::size_t by_sorting(std::size_t n, const KeyOf& key) {
    sorted_.resize(n);
    for (std::size_t k = 0; k < n; ++k) sorted_[k] = {std::hash<std::string_view>{}(key(k)), k};
    std::sort(sorted_.begin(), sorted_.end());
    std::size_t found = n;
    for (std::size_t lo = 0, hi = 0; lo < n; lo = hi) {
      while (hi < n && sorted_[hi].first == sorted_[lo].first) ++hi;
      if (hi - lo < 2) continue;
      std::sort(sorted_.begin() + static_cast<std::ptrdiff_t>(lo), sorted_.begin() + static_cast<std::ptrdiff_t>(hi),
                [&](const auto& a, const auto& b) {
                  ++compared_;
                  const int c = std::string_view(key(a.second)).compare(key(b.second));
                  return c < 0 || (c == 0 && a.second < b.second);
                });
      for (std::size_t k = lo + 1; k < hi; ++k)
        if (++compared_, key(sorted_[k].second) == key(sorted_[k - 1].second))
          found = std::min(found, sorted_[k].second);
    }
    return found;
  }

  std::size_t max_probes_;
  std::size_t compared_ = 0;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> slots_;
  std::vector<std::pair<std::uint64_t, std::size_t>> sorted_;
};

class JsonParser {
 public:
  /// Most containers open at once. A safetensors header nests 3 deep and a
  /// sharded index 5; the parser recurses once per level, so the cap also
  /// bounds its stack.
  static constexpr int max_depth = 64;

  /// Longest text parsed: lengths are stored in 30 bits (safetensors caps a
  /// header at 100 MB).
  static constexpr std::size_t max_bytes = (std::size_t{1} << 30) - 1;

  explicit JsonParser(std::string text) {
    doc_.text_ = std::make_unique<std::string>(std::move(text));
    t_ = doc_.text_->data();
    n_ = doc_.text_->size();
  }

  JsonDocument parse_document() && {
    if (n_ > max_bytes)
      fail_at(0, "JSON text of " + std::to_string(n_) + " bytes is longer than the " + std::to_string(max_bytes) +
                     " the parser takes");
    doc_.root_ = parse_value(0);
    skip_space();
    if (i_ != n_) fail("unexpected text after the JSON value");
    return std::move(doc_);
  }

 private:
  // Blocks double from the first size to the last (384 KiB), unless one
  // container's children need more: a small header costs little memory and a
  // large one few allocations.
  static constexpr std::size_t first_block_values = 64;
  static constexpr std::size_t last_block_values = 16384;

  // Objects of up to this many keys (a tensor's entry) compare each new key
  // with the ones before; larger ones are checked once, at the end.
  static constexpr std::size_t few_keys = 16;

  [[noreturn]] void fail(const std::string& what) const { fail_at(i_, what); }
  [[noreturn]] static void fail_at(std::size_t at, const std::string& what) { throw JsonError(what, at); }

  void skip_space() {
    while (i_ < n_ && (t_[i_] == ' ' || t_[i_] == '\t' || t_[i_] == '\n' || t_[i_] == '\r')) ++i_;
  }

  void expect(char c) {
    skip_space();
    if (i_ >= n_) fail(std::string("unexpected end of JSON, expected '") + c + "'");
    if (t_[i_] != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }

  bool consume(char c) {
    skip_space();
    if (i_ < n_ && t_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }

  // `depth`: the containers open around this value.
  Json parse_value(int depth) {
    skip_space();
    if (i_ >= n_) fail("unexpected end of JSON");
    const char c = t_[i_];
    if (c == '{' || c == '[') {
      if (depth >= max_depth)
        fail("JSON nested more than " + std::to_string(max_depth) + " containers deep (checkpoint headers nest 3)");
      return parse_container(c == '{', depth + 1);
    }
    Json v;
    if (c == '"') {
      v.set_kind(Json::Kind::string);
      const auto s = parse_string();
      v.u_.chars = s.data();
      v.len_ = static_cast<std::uint32_t>(s.size());
      return v;
    }
    if (c >= '0' && c <= '9') {
      v.u_.number = parse_integer();
      return v;
    }
    if (c == '-') fail("negative number (sizes and offsets are non-negative integers)");
    fail("unsupported JSON value (only objects, arrays, strings and non-negative integers are allowed)");
  }

  // The children wait on a stack shared by all open containers, then move to
  // the document's blocks together, so that they lie next to each other.
  Json parse_container(bool object, int depth) {
    const std::size_t base = stack_.size();
    const char close = object ? '}' : ']';
    ++i_;
    if (!consume(close)) {
      do {
        std::string_view key;
        if (object) {
          skip_space();
          if (i_ >= n_ || t_[i_] != '"') fail("expected a string key");
          const std::size_t at = i_;
          key = parse_string();
          if (stack_.size() - base < few_keys)
            for (std::size_t k = base; k < stack_.size(); ++k)
              if (stack_[k].key() == key) fail_at(at, duplicate(key));
          expect(':');
        }
        Json v = parse_value(depth);
        v.key_ = key.data();
        v.key_len_ = static_cast<std::uint32_t>(key.size());
        stack_.push_back(v);
      } while (consume(','));
      expect(close);
    }
    const std::size_t count = stack_.size() - base;
    if (object && count > few_keys) check_unique(base);
    Json v;
    v.set_kind(object ? Json::Kind::object : Json::Kind::array);
    v.len_ = static_cast<std::uint32_t>(count);
    if (count > 0) {
      Json* at = place(count);
      std::copy(stack_.begin() + static_cast<std::ptrdiff_t>(base), stack_.end(), at);
      v.u_.children = at;
    }
    stack_.resize(base);
    return v;
  }

  // Room for `count` values next to each other, in the current block or a new one.
  Json* place(std::size_t count) {
    if (count > left_) {
      block_values_ = std::min(block_values_ * 2, last_block_values);
      const std::size_t size = std::max(count, block_values_);
      doc_.blocks_.push_back(std::make_unique<Json[]>(size));
      next_ = doc_.blocks_.back().get();
      left_ = size;
    }
    Json* at = next_;
    next_ += count;
    left_ -= count;
    return at;
  }

  static std::string duplicate(std::string_view key) {
    return "duplicate key \"" + printable_utf8(key) + "\" (each key may appear once in an object)";
  }

  void check_unique(std::size_t base) {
    const std::size_t n = stack_.size() - base;
    auto key = [&](std::size_t k) { return stack_[base + k].key(); };
    const std::size_t first = duplicates_.first(n, key);
    // A key's text starts one byte after its opening quote, unescaped or not.
    if (first < n) fail_at(static_cast<std::size_t>(key(first).data() - t_) - 1, duplicate(key(first)));
  }

  std::uint64_t parse_integer() {
    const std::size_t start = i_;
    std::size_t end = i_;
    while (end < n_ && t_[end] >= '0' && t_[end] <= '9') ++end;
    const std::string_view digits(t_ + start, end - start);
    auto shown = [&] { return std::string(digits.substr(0, 40)) + (digits.size() > 40 ? "..." : ""); };
    if (end < n_ && (t_[end] == '.' || t_[end] == 'e' || t_[end] == 'E'))
      fail_at(end, "number " + shown() + " has a fraction or an exponent (sizes and offsets are integers)");
    if (digits.size() > 1 && digits[0] == '0') fail_at(start, "number " + shown() + " has a leading zero");
    std::uint64_t v = 0;
    for (char c : digits) {
      auto d = static_cast<std::uint64_t>(c - '0');
      if (v > (UINT64_MAX - d) / 10) fail_at(start, "number " + shown() + " does not fit 64 bits");
      v = v * 10 + d;
    }
    i_ = end;
    return v;
  }

  unsigned hex4() {
    if (i_ + 4 > n_) fail("truncated \\u escape");
    unsigned v = 0;
    for (int k = 0; k < 4; ++k, ++i_) {
      const char c = t_[i_];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<unsigned>(c - 'A' + 10);
      else fail("bad \\u escape (4 hex digits expected)");
    }
    return v;
  }

  // The bytes a string holds as they are: printable ASCII but '"' and '\\'.
  static constexpr std::array<bool, 256> plain_bytes = [] {
    std::array<bool, 256> t{};
    for (int c = 0x20; c < 0x80; ++c) t[static_cast<std::size_t>(c)] = c != '"' && c != '\\';
    return t;
  }();

  // Writes `cp` at `out` (never past the escape it came from: 6 or 12 bytes
  // of text make at most 4 of UTF-8); returns the end.
  static char* put_utf8(char* out, unsigned cp) {
    if (cp < 0x80) {
      *out++ = static_cast<char>(cp);
    } else if (cp < 0x800) {
      *out++ = static_cast<char>(0xC0 | (cp >> 6));
      *out++ = static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      *out++ = static_cast<char>(0xE0 | (cp >> 12));
      *out++ = static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      *out++ = static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      *out++ = static_cast<char>(0xF0 | (cp >> 18));
      *out++ = static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      *out++ = static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      *out++ = static_cast<char>(0x80 | (cp & 0x3F));
    }
    return out;
  }

  // The string's text, unescaped in place: what an escape decodes to is never
  // longer than the escape, so writing trails reading and never passes it.
  // Every byte >= 0x80 must be part of well-formed UTF-8, so every string the
  // parser returns is UTF-8.
  std::string_view parse_string() {
    const std::size_t open = i_++;
    char* const begin = t_ + i_;
    char* out = begin;
    std::size_t run = i_;  // the plain bytes not yet moved to `out`
    auto flush = [&] {
      if (out != t_ + run) std::memmove(out, t_ + run, i_ - run);
      out += i_ - run;
    };
    while (true) {
      while (i_ < n_ && plain_bytes[static_cast<unsigned char>(t_[i_])]) ++i_;
      if (i_ >= n_) fail_at(open, "unterminated string");
      const auto c = static_cast<unsigned char>(t_[i_]);
      if (c == '"') {
        flush();
        ++i_;
        return {begin, static_cast<std::size_t>(out - begin)};
      }
      if (c < 0x20) fail("control character in a string (JSON needs it escaped)");
      if (c >= 0x80) {
        const auto len = utf8_sequence_length(std::string_view(t_, n_), i_);
        if (len == 0)
          fail("byte " + hex_byte(c) + " in a string is not UTF-8 (overlong, a surrogate, cut short or above U+10FFFF)");
        i_ += len;
        continue;
      }
      // c is '\\': an escape.
      flush();
      const std::size_t escape = i_++;
      if (i_ >= n_) fail_at(open, "unterminated string");
      switch (t_[i_++]) {
        case '"': *out++ = '"'; break;
        case '\\': *out++ = '\\'; break;
        case '/': *out++ = '/'; break;
        case 'b': *out++ = '\b'; break;
        case 'f': *out++ = '\f'; break;
        case 'n': *out++ = '\n'; break;
        case 'r': *out++ = '\r'; break;
        case 't': *out++ = '\t'; break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {
            if (i_ + 2 > n_ || t_[i_] != '\\' || t_[i_ + 1] != 'u') fail_at(escape, "unpaired surrogate \\u escape");
            i_ += 2;
            const unsigned lo = hex4();
            if (lo < 0xDC00 || lo >= 0xE000) fail_at(escape, "unpaired surrogate \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            fail_at(escape, "unpaired surrogate \\u escape");
          }
          out = put_utf8(out, cp);
          break;
        }
        default: fail_at(escape, "bad escape in a string");
      }
      run = i_;
    }
  }

  static std::string hex_byte(unsigned c) {
    return std::string("0x") + "0123456789ABCDEF"[c >> 4] + "0123456789ABCDEF"[c & 0xF];
  }

  JsonDocument doc_;
  char* t_ = nullptr;
  std::size_t n_ = 0;
  std::size_t i_ = 0;
  std::vector<Json> stack_;
  Json* next_ = nullptr;
  std::size_t left_ = 0;
  std::size_t block_values_ = first_block_values / 2;
  DuplicateKeys duplicates_;
};

/// Parses `text` (one JSON value of the subset above); the document keeps it.
inline JsonDocument parse_json(std::string text) { return JsonParser(std::move(text)).parse_document(); }

using gradsync::detail::append_json_string;

}  // namespace gradsync::checkpoint::detail

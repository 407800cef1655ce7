// Hostile safetensors files, one kind at a time: each is refused with a
// gradsync::Error that names the file and says what is wrong and where
// (the file byte, or the tensor and its header entry). Also the pieces the
// reader's linear time rests on: UTF-8 validation and duplicate-key search.
#include <doctest/doctest.h>

#include <gradsync/checkpoint/json.hpp>
#include <gradsync/checkpoint/safetensors_reader.hpp>
#include <gradsync/checkpoint/safetensors_writer.hpp>
#include <gradsync/checkpoint/shard_index.hpp>
#include <gradsync/checkpoint/utf8.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "support/common.hpp"
#include "support/sanitizers.hpp"
#include "support/temp_dir.hpp"
#include "test_checkpoint_read.hpp"

namespace test_checkpoint_hostile {

namespace ck = gradsync::checkpoint;
namespace fs = std::filesystem;
using namespace test_checkpoint_read;

namespace {

// The code point of the UTF-8 sequence at s[at] of length n, decoded without
// checks: the reference below judges the value, not the bit pattern.
std::uint32_t decode(std::string_view s, std::size_t at, std::size_t n) {
  auto b = [&](std::size_t k) { return static_cast<std::uint32_t>(static_cast<unsigned char>(s[at + k])); };
  if (n == 1) return b(0);
  if (n == 2) return (b(0) & 0x1F) << 6 | (b(1) & 0x3F);
  if (n == 3) return (b(0) & 0x0F) << 12 | (b(1) & 0x3F) << 6 | (b(2) & 0x3F);
  return (b(0) & 0x07) << 18 | (b(1) & 0x3F) << 12 | (b(2) & 0x3F) << 6 | (b(3) & 0x3F);
}

// RFC 3629 from its definitions: the lead byte gives the length, the rest are
// continuation bytes, and the value must need that length, be no surrogate
// and be at most U+10FFFF.
std::size_t reference_invalid_at(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const std::size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return i;
    for (std::size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return i;
    const auto cp = decode(s, i, n);
    const std::uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < least[n] || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return i;
    i += n;
  }
  return std::string_view::npos;
}

// A file in `dir` holding `text`.
fs::path put(const test::TempDir& dir, std::string_view text, const char* name = "hostile.safetensors") {
  const auto p = dir.path / name;
  put_text(p, text);
  return p;
}

// A header listing the one tensor 'w', its parts given as JSON text.
std::string header_of_w(std::string_view dtype, std::string_view shape, std::string_view offsets) {
  return "{" + entry("w", dtype, shape, offsets) + "}";
}

// The error opening a file of `header` and `data_bytes` bytes of data.
std::string refused(const test::TempDir& dir, std::string_view header, std::size_t data_bytes) {
  const auto p = put(dir, safetensors_bytes(header, data_bytes));
  auto msg = open_error(p);
  CHECK_MESSAGE(contains(msg, p.string()), "the error does not name the file: " << msg);
  return msg;
}

// "at byte N of the file" for the byte of `header` where `part` starts (its `nth` occurrence).
std::string file_byte_of(std::string_view header, std::string_view part, int nth = 1) {
  std::size_t at = header.find(part);
  while (--nth > 0) at = header.find(part, at + 1);
  REQUIRE(at != std::string_view::npos);
  return "at byte " + std::to_string(8 + at) + " of the file";
}

}  // namespace

TEST_CASE("UTF-8: boundaries of each length pass; overlong forms, surrogates, past U+10FFFF and cut sequences fail") {
  using ck::detail::invalid_utf8_at;
  constexpr auto ok = std::string_view::npos;
  for (std::string_view good : {"", "plain", "\x7f", "\xc2\x80", "\xdf\xbf", "\xe0\xa0\x80", "\xed\x9f\xbf",
                                "\xee\x80\x80", "\xef\xbf\xbf", "\xf0\x90\x80\x80", "\xf4\x8f\xbf\xbf",
                                "caf\xc3\xa9 \xe9\x87\x8d\xe3\x81\xbf \xf0\x9f\x98\x80"}) {
    INFO(ck::detail::printable_utf8(good));
    CHECK(invalid_utf8_at(good) == ok);
  }
  struct Bad {
    std::string_view text;
    std::size_t at;
  };
  for (Bad bad : {Bad{"\x80", 0}, {"a\xbf", 1}, {"\xc0\xaf", 0}, {"\xc1\xbf", 0}, {"\xe0\x80\xaf", 0},
                  {"\xe0\x9f\xbf", 0}, {"\xed\xa0\x80", 0}, {"\xed\xbf\xbf", 0}, {"\xf0\x80\x80\xaf", 0},
                  {"\xf0\x8f\xbf\xbf", 0}, {"\xf4\x90\x80\x80", 0}, {"\xf5\x80\x80\x80", 0}, {"ok\xff", 2},
                  {"\xfe", 0}, {"\xc3", 0}, {"x\xe2\x82", 1}, {"\xf0\x9f\x98", 0}, {"\xc3\x28", 0}}) {
    INFO(ck::detail::printable_utf8(bad.text));
    CHECK(invalid_utf8_at(bad.text) == bad.at);
  }
  CHECK(ck::detail::printable_utf8("a\xff\n\xc3\xa9") == "a\\xff\\x0a\xc3\xa9");

  // Random bytes near the boundaries, against a decoder written from the definitions.
  auto rng = test::rng_for("utf8 reference");
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  const unsigned char interesting[] = {0x00, 0x41, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1, 0xc2, 0xdf,
                                       0xe0, 0xe1, 0xec, 0xed, 0xee, 0xef, 0xf0, 0xf1, 0xf3, 0xf4, 0xf5, 0xff};
  for (int round = 0; round < 20000; ++round) {
    std::string s(1 + rng() % 6, '\0');
    for (auto& c : s) c = static_cast<char>(interesting[rng() % std::size(interesting)]);
    INFO(ck::detail::printable_utf8(s));
    REQUIRE(invalid_utf8_at(s) == reference_invalid_at(s));
  }
}

TEST_CASE("duplicate keys: the hash table and sorting find the same first duplicate, comparing few keys") {
  auto rng = test::rng_for("duplicate keys");
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  for (int round = 0; round < 200; ++round) {
    // Keys that share long prefixes, as tensor names do; some rounds plant duplicates.
    const std::size_t n = round == 0 ? 200000 : 1 + rng() % 3000;
    std::vector<std::string> keys;
    for (std::size_t k = 0; k < n; ++k)
      keys.push_back("model.layers." + std::to_string(k / 8) + ".w" + std::to_string(k % 8) +
                     std::string(rng() % 3, 'x'));
    if (round % 2 == 1)
      for (std::size_t d = 0, m = 1 + rng() % 3; d < m; ++d) keys[rng() % n] = keys[rng() % n];
    std::size_t want = n;
    std::set<std::string_view> seen;
    for (std::size_t k = 0; k < n; ++k)
      if (!seen.insert(keys[k]).second) want = std::min(want, k);
    const std::size_t repeats = n - seen.size();
    INFO("round " << round << ": " << n << " keys, first duplicate " << want);
    auto key = [&](std::size_t k) { return std::string_view(keys[k]); };
    ck::detail::DuplicateKeys hashed, sorted(0);
    CHECK(hashed.first(n, key) == want);
    CHECK(sorted.first(n, key) == want);
    // Text is compared only where hashes agree: a search key by key would compare about n^2 / 2.
    CHECK(hashed.compared() <= 8);
    CHECK(sorted.compared() <= 8 + 8 * repeats);
  }
}

TEST_CASE("a duplicate key is refused in small and large objects, after unescaping, at the byte of its second use") {
  using ck::detail::parse_json;
  auto offset_of_error = [](std::string text) -> std::size_t {
    try {
      parse_json(std::move(text));
    } catch (const ck::detail::JsonError& e) {
      CHECK(contains(e.reason(), "duplicate key"));
      return e.offset();
    }
    FAIL("no duplicate key found");
    return 0;
  };
  CHECK(offset_of_error(R"({"a":1,"b":2,"a":3})") == 13);
  CHECK(offset_of_error(R"({"a":1,"\u0061":2})") == 7);
  std::string big = "{";
  for (int k = 0; k < 40; ++k) big += "\"k" + std::to_string(k) + "\":" + std::to_string(k) + ",";
  const auto second = big.size();
  big += "\"k\\u0031\\u0037\":0}";  // k17 again, escaped
  CHECK(offset_of_error(big) == second);

  test::TempDir dir;
  std::string header = "{";
  for (int t = 0; t < 20; ++t)
    header += (t ? "," : "") + entry("t" + std::to_string(t == 17 ? 3 : t), "U8", "[1]",
                                     "[" + std::to_string(t) + "," + std::to_string(t + 1) + "]");
  header += "}";
  const std::string once = " (each key may appear once in an object) ";
  CHECK(contains(refused(dir, header, 20),
                 "the header is not valid: duplicate key \"t3\"" + once + file_byte_of(header, "\"t3\"", 2)));
  const std::string meta = R"({"__metadata__":{"x":"1","x":"2"}})";
  CHECK(contains(refused(dir, meta, 0), "duplicate key \"x\"" + once + file_byte_of(meta, "\"x\"", 2)));
  const std::string inner = R"({"w":{"dtype":"U8","shape":[1],"dtype":"U8","data_offsets":[0,1]}})";
  CHECK(contains(refused(dir, inner, 1), "duplicate key \"dtype\"" + once + file_byte_of(inner, "\"dtype\"", 2)));
}

TEST_CASE("nesting deeper than 64 containers is refused where it passes the cap, however deep, without a crash") {
  using ck::detail::parse_json;
  CHECK(parse_json(std::string(64, '[') + std::string(64, ']')).root().is_array());
  for (std::size_t depth : {65, 1000, 1000000}) {
    INFO("depth " << depth);
    try {
      parse_json(std::string(depth, '[') + std::string(depth, ']'));
      FAIL("parsed");
    } catch (const ck::detail::JsonError& e) {
      CHECK(contains(e.reason(), "nested more than 64 containers deep"));
      CHECK(e.offset() == 64);
    }
  }
  test::TempDir dir;
  const std::string header = "{\"x\":" + std::string(100000, '[');
  const auto msg = refused(dir, header, 0);
  CHECK(contains(msg, "nested more than 64 containers deep"));
  CHECK(contains(msg, "at byte " + std::to_string(8 + 4 + 64) + " of the file"));
}

TEST_CASE("numbers that are negative, fractional, in exponent form, zero-led or past 2^64 are refused at their byte") {
  test::TempDir dir;
  struct Case {
    std::string offsets;
    std::string says;
    std::string where;  // the part of the header the error points at
  };
  const std::string digits_1000(1000, '9');
  const std::string fraction = "has a fraction or an exponent (sizes and offsets are integers)";
  for (const Case& c : {Case{"[-1,4]", "negative number (sizes and offsets are non-negative integers)", "-1"},
                        {"[0,4.0]", "number 4 " + fraction, ".0"},
                        {"[0,4e0]", "number 4 " + fraction, "e0"},
                        {"[0,4E+0]", "number 4 " + fraction, "E+0"},
                        {"[00,4]", "number 00 has a leading zero", "00"},
                        {"[0,18446744073709551616]", "number 18446744073709551616 does not fit 64 bits",
                         "18446744073709551616"},
                        {"[0," + digits_1000 + "]", "number " + std::string(40, '9') + "... does not fit 64 bits",
                         digits_1000}}) {
    const std::string header = header_of_w("F32", "[1]", c.offsets);
    INFO(header.substr(0, 80));
    const auto msg = refused(dir, header, 4);
    CHECK_MESSAGE(contains(msg, "the header is not valid: " + c.says + " " + file_byte_of(header, c.where)), msg);
  }
  CHECK(contains(refused(dir, header_of_w("F32", "[-2]", "[0,8]"), 8), "negative number"));
}

TEST_CASE("a string that is not UTF-8 is refused wherever it is: a tensor name, a dtype, metadata") {
  test::TempDir dir;
  for (std::string_view bad : {"\xff", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe2\x82"}) {
    INFO(ck::detail::printable_utf8(bad));
    const std::string name = "w" + std::string(bad) + "x";
    const std::string header = "{" + entry(name, "U8", "[1]", "[0,1]") + "}";
    const auto msg = refused(dir, header, 1);
    const auto c = static_cast<unsigned char>(bad[0]);
    const char hex[] = "0123456789ABCDEF";
    CHECK(contains(msg, std::string("byte 0x") + hex[c >> 4] + hex[c & 0xF] + " in a string is not UTF-8"));
    CHECK(contains(msg, file_byte_of(header, bad)));
  }
  const std::string why = " in a string is not UTF-8 (overlong, a surrogate, cut short or above U+10FFFF) ";
  const std::string dtype = header_of_w("U\xc3", "[1]", "[0,1]");
  CHECK(contains(refused(dir, dtype, 1), "byte 0xC3" + why + file_byte_of(dtype, "\xc3")));
  const std::string meta = "{\"__metadata__\":{\"k\":\"v\xc1\xbf\"}}";
  CHECK(contains(refused(dir, meta, 0), "byte 0xC1" + why + file_byte_of(meta, "\xc1")));
  const std::string lone = R"({"w\udc00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  CHECK(contains(refused(dir, lone, 1), "unpaired surrogate \\u escape " + file_byte_of(lone, "\\udc00")));
  const std::string high = R"({"w\ud800x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  CHECK(contains(refused(dir, high, 1), "unpaired surrogate \\u escape " + file_byte_of(high, "\\ud800")));
  // Escaped, the same characters are fine.
  const std::string escaped = R"({"w\u00e9\ud83d\ude00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  const auto p = put(dir, safetensors_bytes(escaped, 1));
  CHECK(ck::SafetensorsReader(p, false).tensors().at(0).spec.name == "w\xc3\xa9\xf0\x9f\x98\x80");
}

TEST_CASE("data_offsets that overlap, leave a hole, end before they begin or reach past the file are refused") {
  test::TempDir dir;
  auto header_of = [](std::string_view a, std::string_view b) {
    return "{" + entry("a", "U8", "[8]", a) + "," + entry("b", "U8", "[8]", b) + "}";
  };
  CHECK(contains(refused(dir, header_of("[0,8]", "[4,12]"), 12),
                 "tensor 'b' starts at data offset 4, inside tensor 'a' (data_offsets overlap; the header is corrupted)"));
  CHECK(contains(refused(dir, header_of("[0,8]", "[12,20]"), 20),
                 "tensor 'b' starts at data offset 12, leaving 4 bytes after tensor 'a' that no tensor holds "
                 "(safetensors allows no holes"));
  CHECK(contains(refused(dir, header_of("[4,12]", "[12,20]"), 20),
                 "tensor 'a' starts at data offset 4, leaving 4 bytes after the start of the data"));
  CHECK(contains(refused(dir, header_of("[0,8]", "[8,16]"), 17), "the file has 1 bytes after the last tensor's data"));
  const std::string reversed = "{" + entry("a", "U8", "[8]", "[0,8]") + "," + entry("b", "U8", "[0]", "[8,0]") + "}";
  CHECK(contains(refused(dir, reversed, 8),
                 "tensor 'b' (its header entry at byte " + std::to_string(8 + reversed.find("\"b\"")) +
                     "): data_offsets [8, 0] end before they begin"));
  CHECK(contains(refused(dir, header_of("[0,8]", "[8,16]"), 12),
                 "truncated: tensor 'b' has data_offsets [8, 16], but the file holds 12 bytes of data after its header"));
  // Offsets near 2^64 are compared, never added.
  const std::string far = "{" + entry("a", "U8", "[7]", "[18446744073709551608,18446744073709551615]") + "}";
  CHECK(contains(refused(dir, far, 7), "truncated: tensor 'a' has data_offsets [18446744073709551608, "
                                       "18446744073709551615], but the file holds 7 bytes"));
  // Listed out of data order, the same tensors are a good file: the format orders them by offset.
  const auto p = put(dir, safetensors_bytes(header_of("[8,16]", "[0,8]"), 16), "reordered.safetensors");
  ck::SafetensorsReader r(p, false);
  REQUIRE(r.tensors().size() == 2);
  CHECK(r.tensors()[0].spec.name == "b");
  CHECK(r.find("a")->offset == r.find("b")->offset + 8);
}

TEST_CASE("a shape whose size overflows 64 bits, a size that does not match data_offsets, an unknown dtype") {
  test::TempDir dir;
  CHECK(contains(refused(dir, header_of_w("F32", "[4294967296,4294967296]", "[0,4]"), 4),
                 "tensor 'w' (its header entry at byte 9): shape [4294967296, 4294967296] of F32 is larger than "
                 "2^64 bytes (its size overflows 64 bits"));
  CHECK(contains(refused(dir, header_of_w("F64", "[2305843009213693952]", "[0,8]"), 8),
                 "shape [2305843009213693952] of F64 is larger than 2^64 bytes"));
  CHECK(contains(refused(dir, header_of_w("F32", "[3]", "[0,8]"), 8),
                 "tensor 'w' (its header entry at byte 9): data_offsets [0, 8] hold 8 bytes, but dtype F32 and shape "
                 "[3] need 12"));
  CHECK(contains(refused(dir, header_of_w("F8", "[1]", "[0,1]"), 1), "unknown dtype 'F8' (gradsync reads F64, F32"));
  CHECK(contains(refused(dir, header_of_w(std::string(1000, 'F'), "[1]", "[0,1]"), 1),
                 "unknown dtype '" + std::string(16, 'F') + "...' (gradsync reads"));
  // A shape of many dimensions is shown by its first few.
  std::string many = "[3";
  for (int k = 0; k < 9999; ++k) many += ",1";
  const auto msg = refused(dir, header_of_w("U8", many + "]", "[0,4]"), 4);
  CHECK(contains(msg, "hold 4 bytes, but dtype U8 and shape [3, 1, 1, 1, 1, 1, 1, 1, ... (10000 dimensions)] need 3"));
  CHECK(msg.size() < 400);
}

TEST_CASE("a truncated file: shorter than the length, a length past the file or the limit, the header or data cut") {
  test::TempDir dir;
  CHECK(contains(open_error(put(dir, std::string("\x10\x00\x00", 3))),
                 "truncated: 3 bytes, shorter than the 8-byte header length"));
  const std::string header = "{" + entry("a", "U8", "[4]", "[0,4]") + "," + entry("b", "U8", "[4]", "[4,8]") + "}";
  const std::string good = safetensors_bytes(header, 8);
  CHECK(open_error(put(dir, good)).empty());
  CHECK(contains(open_error(put(dir, safetensors_bytes(header, 8, 100'000'001))),
                 "the header length says 100000001 bytes, more than safetensors' limit of 100000000"));
  CHECK(contains(open_error(put(dir, safetensors_bytes(header, 8, UINT64_MAX))),
                 "the header length says 18446744073709551615 bytes, more than safetensors' limit"));
  CHECK(contains(open_error(put(dir, safetensors_bytes(header, 8, header.size() + 9))),
                 "truncated: the header says it is " + std::to_string(header.size() + 9) + " bytes, but only " +
                     std::to_string(header.size() + 8) + " follow the length"));
  const auto cut = good.substr(0, 8 + header.size() / 2);
  CHECK(contains(open_error(put(dir, cut)), "truncated: the header says it is " + std::to_string(header.size()) +
                                                " bytes, but only " + std::to_string(header.size() / 2) + " follow"));
  CHECK(contains(open_error(put(dir, good.substr(0, good.size() - 3))),
                 "truncated: tensor 'b' has data_offsets [4, 8], but the file holds 5 bytes of data"));
  CHECK(contains(open_error(put(dir, safetensors_bytes(" " + header, 8))),
                 "the header does not start with '{' at byte 8"));
}

// A child process under an address-space limit: the sanitizers reserve more than any such limit allows.
TEST_CASE("a header that needs more memory than there is is refused with a gradsync::Error" *
          doctest::skip(test::sanitized)) {
  test::TempDir dir;
  // 64 MB of `0,` is 32 million values: about 1.5 GB while parsed.
  std::string header = "{\"a\":[0";
  header.reserve(64 << 20);
  while (header.size() < (64u << 20)) header += ",0";
  header += "]}";
  const auto path = put(dir, safetensors_bytes(header, 0));
  header = std::string();
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // What the process holds now, and 512 MiB more: room to read the header, not to parse it.
    std::uint64_t pages = 0;
    std::FILE* statm = std::fopen("/proc/self/statm", "r");
    if (!statm || std::fscanf(statm, "%" SCNu64, &pages) != 1) ::_exit(10);
    std::fclose(statm);
    const rlim_t cap = pages * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) + (rlim_t{512} << 20);
    const rlimit limit{cap, cap};
    if (::setrlimit(RLIMIT_AS, &limit) != 0) ::_exit(11);
    try {
      ck::SafetensorsReader r(path, false);
      ::_exit(12);
    } catch (const gradsync::Error& e) {
      ::_exit(contains(e.what(), "there is not enough memory to parse its header") && contains(e.what(), path.string())
                  ? 0
                  : 13);
    } catch (...) {
      ::_exit(14);
    }
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  INFO("exit status " << WEXITSTATUS(status) << " (12: it opened, 13: another error, 14: not a gradsync::Error)");
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("a tensor name or metadata that is not UTF-8 is refused before anything is written") {
  test::TempDir dir;
  const auto path = dir.path / "w.safetensors";
  auto refuses = [&](std::vector<ck::TensorInfo> specs, ck::Metadata meta) {
    std::string msg;
    try {
      ck::SafetensorsWriter w(path, std::move(specs), std::move(meta));
      FAIL("the writer accepted it");
    } catch (const gradsync::InvalidArgument& e) {
      msg = e.what();
    }
    CHECK(fs::is_empty(dir.path));
    return msg;
  };
  CHECK(contains(refuses({{"ok", ck::TensorDtype::U8, {1}}, {"w\xc0\xaf", ck::TensorDtype::U8, {1}}}, {}),
                 "tensor 1's name 'w\\xc0\\xaf' is not UTF-8 (byte 1 starts no valid character); a safetensors header "
                 "holds only UTF-8 text"));
  CHECK(contains(refuses({{"w", ck::TensorDtype::U8, {1}}}, {{"note", "\xed\xa0\x80"}}),
                 "the value of metadata key 'note' '\\xed\\xa0\\x80' is not UTF-8 (byte 0"));
  CHECK(contains(refuses({}, {{"k\xff", "v"}}), "metadata key 'k\\xff' is not UTF-8 (byte 1"));

  // Names in other scripts round-trip, and find() finds each.
  const std::vector<std::string> names{"caf\xc3\xa9", "\xe9\x87\x8d\xe3\x81\xbf", "\xf0\x9f\x98\x80", "a\"b\\c\nd"};
  std::vector<ck::TensorData> tensors;
  const std::byte one[1]{std::byte{7}};
  for (const auto& n : names) tensors.push_back({{n, ck::TensorDtype::U8, {1}}, one});
  ck::save_safetensors(path, tensors, {{"\xc3\xa9t\xc3\xa9", "\xe2\x82\xac"}});
  ck::SafetensorsReader r(path);
  for (const auto& n : names) CHECK(r.find(n) != nullptr);
  CHECK(r.metadata().at("\xc3\xa9t\xc3\xa9") == "\xe2\x82\xac");
}

TEST_CASE("find() and load_safetensors over many tensors with random names") {
  auto rng = test::rng_for("many names");
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  test::TempDir dir;
  std::set<std::string> unique;
  while (unique.size() < 500) {
    std::string n(1 + rng() % 12, 'a');
    for (auto& c : n) c = static_cast<char>('a' + rng() % 3);
    unique.insert(n);
  }
  std::vector<std::string> names(unique.begin(), unique.end());
  std::shuffle(names.begin(), names.end(), rng);
  std::vector<std::vector<std::byte>> data;
  std::vector<ck::TensorData> tensors;
  for (std::size_t i = 0; i < names.size(); ++i)
    data.push_back(std::vector<std::byte>(rng() % 3, static_cast<std::byte>(i & 0xFF)));
  for (std::size_t i = 0; i < names.size(); ++i)
    tensors.push_back({{names[i], ck::TensorDtype::U8, {data[i].size()}}, data[i]});
  const auto path = dir.path / "many.safetensors";
  ck::save_safetensors(path, tensors);
  ck::SafetensorsReader r(path);
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto* t = r.find(names[i]);
    REQUIRE(t != nullptr);
    CHECK(t->spec.name == names[i]);
    CHECK(t->spec.shape == std::vector<std::uint64_t>{data[i].size()});
  }
  CHECK(r.find("d") == nullptr);
  CHECK(r.find("") == nullptr);
  std::vector<std::vector<std::byte>> back(names.size());
  std::vector<ck::TensorSlot> slots;
  for (std::size_t i = 0; i < names.size(); ++i) {
    back[i].resize(data[i].size());
    slots.push_back({{names[i], ck::TensorDtype::U8, {data[i].size()}}, back[i]});
  }
  ck::load_safetensors(path, slots);
  CHECK(back == data);
  slots.pop_back();
  CHECK_THROWS_WITH_AS(ck::load_safetensors(path, slots), doctest::Contains("which was not asked for"),
                       gradsync::InvalidArgument);
}

TEST_CASE("a sharded index with a duplicate tensor or a name that is not UTF-8 is refused naming the index") {
  test::TempDir dir;
  const auto path = dir.path / "m.index.json";
  const std::string piece = R"({"dtype":"U8","shape":[1],"pieces":[{"file":"f","offset":0,"begin":0,"end":1,"crc32":"00000000"}]})";
  const std::string head = R"({"format":"gradsync.sharded","version":1,"checkpoint_id":"x","tensors":{)";
  put_text(path, head + "\"t\":" + piece + ",\"t\":" + piece + "}}");
  const std::string duplicate =
      "index '" + path.string() + "': not valid JSON (corrupted or truncated?): duplicate key \"t\"";
  CHECK_THROWS_WITH_AS(ck::ShardIndex::read(path), doctest::Contains(duplicate.c_str()), gradsync::Error);
  put_text(path, head + "\"t\xff\":" + piece + "}}");
  CHECK_THROWS_WITH_AS(ck::ShardIndex::read(path), doctest::Contains("byte 0xFF in a string is not UTF-8"),
                       gradsync::Error);
  // Declared twice when the index is built from shard files.
  std::vector<ck::TensorInfo> specs(40, {"u", ck::TensorDtype::U8, {0}});
  for (std::size_t i = 0; i + 1 < specs.size(); ++i) specs[i].name = "u" + std::to_string(i);
  specs.back().name = "u17";
  CHECK_THROWS_WITH_AS(ck::ShardIndex::from_shard_files(dir.path, "x", {}, specs),
                       doctest::Contains("tensor 'u17' appears twice"), gradsync::Error);
}

}  // namespace test_checkpoint_hostile

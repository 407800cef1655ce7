// Random safetensors files for the reader: good files damaged at random (bit
// flips, truncation, extension, splices of JSON tokens, a rewritten header
// length) and hostile headers made to measure (deep nesting, huge or
// malformed numbers, bad UTF-8, duplicate keys, shapes that overflow, data
// offsets that overlap, leave holes or run past the file). Each must open,
// and then read every tensor or fail its checksum, or be refused, always
// with a gradsync::Error: any other exception fails the case, a crash or a
// sanitizer report ends the run, and a watchdog ends an input that hangs.
// Sharded indexes get the same damage.
//
// Bounded by GRADSYNC_CHECKPOINT_FUZZ_INPUTS inputs (default 4000, 1500 under
// a sanitizer) and GRADSYNC_CHECKPOINT_FUZZ_SECONDS of wall-clock time (3, 15
// under a sanitizer) after the first 100. A failure, a crash or a hang prints
// the input's seed: GRADSYNC_TEST_SEED=<run> GRADSYNC_CHECKPOINT_FUZZ_SEED=<input>
// replays that input alone.
#include <doctest/doctest.h>

#include <gradsync/checkpoint/json.hpp>
#include <gradsync/checkpoint/safetensors_reader.hpp>
#include <gradsync/checkpoint/safetensors_writer.hpp>
#include <gradsync/checkpoint/shard_index.hpp>
#include <gradsync/checkpoint/shard_writer.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "support/common.hpp"
#include "support/crash_note.hpp"
#include "support/fault_watchdog.hpp"
#include "support/sanitizers.hpp"
#include "support/temp_dir.hpp"
#include "test_checkpoint_read.hpp"

namespace test_checkpoint_fuzz {

namespace ck = gradsync::checkpoint;
namespace fs = std::filesystem;
using namespace test_checkpoint_read;

namespace {

using Rng = std::mt19937_64;

std::uint64_t below(Rng& rng, std::uint64_t n) { return n ? rng() % n : 0; }

template <class T>
const T& pick(Rng& rng, const std::vector<T>& v) {
  return v[below(rng, v.size())];
}

/// Good files to damage: written by gradsync (checksums, metadata, names in
/// several scripts and with escapes) and by hand as another writer might
/// (no checksums, tensors listed out of data order, padding).
struct Corpus {
  std::vector<std::string> files;
  std::string index;  // a sharded index, with its shard files in `dir`
  test::TempDir dir;

  explicit Corpus(Rng& rng) {
    const ck::TensorDtype dtypes[] = {ck::TensorDtype::F64, ck::TensorDtype::F32, ck::TensorDtype::BF16,
                                      ck::TensorDtype::I16, ck::TensorDtype::U8, ck::TensorDtype::BOOL};
    const std::vector<std::string> names{"w", "layer.0.weight", "caf\xc3\xa9", "\xe9\x87\x8d", "\xf0\x9f\x98\x80",
                                         "q\"u\\o\nte", "__metadata", "a b"};
    for (int f = 0; f < 4; ++f) {
      std::vector<ck::TensorInfo> specs;
      for (std::size_t t = 0, n = below(rng, 5); t < n; ++t) {
        std::vector<std::uint64_t> shape(below(rng, 3));
        for (auto& d : shape) d = below(rng, 4);
        specs.push_back({pick(rng, names) + std::to_string(t), dtypes[below(rng, std::size(dtypes))], shape});
      }
      std::vector<std::vector<std::byte>> data;
      std::vector<ck::TensorData> tensors;
      for (const auto& s : specs) {
        data.emplace_back(s.bytes());
        for (auto& b : data.back()) b = static_cast<std::byte>(rng());
      }
      for (std::size_t t = 0; t < specs.size(); ++t) tensors.push_back({specs[t], data[t]});
      const auto p = dir.path / ("good" + std::to_string(f) + ".safetensors");
      ck::save_safetensors(p, tensors, {{"step", std::to_string(rng() % 1000)}, {"note", "\xc3\xa9t\xc3\xa9"}});
      files.push_back(file_text(p));
    }
    const std::string header = "{\"b\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[8,16]},"
                               "\"__metadata__\":{\"format\":\"pt\"},"
                               "\"a\\u00e9\":{\"dtype\":\"F16\",\"shape\":[2,2],\"data_offsets\":[0,8]},"
                               "\"e\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[16,16]}}    ";
    files.push_back(safetensors_bytes(header, 16));

    // A sharded checkpoint of one tensor in two pieces, and its index.
    const std::vector<ck::TensorInfo> specs{{"t", ck::TensorDtype::I32, {4}}};
    const std::int32_t values[4]{1, -2, 3, -4};
    std::vector<std::string> shards;
    for (int rank = 0; rank < 2; ++rank) {
      const ck::ShardRange r{"t", std::uint64_t(2 * rank), std::uint64_t(2 * rank + 2)};
      ck::ShardWriter w(dir.path, "m", "id", rank, 2, specs, {r});
      w.write(r, std::as_bytes(std::span(values).subspan(r.begin, 2)));
      w.commit();
      shards.push_back(w.path().filename().string());
    }
    ck::ShardIndex::from_shard_files(dir.path, "id", shards, specs).write(dir.path / "m.index.json");
    index = file_text(dir.path / "m.index.json");
  }
};

/// JSON tokens for splices: strings (escapes kept), numbers, punctuation, white space, anything else.
std::vector<std::string> tokens_of(std::string_view s) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < s.size();) {
    std::size_t j = i + 1;
    if (s[i] == '"') {
      while (j < s.size() && s[j] != '"') j += s[j] == '\\' ? 2 : 1;
      j = std::min(j + 1, s.size());
    } else if ((s[i] >= '0' && s[i] <= '9') || s[i] == '-') {
      while (j < s.size() && ((s[j] >= '0' && s[j] <= '9') || s[j] == '.' || s[j] == 'e' || s[j] == '+')) ++j;
    } else if (s[i] == ' ') {
      while (j < s.size() && s[j] == ' ') ++j;
    }
    out.emplace_back(s.substr(i, j - i));
    i = j;
  }
  return out;
}

/// Tokens hostile headers are made of.
const std::vector<std::string>& dictionary() {
  static const std::vector<std::string> words{
      "-1", "0", "00", "1.5", "1e3", "2E-1", "18446744073709551615", "18446744073709551616",
      "99999999999999999999999999999", "4294967296", "9223372036854775808", "\"\\ud800\"", "\"\\udc00x\"",
      "\"\\u0000\"", "\"\\uZZZZ\"", "\"\\q\"", "\"\xff\"", "\"\xc0\xaf\"", "\"\xed\xa0\x80\"", "\"\xf4\x90\x80\x80\"",
      "\"\xe2\x82\"", "\"__metadata__\"", "\"dtype\"", "\"shape\"", "\"data_offsets\"", "\"F32\"", "\"BOOL\"",
      "\"F8\"", "\"gradsync.crc32:w0\"", "\"gradsync.format\"", "\"00000000\"", "[", "]", "{", "}", ",", ":", "\"\"",
      "null", "true", "[0,0]", "[]", "{}", "\"\x01\"", std::string(100, '['), std::string(70, '{'), "\t", "\n"};
  return words;
}

std::string splice(Rng& rng, std::string_view text, std::string& how) {
  auto tokens = tokens_of(text);
  const int edits = 1 + static_cast<int>(below(rng, 4));
  for (int e = 0; e < edits; ++e) {
    const std::size_t at = below(rng, tokens.size() + 1);
    switch (below(rng, 5)) {
      case 0:
        if (at < tokens.size()) tokens.erase(tokens.begin() + static_cast<std::ptrdiff_t>(at));
        how += " delete token " + std::to_string(at) + ";";
        break;
      case 1: {
        const auto& w = pick(rng, dictionary());
        tokens.insert(tokens.begin() + static_cast<std::ptrdiff_t>(at), w);
        how += " insert " + ck::detail::printable_utf8(w.substr(0, 24)) + " at token " + std::to_string(at) + ";";
        break;
      }
      case 2:
        if (at < tokens.size()) tokens[at] = pick(rng, dictionary());
        how += " replace token " + std::to_string(at) + ";";
        break;
      case 3:
        if (!tokens.empty()) {
          const auto from = below(rng, tokens.size());
          tokens.insert(tokens.begin() + static_cast<std::ptrdiff_t>(at), tokens[from]);
          how += " copy token " + std::to_string(from) + " to " + std::to_string(at) + ";";
        }
        break;
      default:
        if (tokens.size() >= 2) {
          const auto a = below(rng, tokens.size()), b = below(rng, tokens.size());
          std::swap(tokens[a], tokens[b]);
          how += " swap tokens " + std::to_string(a) + ", " + std::to_string(b) + ";";
        }
    }
  }
  std::string out;
  for (const auto& t : tokens) out += t;
  return out;
}

/// Splits a safetensors file into header and data (by its own length prefix, clamped).
std::pair<std::string, std::string> parts_of(const std::string& file) {
  std::uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = len << 8 | static_cast<unsigned char>(file[static_cast<std::size_t>(i)]);
  len = std::min<std::uint64_t>(len, file.size() - 8);
  return {file.substr(8, len), file.substr(8 + len)};
}

std::string damaged(Rng& rng, const std::string& good, std::string& how) {
  std::string f = good;
  switch (below(rng, 7)) {
    case 0: {
      // Bit flips, mostly in the header.
      const auto [header, data] = parts_of(good);
      const auto flips = 1 + below(rng, 8);
      how += "flip bits at";
      for (std::uint64_t k = 0; k < flips; ++k) {
        const auto at = below(rng, 4) ? below(rng, 8 + header.size()) : below(rng, f.size());
        f[at] = static_cast<char>(f[at] ^ (1 << below(rng, 8)));
        how += " " + std::to_string(at);
      }
      return f;
    }
    case 1:
      f.resize(below(rng, f.size()));
      how += "truncate to " + std::to_string(f.size()) + " bytes";
      return f;
    case 2: {
      const auto n = 1 + below(rng, 64);
      for (std::uint64_t k = 0; k < n; ++k) f += static_cast<char>(rng());
      how += "append " + std::to_string(n) + " bytes";
      return f;
    }
    case 3: {
      auto [header, data] = parts_of(good);
      how += "splice the header:";
      header = splice(rng, header, how);
      // Mostly with a length prefix that fits the new header, so that the parser sees it.
      const std::uint64_t len = below(rng, 4) ? header.size() : header.size() + below(rng, 16) - 8;
      return length_prefix(len) + header + data;
    }
    case 4: {
      const auto [header, data] = parts_of(good);
      const std::uint64_t choices[] = {header.size() + 1, header.size() - 1, header.size() + 8,
                                       below(rng, header.size() + 1), 100'000'000, 100'000'001, UINT64_MAX, rng()};
      const auto len = choices[below(rng, std::size(choices))];
      how += "header length " + std::to_string(len);
      return length_prefix(len) + header + data;
    }
    case 5: {
      // A run of random bytes over the header.
      const auto [header, data] = parts_of(good);
      const auto at = 8 + below(rng, header.size() + 1), n = 1 + below(rng, 8);
      for (std::uint64_t k = 0; k < n && at + k < f.size(); ++k) f[at + k] = static_cast<char>(rng());
      how += "overwrite " + std::to_string(n) + " bytes at " + std::to_string(at);
      return f;
    }
    default: {
      // One header entry's data_offsets or shape numbers rewritten.
      auto [header, data] = parts_of(good);
      auto tokens = tokens_of(header);
      std::vector<std::size_t> numbers;
      for (std::size_t i = 0; i < tokens.size(); ++i)
        if (!tokens[i].empty() && tokens[i][0] >= '0' && tokens[i][0] <= '9') numbers.push_back(i);
      if (numbers.empty()) return damaged(rng, good, how);
      const auto i = pick(rng, numbers);
      const std::uint64_t old = std::strtoull(tokens[i].c_str(), nullptr, 10);
      const std::uint64_t choices[] = {old + 1, old - 1, old + 8, 0, UINT64_MAX, UINT64_MAX - below(rng, 64),
                                       std::uint64_t{1} << (32 + below(rng, 32)), rng()};
      tokens[i] = std::to_string(choices[below(rng, std::size(choices))]);
      how += "number token " + std::to_string(i) + " " + std::to_string(old) + " -> " + tokens[i];
      std::string h;
      for (const auto& t : tokens) h += t;
      return length_prefix(h.size()) + h + data;
    }
  }
}

std::string hostile_number(Rng& rng) {
  switch (below(rng, 10)) {
    case 0: return std::to_string(UINT64_MAX - below(rng, 16));
    case 1: return std::to_string(std::uint64_t{1} << below(rng, 64));
    case 2: return pick(rng, dictionary());
    case 3: return std::to_string(rng());
    default: return std::to_string(below(rng, 5));
  }
}

std::string hostile_name(Rng& rng, const std::vector<std::string>& earlier) {
  switch (below(rng, 8)) {
    case 0: return earlier.empty() ? "x" : pick(rng, earlier);
    case 1: return "bad\xff" + std::to_string(below(rng, 9));
    case 2: return std::string(1, static_cast<char>(0xC0 + below(rng, 64))) + static_cast<char>(rng());
    case 3: return "esc\\u00" + std::to_string(10 + below(rng, 90));
    case 4: return "__metadata__";
    default: return "t" + std::to_string(earlier.size()) + (below(rng, 2) ? "\xc3\xa9" : "");
  }
}

/// A header made to measure: mostly a valid file, with hostile choices drawn at random.
std::string hostile_file(Rng& rng, std::string& how) {
  const char* dtypes[] = {"U8", "I16", "F32", "F64", "BOOL", "BF16", "F8", "u8"};
  const std::size_t sizes[] = {1, 2, 4, 8, 1, 2, 1, 1};
  const auto n = below(rng, 12);
  how += std::to_string(n) + " tensors";
  std::vector<std::string> names;
  std::string header = "{";
  std::uint64_t offset = 0;
  auto maybe = [&](int one_in) { return below(rng, static_cast<std::uint64_t>(one_in)) == 0; };
  if (maybe(3)) {
    header += "\"__metadata__\":{\"k\":\"v\"";
    if (maybe(2)) header += ",\"gradsync.crc32:t0\":\"" + std::string(maybe(2) ? "00000000" : "xyz") + "\"";
    if (maybe(4)) header += ",\"k\":\"again\"";
    header += "}";
    if (n) header += ",";
  }
  for (std::uint64_t t = 0; t < n; ++t) {
    const auto d = below(rng, maybe(8) ? std::size(dtypes) : 6);
    std::vector<std::uint64_t> shape(below(rng, 4));
    std::uint64_t elements = 1;
    for (auto& dim : shape) elements *= (dim = below(rng, 5));
    std::string shape_text = "[";
    for (std::size_t k = 0; k < shape.size(); ++k) shape_text += (k ? "," : "") + std::to_string(shape[k]);
    if (maybe(8)) shape_text += std::string(shape.empty() ? "" : ",") + hostile_number(rng);
    shape_text += "]";
    const std::uint64_t bytes = elements * sizes[d];
    std::string b = std::to_string(offset), e = std::to_string(offset + bytes);
    if (maybe(6)) (maybe(2) ? b : e) = hostile_number(rng);
    if (maybe(10)) std::swap(b, e);
    std::string offsets = "[" + b + "," + e + "]";
    if (maybe(20)) offsets = "[" + b + "]";
    std::string name = maybe(5) ? hostile_name(rng, names) : "t" + std::to_string(t);
    names.push_back(name);
    std::string value = "{\"dtype\":\"" + std::string(dtypes[d]) + "\",\"shape\":" + shape_text +
                        ",\"data_offsets\":" + offsets + (maybe(20) ? ",\"extra\":1" : "") + "}";
    if (maybe(20)) {
      const auto depth = 1 + below(rng, 120);
      value = std::string(depth, '[') + value + std::string(depth, ']');
      how += ", nested " + std::to_string(depth);
    }
    header += (t ? "," : "") + std::string("\"") + name + "\":" + value;
    if (!maybe(8)) offset += bytes;
  }
  header += "}";
  if (maybe(4)) header.append(below(rng, 9), ' ');
  const std::uint64_t data = maybe(8) ? below(rng, offset + 8) : offset;
  const std::uint64_t len = maybe(10) ? header.size() + below(rng, 5) - 2 : header.size();
  how += ", " + std::to_string(data) + " data bytes, header length " + std::to_string(len) + " of " +
         std::to_string(header.size());
  return length_prefix(len) + header + std::string(data, '\x11');
}

struct Outcome {
  int opened = 0, refused = 0;
};

/// Opens `path` (holding `bytes`) and reads every tensor. A gradsync::Error
/// is a refusal; a file that opens must hold what it says: tensors that
/// cover its data exactly, under names that find them.
void check_file(const fs::path& path, std::string_view bytes, bool require_checksums, Outcome& outcome) {
  try {
    ck::SafetensorsReader r(path, require_checksums);
    const std::uint64_t size = bytes.size();
    std::uint64_t end = 0;
    for (int i = 7; i >= 0; --i) end = end << 8 | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
    end += 8;
    for (const auto& t : r.tensors()) {
      REQUIRE(r.find(t.spec.name) == &t);
      REQUIRE(t.offset == end);
      REQUIRE(t.spec.checked_bytes());
      REQUIRE(ck::detail::invalid_utf8_at(t.spec.name) == std::string_view::npos);
      end += t.spec.bytes();
    }
    REQUIRE(end == size);
    ++outcome.opened;
    for (const auto& t : r.tensors()) {
      std::vector<std::byte> buffer(t.spec.bytes());
      r.read(t.spec.name, buffer);
    }
  } catch (const gradsync::Error&) {
    ++outcome.refused;
  }
}

void check_index(const fs::path& path, Outcome& outcome) {
  try {
    const auto index = ck::ShardIndex::read(path);
    for (const auto& t : index.tensors()) REQUIRE(index.tensor(t.spec.name).spec == t.spec);
    ++outcome.opened;
  } catch (const gradsync::Error&) {
    ++outcome.refused;
  }
}

std::uint64_t env_or(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::strtoull(v, nullptr, 0) : fallback;
}

}  // namespace

TEST_CASE("damaged and hostile safetensors files open or are refused with a gradsync::Error, never otherwise") {
  auto rng = test::rng_for("checkpoint fuzz");
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  Rng corpus_rng(rng());
  const Corpus corpus(corpus_rng);
  const std::uint64_t base = rng();
  const char* replay = std::getenv("GRADSYNC_CHECKPOINT_FUZZ_SEED");
  const std::uint64_t inputs = replay ? 1 : env_or("GRADSYNC_CHECKPOINT_FUZZ_INPUTS", test::sanitized ? 1500 : 4000);
  const auto budget = std::chrono::duration<double>(
      static_cast<double>(env_or("GRADSYNC_CHECKPOINT_FUZZ_SECONDS", test::sanitized ? 15 : 3)));
  const auto start = std::chrono::steady_clock::now();
  test::Watchdog watchdog;
  test::CrashNote crash_note;
  const auto file = corpus.dir.path / "input.safetensors";
  const auto index = corpus.dir.path / "input.index.json";
  Outcome files, indexes;
  std::uint64_t done = 0;
  for (; done < inputs; ++done) {
    if (done >= 100 && std::chrono::steady_clock::now() - start > budget) break;
    const std::uint64_t seed = replay ? std::strtoull(replay, nullptr, 0) : base + done;
    Rng input_rng(seed);
    std::string how;
    const auto kind = below(input_rng, 10);
    std::string bytes;
    if (kind < 5) {
      const auto which = below(input_rng, corpus.files.size());
      how = "corpus file " + std::to_string(which) + ": ";
      bytes = damaged(input_rng, corpus.files[which], how);
    } else if (kind < 9) {
      how = "hostile header: ";
      bytes = hostile_file(input_rng, how);
    } else {
      how = "sharded index:";
      bytes = below(input_rng, 2) ? splice(input_rng, corpus.index, how) : corpus.index;
      if (bytes == corpus.index) {
        bytes[below(input_rng, bytes.size())] ^= static_cast<char>(1 << below(input_rng, 8));
        how += " one bit flipped";
      }
    }
    const bool require_checksums = below(input_rng, 2);
    const std::string line = "checkpoint fuzz input " + std::to_string(done) + ": GRADSYNC_TEST_SEED=" +
                             std::to_string(test::test_seed()) + " GRADSYNC_CHECKPOINT_FUZZ_SEED=" +
                             std::to_string(seed) + " replays it; " + how;
    INFO(line);
    crash_note.set(line);
    watchdog.arm(std::chrono::duration<double>(test::sanitized ? 60.0 : 10.0), line);
    try {
      // A new file each time: ext4 flushes a file truncated and written again when it is closed.
      fs::remove(file);
      fs::remove(index);
      if (kind < 9) {
        put_text(file, bytes);
        check_file(file, bytes, require_checksums, files);
      } else {
        put_text(index, bytes);
        check_index(index, indexes);
      }
    } catch (const std::exception& e) {
      FAIL("an exception that is not a gradsync::Error: " << e.what());
    }
    watchdog.disarm();
  }
  MESSAGE("checkpoint fuzz: " << done << " inputs; files " << files.opened << " opened, " << files.refused
                              << " refused; indexes " << indexes.opened << " opened, " << indexes.refused
                              << " refused");
  // Both outcomes happen, or the inputs are too tame or too broken to test anything.
  if (!replay) {
    CHECK(files.opened > 0);
    CHECK(files.refused > 0);
    CHECK(indexes.refused > 0);
  }
}

}  // namespace test_checkpoint_fuzz

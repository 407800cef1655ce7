// The checkpoint file layer: safetensors round trips of every
// dtype, sharded checkpoints re-read at other world sizes, and files that are
// truncated, corrupted or mismatched refusing to load, all or nothing.
// GRADSYNC_CHECKPOINT_SEED replays the random data.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gradsync/checkpoint/crc32.hpp"
#include "gradsync/checkpoint/json.hpp"
#include "gradsync/checkpoint/safetensors_reader.hpp"
#include "gradsync/checkpoint/safetensors_writer.hpp"
#include "gradsync/checkpoint/shard_index.hpp"
#include "gradsync/checkpoint/shard_writer.hpp"
#include "support/temp_dir.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_checkpoint_format {

namespace ck = gradsync::checkpoint;
namespace fs = std::filesystem;

namespace {

std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    if (const char* s = std::getenv("GRADSYNC_CHECKPOINT_SEED")) return static_cast<std::uint64_t>(std::strtoull(s, nullptr, 10));
    return static_cast<std::uint64_t>(std::random_device{}());
  }();
  return seed;
}

using test::TempDir;

std::vector<std::byte> random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

std::vector<std::byte> file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  std::transform(c.begin(), c.end(), out.begin(), [](char x) { return static_cast<std::byte>(x); });
  return out;
}

void put_bytes(const fs::path& p, std::span<const std::byte> bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Runs `f`, which must throw E; returns its message.
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("threw the wrong class: " << e.what());
  }
  FAIL("did not throw");
  return {};
}

std::size_t temporaries_in(const fs::path& dir) {
  std::size_t n = 0;
  for (const auto& e : fs::directory_iterator(dir))
    if (contains(e.path().filename().string(), ".tmp-")) ++n;
  return n;
}

// A small model: one tensor of every dtype plus a scalar and an empty tensor.
struct Model {
  std::vector<ck::TensorInfo> specs;
  std::vector<std::vector<std::byte>> data;

  std::vector<ck::TensorSlot> slots() {
    std::vector<ck::TensorSlot> s;
    for (std::size_t i = 0; i < specs.size(); ++i) s.push_back({specs[i], data[i]});
    return s;
  }

  std::vector<ck::TensorData> contents() const {
    std::vector<ck::TensorData> s;
    for (std::size_t i = 0; i < specs.size(); ++i) s.push_back({specs[i], data[i]});
    return s;
  }
};

Model random_model(std::mt19937_64& rng) {
  Model m;
  const ck::TensorDtype all[] = {ck::TensorDtype::F64, ck::TensorDtype::F32, ck::TensorDtype::F16,
                                 ck::TensorDtype::BF16, ck::TensorDtype::I64, ck::TensorDtype::I32,
                                 ck::TensorDtype::I16, ck::TensorDtype::I8, ck::TensorDtype::U64,
                                 ck::TensorDtype::U32, ck::TensorDtype::U16, ck::TensorDtype::U8,
                                 ck::TensorDtype::BOOL};
  for (auto dt : all) {
    std::vector<std::uint64_t> shape{1 + rng() % 5, 1 + rng() % 7};
    m.specs.push_back({"layer." + std::string(ck::dtype_name(dt)) + ".weight", dt, shape});
  }
  m.specs.push_back({"scalar", ck::TensorDtype::F32, {}});
  m.specs.push_back({"empty", ck::TensorDtype::F32, {0, 3}});
  for (const auto& s : m.specs) {
    m.data.push_back(random_bytes(rng, s.bytes()));
    if (s.dtype == ck::TensorDtype::BOOL)
      for (auto& b : m.data.back()) b &= std::byte{1};
  }
  return m;
}

// Writes `m` streamed in random chunk sizes.
void write_streamed(const fs::path& p, Model& m, std::mt19937_64& rng) {
  ck::SafetensorsWriter w(p, m.specs, {{"step", "7"}});
  for (std::size_t i = 0; i < m.specs.size(); ++i) {
    std::span<const std::byte> rest(m.data[i]);
    do {
      auto n = std::min<std::size_t>(rest.size(), rng() % 9);
      w.write(m.specs[i].name, rest.first(n));
      rest = rest.subspan(n);
    } while (!rest.empty());
  }
  w.commit();
}

/// The file the corruption tests damage, in a directory of its own:
/// "alpha" (F32[3], data bytes 0..11) and "beta" (I16[5]) of random values,
/// saved as good.safetensors.
struct TwoTensors {
  TempDir dir;
  Model model;
  std::vector<std::byte> bytes;
  /// Offset of the first data byte in the file.
  std::size_t data_start = 0;

  explicit TwoTensors(std::mt19937_64& rng) {
    model.specs = {{"alpha", ck::TensorDtype::F32, {3}}, {"beta", ck::TensorDtype::I16, {5}}};
    model.data = {random_bytes(rng, 12), random_bytes(rng, 10)};
    const auto good = dir.path / "good.safetensors";
    ck::save_safetensors(good, model.contents());
    bytes = file_bytes(good);
    data_start = ck::SafetensorsReader(good).tensor("alpha").offset;
  }
};

/// Runs `body(two, path, rng)` on TwoTensors drawn from the test seed (printed
/// on failure): `path` is a free name beside its file, for a damaged copy, and
/// `rng` goes on from TwoTensors' draws.
template <class Body>
void with_damaged_copy(const char* name, Body body) {
  INFO("seed " << test_seed());
  std::mt19937_64 rng(test_seed());
  const TwoTensors two(rng);
  body(two, two.dir.path / name, rng);
}

}  // namespace

TEST_CASE("CRC-32 is zlib's, whatever the split") {
  const std::string check = "123456789";
  auto bytes = std::as_bytes(std::span(check));
  CHECK(ck::Crc32::of(bytes) == 0xCBF43926u);
  CHECK(ck::crc32_hex(0xCBF43926u) == "cbf43926");
  std::mt19937_64 rng(test_seed());
  INFO("seed " << test_seed());
  auto data = random_bytes(rng, 1000);
  auto whole = ck::Crc32::of(data);
  for (std::size_t cut = 0; cut <= data.size(); cut += 37) {
    ck::Crc32 c;
    c.update(std::span(data).first(cut));
    c.update(std::span(data).subspan(cut));
    CHECK(c.value() == whole);
  }
  CHECK(ck::Crc32::of({}) == 0u);
}

TEST_CASE("the JSON subset is strict") {
  using ck::detail::parse_json;
  const auto doc = parse_json(R"( {"a":[1,2,{"b":"x\"\\\u00e9\ud83d\ude00"}],"c":18446744073709551615} )");
  const auto& j = doc.root();
  CHECK(j.find("c")->integer() == UINT64_MAX);
  CHECK(j.find("a")->array()[2].find("b")->string() == "x\"\\\xc3\xa9\xf0\x9f\x98\x80");
  for (const char* bad : {R"({"a":1,"a":2})", R"({"a":1.5})", R"({"a":-1})", R"({"a":true})", R"({"a":null})",
                          R"({"a":1} x)", R"({"a":01})", R"({"a":18446744073709551616})", R"({"a":"\ud800"})",
                          R"({"a":1)", R"({"a":"x)", "", R"([1,])", "{\"a\":\"\x01\"}"}) {
    INFO(bad);
    CHECK_THROWS_AS(parse_json(bad), ck::detail::JsonError);
  }
  std::string s;
  ck::detail::append_json_string(s, "q\"\\\n\x01");
  CHECK(parse_json(s).root().string() == "q\"\\\n\x01");
}

TEST_CASE("every dtype round-trips bitwise, streamed in chunks of any size") {
  INFO("seed " << test_seed() << " (GRADSYNC_CHECKPOINT_SEED replays)");
  std::mt19937_64 rng(test_seed());
  TempDir dir;
  for (int round = 0; round < 5; ++round) {
    auto m = random_model(rng);
    const auto path = dir.path / "model.safetensors";
    write_streamed(path, m, rng);
    CHECK(temporaries_in(dir.path) == 0);
    ck::SafetensorsReader r(path);
    CHECK(r.metadata().at("step") == "7");
    CHECK(r.tensors().size() == m.specs.size());
    CHECK(r.tensors().front().offset % 8 == 0);
    Model back = m;
    for (auto& d : back.data) std::fill(d.begin(), d.end(), std::byte{0xAB});
    auto slots = back.slots();
    ck::load_safetensors(path, slots);
    CHECK(back.data == m.data);
  }
}

TEST_CASE("typed writes check the dtype; gradsync types map to safetensors dtypes") {
  static_assert(ck::tensor_dtype_of<float> == ck::TensorDtype::F32);
  static_assert(ck::tensor_dtype_of<gradsync::bfloat16> == ck::TensorDtype::BF16);
  static_assert(ck::tensor_dtype_of<std::uint8_t> == ck::TensorDtype::U8);
  static_assert(ck::to_data_type(ck::TensorDtype::F16) == gradsync::DataType::float16);
  static_assert(!ck::to_data_type(ck::TensorDtype::U8));
  static_assert(ck::parse_dtype("BF16") == ck::TensorDtype::BF16);
  TempDir dir;
  std::vector<double> v{1.5, -2.25, 3.0};
  ck::SafetensorsWriter w(dir.path / "t.safetensors", {{"v", ck::TensorDtype::F32, {3}}});
  auto msg = message_of<gradsync::InvalidArgument>([&] { w.write("v", std::span<const double>(v)); });
  CHECK(contains(msg, "declared F32 but given F64"));
}

TEST_CASE("a file with no tensors, and tensors of zero elements") {
  TempDir dir;
  ck::SafetensorsWriter(dir.path / "none.safetensors", {}).commit();
  CHECK(ck::SafetensorsReader(dir.path / "none.safetensors").tensors().empty());
  ck::load_safetensors(dir.path / "none.safetensors", {});

  ck::SafetensorsWriter w(dir.path / "zeros.safetensors",
                          {{"a", ck::TensorDtype::I64, {0}}, {"b", ck::TensorDtype::F16, {4, 0, 2}}});
  w.commit();
  ck::SafetensorsReader r(dir.path / "zeros.safetensors");
  CHECK(r.tensors().size() == 2);
  CHECK(r.tensor("b").spec.shape == std::vector<std::uint64_t>{4, 0, 2});
}

TEST_CASE("writer misuse is refused and publishes nothing") {
  TempDir dir;
  const auto path = dir.path / "w.safetensors";
  const std::vector<ck::TensorInfo> specs{{"a", ck::TensorDtype::U8, {2}}, {"b", ck::TensorDtype::U8, {3}}};
  const std::byte two[2]{}, four[4]{};
  CHECK(contains(message_of<gradsync::InvalidArgument>([&] {
                   ck::SafetensorsWriter({path, {{"a", ck::TensorDtype::U8, {1}}, {"a", ck::TensorDtype::U8, {1}}}});
                 }),
                 "'a' is declared twice"));
  CHECK(contains(message_of<gradsync::InvalidArgument>([&] {
                   ck::SafetensorsWriter(path, specs, {{"gradsync.format", "2"}});
                 }),
                 "reserved"));
  {
    ck::SafetensorsWriter w(path, specs);
    CHECK(contains(message_of<gradsync::InvalidArgument>([&] { w.write("b", two); }), "'a' comes next"));
    CHECK(contains(message_of<gradsync::InvalidArgument>([&] { w.write("a", four); }), "its dtype and shape make 2"));
    w.write("a", two);
    CHECK(contains(message_of<gradsync::InvalidArgument>([&] { w.commit(); }), "'b' has 0 of its 3 bytes"));
  }
  CHECK(!fs::exists(path));
  CHECK(temporaries_in(dir.path) == 0);
  ck::SafetensorsWriter w(path, {{"a", ck::TensorDtype::U8, {2}}});
  w.write("a", two);
  w.commit();
  CHECK(contains(message_of<gradsync::InvalidArgument>([&] { w.commit(); }), "already committed"));
  CHECK(contains(message_of<gradsync::InvalidArgument>([&] { w.write("a", two); }), "written after commit"));
}

TEST_CASE("a truncated file fails to open at every length, naming the file") {
  with_damaged_copy("cut.safetensors", [](const TwoTensors& two, const fs::path& path, std::mt19937_64&) {
    for (std::size_t len = 0; len < two.bytes.size(); ++len) {
      INFO("truncated to " << len << " of " << two.bytes.size() << " bytes");
      put_bytes(path, std::span(two.bytes).first(len));
      auto msg = message_of<gradsync::Error>([&] { ck::SafetensorsReader{path}; });
      CHECK(contains(msg, path.string()));
      if (len >= two.data_start) {
        // Data truncation names the first tensor the file cannot hold.
        CHECK(contains(msg, len < two.data_start + 12 ? "'alpha'" : "'beta'"));
        CHECK(contains(msg, "truncated"));
      }
    }
    // Extra bytes after the data are refused too.
    auto longer = two.bytes;
    longer.push_back(std::byte{0});
    put_bytes(path, longer);
    CHECK(contains(message_of<gradsync::Error>([&] { ck::SafetensorsReader{path}; }), "after the last tensor"));
  });
}

TEST_CASE("a corrupted byte is caught: data by checksum naming the tensor, header never loads wrong data") {
  with_damaged_copy("bad.safetensors", [](const TwoTensors& two, const fs::path& path, std::mt19937_64& rng) {
    for (std::size_t at = 0; at < two.bytes.size(); ++at) {
      INFO("byte " << at << " of " << two.bytes.size() << " flipped");
      auto bad = two.bytes;
      bad[at] ^= std::byte{static_cast<unsigned char>(1u << (rng() % 8))};
      put_bytes(path, bad);
      Model back = two.model;
      for (auto& d : back.data) std::fill(d.begin(), d.end(), std::byte{0x5A});
      auto back_slots = back.slots();
      bool threw = false;
      try {
        ck::load_safetensors(path, back_slots);
      } catch (const gradsync::Error& e) {
        threw = true;
        std::string msg = e.what();
        CHECK(contains(msg, path.string()));
        if (at >= two.data_start) {
          CHECK(contains(msg, "corrupted"));
          CHECK(contains(msg, at < two.data_start + 12 ? "'alpha'" : "'beta'"));
        }
      }
      if (threw) {
        // Nothing half-loaded.
        for (const auto& d : back.data) {
          CHECK(std::all_of(d.begin(), d.end(), [](std::byte b) { return b == std::byte{0x5A}; }));
        }
      } else {
        // Only a byte the loader does not depend on (padding, a metadata value) may change.
        CHECK(at < two.data_start);
        CHECK(back.data == two.model.data);
      }
    }
  });
}

TEST_CASE("other names, shapes or dtypes are refused with both sides named, and nothing is half-loaded") {
  TempDir dir;
  std::vector<std::byte> a(12, std::byte{1}), b(10, std::byte{2});
  const auto path = dir.path / "m.safetensors";
  ck::save_safetensors(path, std::vector<ck::TensorData>{{{"alpha", ck::TensorDtype::F32, {3}}, a},
                                                         {{"beta", ck::TensorDtype::I16, {5}}, b}});
  std::vector<std::byte> x(12, std::byte{9}), y(10, std::byte{9}), z(20, std::byte{9});
  auto refused = [&](std::vector<ck::TensorSlot> slots) {
    auto msg = message_of<gradsync::InvalidArgument>([&] { ck::load_safetensors(path, slots); });
    CHECK(contains(msg, path.string()));
    CHECK(std::all_of(x.begin(), x.end(), [](std::byte v) { return v == std::byte{9}; }));
    return msg;
  };
  CHECK(contains(refused({{{"alpha", ck::TensorDtype::F32, {3}}, x}, {{"gamma", ck::TensorDtype::I16, {5}}, y}}),
                 "no tensor 'gamma'"));
  CHECK(contains(refused({{{"alpha", ck::TensorDtype::F32, {3}}, x}, {{"beta", ck::TensorDtype::I16, {10}}, z}}),
                 "tensor 'beta' is I16 [5], expected I16 [10]"));
  CHECK(contains(refused({{{"alpha", ck::TensorDtype::F32, {3}}, x}, {{"beta", ck::TensorDtype::U16, {5}}, y}}),
                 "expected U16 [5]"));
  CHECK(contains(refused({{{"alpha", ck::TensorDtype::F32, {3}}, x}}), "holds tensor 'beta', which was not asked for"));
  std::vector<ck::TensorSlot> only_alpha{{{"alpha", ck::TensorDtype::F32, {3}}, x}};
  ck::load_safetensors(path, only_alpha, /*allow_extra=*/true);
  CHECK(x == a);
}

TEST_CASE("a sharded checkpoint written by 4 ranks reads back at 1, 2 and 3 ranks, bitwise") {
  INFO("seed " << test_seed());
  std::mt19937_64 rng(test_seed());
  TempDir dir;
  const std::vector<ck::TensorInfo> specs{{"w", ck::TensorDtype::F32, {7, 5}},
                                          {"b", ck::TensorDtype::BF16, {3}},  // fewer elements than ranks
                                          {"e", ck::TensorDtype::F64, {0}},
                                          {"s", ck::TensorDtype::I64, {}}};
  std::vector<std::vector<std::byte>> full;
  for (const auto& s : specs) full.push_back(random_bytes(rng, s.bytes()));
  // FSDP's split: chunk c = ceil(P/N), rank r owns [r·c, min((r+1)c, P)).
  auto owned = [](std::uint64_t p, int rank, int n) {
    std::uint64_t c = (p + static_cast<std::uint64_t>(n) - 1) / static_cast<std::uint64_t>(n);
    std::uint64_t lo = std::min(p, c * static_cast<std::uint64_t>(rank));
    return std::pair{lo, std::min(p, lo + c)};
  };
  const int writers = 4;
  std::vector<std::string> files;
  for (int rank = 0; rank < writers; ++rank) {
    std::vector<ck::ShardRange> ranges;
    for (const auto& s : specs) {
      auto [lo, hi] = owned(s.elements(), rank, writers);
      ranges.push_back({s.name, lo, hi});
    }
    ck::ShardWriter w(dir.path, "model", "step9", rank, writers, specs, ranges);
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const auto es = ck::dtype_size(specs[i].dtype);
      w.write(ranges[i], std::span(full[i]).subspan(ranges[i].begin * es, (ranges[i].end - ranges[i].begin) * es));
    }
    w.commit();
    files.push_back(w.path().filename().string());
  }
  // Rank 3 owns nothing of "b" (c = 1) and nothing of "s".
  auto index = ck::ShardIndex::from_shard_files(dir.path, "step9", files, specs);
  index.write(dir.path / "model.index.json");
  CHECK(temporaries_in(dir.path) == 0);

  auto back = ck::ShardIndex::read(dir.path / "model.index.json");
  CHECK(back.checkpoint_id() == "step9");
  CHECK(back.tensor("w").pieces.size() == 4);
  CHECK(back.tensor("e").pieces.empty());
  for (int readers : {1, 2, 3}) {
    for (int rank = 0; rank < readers; ++rank) {
      INFO(readers << " readers, rank " << rank);
      std::vector<std::vector<std::byte>> got(specs.size());
      std::vector<ck::RangeSlot> slots;
      for (std::size_t i = 0; i < specs.size(); ++i) {
        auto [lo, hi] = owned(specs[i].elements(), rank, readers);
        got[i].assign((hi - lo) * ck::dtype_size(specs[i].dtype), std::byte{0});
        slots.push_back({specs[i], lo, hi, got[i]});
      }
      back.load(slots);
      for (std::size_t i = 0; i < specs.size(); ++i) {
        const auto es = ck::dtype_size(specs[i].dtype);
        auto want = std::span(full[i]).subspan(slots[i].begin * es, got[i].size());
        CHECK(std::equal(want.begin(), want.end(), got[i].begin(), got[i].end()));
      }
    }
  }
  // Every shard file is itself a plain safetensors file.
  CHECK(ck::SafetensorsReader(dir.path / files[0]).find("w[0:9]") != nullptr);
}

TEST_CASE("a sharded checkpoint refuses corrupted pieces, files of another checkpoint and bad indexes") {
  TempDir dir;
  const std::vector<ck::TensorInfo> specs{{"w", ck::TensorDtype::U8, {8}}};
  std::vector<std::byte> full(8);
  for (std::size_t i = 0; i < 8; ++i) full[i] = static_cast<std::byte>(i + 1);
  auto write_ckpt = [&](const std::string& id) {
    std::vector<std::string> files;
    for (int rank = 0; rank < 2; ++rank) {
      ck::ShardRange r{"w", 4u * static_cast<unsigned>(rank), 4u * static_cast<unsigned>(rank) + 4};
      ck::ShardWriter w(dir.path, "m", id, rank, 2, specs, {r});
      w.write(r, std::span(full).subspan(r.begin, 4));
      w.commit();
      files.push_back(w.path().filename().string());
    }
    ck::ShardIndex::from_shard_files(dir.path, id, files, specs).write(dir.path / ("m-" + id + ".index.json"));
    return files;
  };
  auto files = write_ckpt("a");
  auto index = ck::ShardIndex::read(dir.path / "m-a.index.json");
  std::vector<std::byte> got(8, std::byte{0x77});
  std::vector<ck::RangeSlot> slots{{specs[0], 0, 8, got}};
  index.load(slots);
  CHECK(got == full);
  auto untouched = [&] { return std::all_of(got.begin(), got.end(), [](std::byte b) { return b == std::byte{0x77}; }); };

  SUBCASE("corrupted piece") {
    auto bytes = file_bytes(dir.path / files[1]);
    bytes.back() ^= std::byte{0x10};
    put_bytes(dir.path / files[1], bytes);
    std::fill(got.begin(), got.end(), std::byte{0x77});
    auto msg = message_of<gradsync::Error>([&] { index.load(slots); });
    CHECK(contains(msg, files[1]));
    CHECK(contains(msg, "'w[4:8]' is corrupted"));
    CHECK(untouched());
    // A range that needs only the healthy piece still loads.
    std::vector<std::byte> first(4);
    std::vector<ck::RangeSlot> head{{specs[0], 0, 4, first}};
    index.load(head);
    CHECK(std::equal(first.begin(), first.end(), full.begin()));
  }
  SUBCASE("a shard file replaced by another checkpoint's") {
    auto other = write_ckpt("b");
    fs::rename(dir.path / other[0], dir.path / files[0]);
    std::fill(got.begin(), got.end(), std::byte{0x77});
    auto msg = message_of<gradsync::Error>([&] { index.load(slots); });
    CHECK(contains(msg, "belongs to checkpoint 'b', but the index is for 'a'"));
    CHECK(untouched());
  }
  SUBCASE("missing shard file") {
    fs::remove(dir.path / files[1]);
    std::fill(got.begin(), got.end(), std::byte{0x77});
    auto msg = message_of<gradsync::Error>([&] { index.load(slots); });
    CHECK(contains(msg, files[1]));
    CHECK(contains(msg, "loading tensor 'w'"));
    CHECK(untouched());
    fs::create_directories(dir.path / "elsewhere");
    CHECK(contains(message_of<gradsync::InvalidArgument>([&] { index.write(dir.path / "elsewhere" / "i.json"); }),
                   "must be written in the shard files' directory"));
  }
  SUBCASE("any flipped byte of the index fails to load or loads the right data") {
    const auto text = file_bytes(dir.path / "m-a.index.json");
    std::mt19937_64 rng(test_seed());
    INFO("seed " << test_seed());
    for (std::size_t at = 0; at < text.size(); ++at) {
      INFO("byte " << at << " of the index flipped");
      auto bad = text;
      bad[at] ^= std::byte{static_cast<unsigned char>(1u << (rng() % 8))};
      put_bytes(dir.path / "flip.index.json", bad);
      std::fill(got.begin(), got.end(), std::byte{0x77});
      try {
        ck::ShardIndex::read(dir.path / "flip.index.json").load(slots);
        CHECK(got == full);
      } catch (const gradsync::Error&) {
        CHECK(untouched());
      }
    }
  }
  SUBCASE("an index with a gap, a truncated index, a wrong spec") {
    auto text = file_bytes(dir.path / "m-a.index.json");
    std::string s(reinterpret_cast<const char*>(text.data()), text.size());
    auto gap = s;
    gap.replace(gap.find("\"begin\":4"), 9, "\"begin\":5");
    put_bytes(dir.path / "gap.index.json", std::as_bytes(std::span(gap)));
    CHECK(contains(message_of<gradsync::Error>([&] { ck::ShardIndex::read(dir.path / "gap.index.json"); }),
                   "tensor 'w' has piece [5, 8)"));
    put_bytes(dir.path / "cut.index.json", std::as_bytes(std::span(s).first(s.size() / 2)));
    CHECK(contains(message_of<gradsync::Error>([&] { ck::ShardIndex::read(dir.path / "cut.index.json"); }),
                   "not valid JSON"));
    std::vector<std::byte> wide(16);
    std::vector<ck::RangeSlot> wrong{{{"w", ck::TensorDtype::U16, {8}}, 0, 8, wide}};
    CHECK(contains(message_of<gradsync::InvalidArgument>([&] { index.load(wrong); }), "expected U16 [8]"));
    std::vector<ck::RangeSlot> absent{{{"v", ck::TensorDtype::U8, {8}}, 0, 8, got}};
    CHECK(contains(message_of<gradsync::InvalidArgument>([&] { index.load(absent); }), "no tensor 'v'"));
  }
}

TEST_CASE("a rank that owns nothing writes a tensorless shard file, and a huge declared shape is refused") {
  TempDir dir;
  const std::vector<ck::TensorInfo> specs{{"t", ck::TensorDtype::I32, {2}}};
  const std::int32_t values[2]{-5, 6};
  std::vector<std::string> files;
  for (int rank = 0; rank < 3; ++rank) {
    ck::ShardRange r{"t", std::min<std::uint64_t>(2, static_cast<std::uint64_t>(rank)),
                     std::min<std::uint64_t>(2, static_cast<std::uint64_t>(rank) + 1)};
    ck::ShardWriter w(dir.path, "m", "x", rank, 3, specs, {r});
    w.write(r, std::as_bytes(std::span(values).subspan(r.begin, r.end - r.begin)));
    w.commit();
    files.push_back(w.path().filename().string());
  }
  CHECK(ck::SafetensorsReader(dir.path / files[2]).tensors().empty());
  auto index = ck::ShardIndex::from_shard_files(dir.path, "x", files, specs);
  CHECK(index.files().size() == 2);
  index.write(dir.path / "m.index.json");
  std::int32_t got[2]{};
  std::vector<ck::RangeSlot> all{{specs[0], 0, 2, std::as_writable_bytes(std::span(got))}};
  ck::ShardIndex::read(dir.path / "m.index.json").load(all);
  CHECK(got[0] == -5);
  CHECK(got[1] == 6);

  // 2^64 - 1 bytes declared: refused as truncated, not wrapped around.
  std::string header = R"({"big":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,18446744073709551615]}})";
  std::vector<std::byte> file(8);
  file[0] = static_cast<std::byte>(header.size());
  for (char c : header) file.push_back(static_cast<std::byte>(c));
  put_bytes(dir.path / "big.safetensors", file);
  CHECK(contains(message_of<gradsync::Error>([&] { ck::SafetensorsReader(dir.path / "big.safetensors", false); }),
                 "truncated: tensor 'big'"));
}

}  // namespace test_checkpoint_format

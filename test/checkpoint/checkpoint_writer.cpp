// A checkpoint writer for the kill test and the Python interop test: a helper
// of test_core (`test_core --helper checkpoint_writer ARGS...`, support/helper_main.hpp).
//
//   checkpoint_writer write DIR GEN [KILL_AT]   write generation GEN (a full file and a
//       4-rank sharded checkpoint); with KILL_AT, SIGKILL itself before that file operation
//   checkpoint_writer verify DIR                load both checkpoints, check every byte,
//       print "full G sharded H"; exit 1 with the error otherwise
//   checkpoint_writer sample FILE SIDECAR       a file of every numpy dtype, and its values as JSON
//   checkpoint_writer read FILE                 read a file another writer made (no checksums):
//       print "name dtype shape crc32" per tensor
#include <algorithm>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "gradsync/checkpoint/file_ops.hpp"
#include "gradsync/checkpoint/safetensors_reader.hpp"
#include "gradsync/checkpoint/safetensors_writer.hpp"
#include "gradsync/checkpoint/shard_index.hpp"
#include "gradsync/checkpoint/shard_writer.hpp"
#include "gradsync/core/float16.hpp"

#include "../support/helper_main.hpp"

namespace checkpoint_writer {

namespace ck = gradsync::checkpoint;
namespace fs = std::filesystem;

namespace {

const std::vector<ck::TensorInfo> specs{{"embed.weight", ck::TensorDtype::F32, {64, 16}},
                                        {"layer.0.bias", ck::TensorDtype::BF16, {100}},
                                        {"layer.0.weight", ck::TensorDtype::F64, {33, 7}},
                                        {"empty", ck::TensorDtype::I32, {0}},
                                        {"step", ck::TensorDtype::I64, {}}};
constexpr int ranks = 4;
constexpr std::size_t chunk = 512;

long kill_at = -1;
long steps = 0;

void step(const char* what) {
  if (++steps == kill_at) {
    std::fprintf(stderr, "killed at step %ld (%s)\n", steps, what);
    std::fflush(stderr);
    std::raise(SIGKILL);
  }
}

// Byte j of tensor t in generation g.
std::vector<std::byte> pattern(long g, std::size_t t) {
  std::vector<std::byte> v(specs[t].bytes());
  for (std::size_t j = 0; j < v.size(); ++j)
    v[j] = static_cast<std::byte>((static_cast<std::size_t>(g) * 131 + t * 31 + j * 7 + (j >> 8)) & 0xFFu);
  return v;
}

std::string id_of(long g) { return "g" + std::to_string(g); }

void write(const fs::path& dir, long g) {
  {
    ck::SafetensorsWriter w(dir / "full.safetensors", specs, {{"generation", std::to_string(g)}});
    for (std::size_t t = 0; t < specs.size(); ++t) {
      auto data = pattern(g, t);
      for (std::size_t at = 0; at < data.size(); at += chunk)
        w.write(specs[t].name, std::span<const std::byte>(data).subspan(at, std::min(chunk, data.size() - at)));
    }
    w.commit();
  }
  std::vector<std::string> files;
  for (int r = 0; r < ranks; ++r) {
    std::vector<ck::ShardRange> ranges;
    for (const auto& s : specs) {
      auto c = (s.elements() + ranks - 1) / ranks;
      auto lo = std::min(s.elements(), c * static_cast<std::uint64_t>(r));
      ranges.push_back({s.name, lo, std::min(s.elements(), lo + c)});
    }
    ck::ShardWriter w(dir, "sharded", id_of(g), r, ranks, specs, ranges);
    for (std::size_t t = 0; t < specs.size(); ++t) {
      auto es = ck::dtype_size(specs[t].dtype);
      auto data = pattern(g, t);
      w.write(ranges[t], std::span<const std::byte>(data).subspan(ranges[t].begin * es,
                                                                  (ranges[t].end - ranges[t].begin) * es));
    }
    w.commit();
    files.push_back(w.path().filename().string());
  }
  // Every rank's file is durable; only now does the new checkpoint become visible.
  ck::ShardIndex::from_shard_files(dir, id_of(g), files, specs).write(dir / "sharded.index.json");
  for (const auto& e : fs::directory_iterator(dir)) {
    auto name = e.path().filename().string();
    if (name.starts_with("sharded-g") && !name.starts_with("sharded-" + id_of(g) + "-")) {
      step("remove_old");
      fs::remove(e.path());
    }
  }
}

int verify(const fs::path& dir) {
  long full_gen = std::stol(ck::SafetensorsReader(dir / "full.safetensors").metadata().at("generation"));
  std::vector<std::vector<std::byte>> got(specs.size());
  std::vector<ck::TensorSlot> slots;
  for (std::size_t t = 0; t < specs.size(); ++t) {
    got[t].resize(specs[t].bytes());
    slots.push_back({specs[t], got[t]});
  }
  ck::load_safetensors(dir / "full.safetensors", slots);
  for (std::size_t t = 0; t < specs.size(); ++t)
    if (got[t] != pattern(full_gen, t)) throw gradsync::Error("full.safetensors: wrong data in " + specs[t].name);

  auto index = ck::ShardIndex::read(dir / "sharded.index.json");
  long sharded_gen = std::stol(index.checkpoint_id().substr(1));
  // Read back at 3 ranks, each its own ranges.
  for (int r = 0; r < 3; ++r) {
    std::vector<ck::RangeSlot> rs;
    std::vector<std::vector<std::byte>> part(specs.size());
    for (std::size_t t = 0; t < specs.size(); ++t) {
      auto n = specs[t].elements(), c = (n + 2) / 3;
      auto lo = std::min(n, c * static_cast<std::uint64_t>(r)), hi = std::min(n, lo + c);
      part[t].resize((hi - lo) * ck::dtype_size(specs[t].dtype));
      rs.push_back({specs[t], lo, hi, part[t]});
    }
    index.load(rs);
    for (std::size_t t = 0; t < specs.size(); ++t) {
      auto want = pattern(sharded_gen, t);
      auto es = ck::dtype_size(specs[t].dtype);
      if (!std::equal(part[t].begin(), part[t].end(), want.begin() + static_cast<std::ptrdiff_t>(rs[t].begin * es)))
        throw gradsync::Error("sharded: wrong data in " + specs[t].name);
    }
  }
  std::printf("full %ld sharded %ld\n", full_gen, sharded_gen);
  return 0;
}

// Values exact in every dtype, so Python can compare after a cast to float64.
int sample(const fs::path& file, const fs::path& sidecar) {
  const std::vector<ck::TensorInfo> s{{"f64", ck::TensorDtype::F64, {2, 3}}, {"f32", ck::TensorDtype::F32, {4, 5}},
                                      {"f16", ck::TensorDtype::F16, {7}},     {"i64", ck::TensorDtype::I64, {3}},
                                      {"i32", ck::TensorDtype::I32, {2, 2}},  {"i16", ck::TensorDtype::I16, {5}},
                                      {"i8", ck::TensorDtype::I8, {6}},       {"u64", ck::TensorDtype::U64, {2}},
                                      {"u32", ck::TensorDtype::U32, {3}},     {"u16", ck::TensorDtype::U16, {3}},
                                      {"u8", ck::TensorDtype::U8, {1, 8}},    {"bool", ck::TensorDtype::BOOL, {4}},
                                      {"scalar", ck::TensorDtype::F32, {}},   {"empty", ck::TensorDtype::F32, {0, 4}}};
  ck::SafetensorsWriter w(file, s, {{"producer", "gradsync checkpoint_writer"}});
  std::string json = "{";
  for (std::size_t t = 0; t < s.size(); ++t) {
    std::vector<double> values;
    for (std::uint64_t i = 0; i < s[t].elements(); ++i) {
      double sign = (i % 2) ? -1.0 : 1.0;
      switch (s[t].dtype) {
        case ck::TensorDtype::U64: values.push_back(static_cast<double>(std::uint64_t{1} << 52) + static_cast<double>(i)); break;
        case ck::TensorDtype::BOOL: values.push_back(static_cast<double>(i % 2)); break;
        case ck::TensorDtype::U8: case ck::TensorDtype::U16: case ck::TensorDtype::U32:
          values.push_back(static_cast<double>(i * 13 + 1)); break;
        case ck::TensorDtype::I8: case ck::TensorDtype::I16: case ck::TensorDtype::I32: case ck::TensorDtype::I64:
          values.push_back(sign * static_cast<double>(i * 11 + 2)); break;
        default: values.push_back(sign * (static_cast<double>(i) * 0.375 + 0.125)); break;
      }
    }
    std::vector<std::byte> bytes;
    auto put = [&](const auto& v) {
      auto b = std::as_bytes(std::span(&v, 1));
      bytes.insert(bytes.end(), b.begin(), b.end());
    };
    for (double v : values) {
      switch (s[t].dtype) {
        case ck::TensorDtype::F64: put(v); break;
        case ck::TensorDtype::F32: put(static_cast<float>(v)); break;
        case ck::TensorDtype::F16: put(gradsync::float16(static_cast<float>(v)).bits); break;
        case ck::TensorDtype::I64: put(static_cast<std::int64_t>(v)); break;
        case ck::TensorDtype::I32: put(static_cast<std::int32_t>(v)); break;
        case ck::TensorDtype::I16: put(static_cast<std::int16_t>(v)); break;
        case ck::TensorDtype::I8: put(static_cast<std::int8_t>(v)); break;
        case ck::TensorDtype::U64: put(static_cast<std::uint64_t>(v)); break;
        case ck::TensorDtype::U32: put(static_cast<std::uint32_t>(v)); break;
        case ck::TensorDtype::U16: put(static_cast<std::uint16_t>(v)); break;
        case ck::TensorDtype::U8: case ck::TensorDtype::BOOL: put(static_cast<std::uint8_t>(v)); break;
        default: throw gradsync::Error("sample: unexpected dtype");
      }
    }
    w.write(s[t].name, std::span<const std::byte>(bytes));
    json += (t ? ",\n\"" : "\n\"") + s[t].name + "\":{\"dtype\":\"" + std::string(ck::dtype_name(s[t].dtype)) +
            "\",\"shape\":[";
    for (std::size_t d = 0; d < s[t].shape.size(); ++d) json += (d ? "," : "") + std::to_string(s[t].shape[d]);
    json += "],\"values\":[";
    for (std::size_t i = 0; i < values.size(); ++i) {
      char buf[40];
      std::snprintf(buf, sizeof buf, "%.17g", values[i]);
      json += (i ? "," : "") + std::string(buf);
    }
    json += "]}";
  }
  w.commit();
  json += "}\n";
  ck::AtomicFile side(sidecar);
  side.write(std::as_bytes(std::span(json)));
  side.commit();
  return 0;
}

int read(const fs::path& file) {
  ck::SafetensorsReader r(file, /*require_checksums=*/false);
  for (const auto& t : r.tensors()) {
    std::vector<std::byte> data(t.spec.bytes());
    r.read(t.spec.name, data);
    std::printf("%s %s %s %s\n", t.spec.name.c_str(), std::string(ck::dtype_name(t.spec.dtype)).c_str(),
                ck::shape_string(t.spec.shape).c_str(), ck::crc32_hex(ck::Crc32::of(data)).c_str());
  }
  return 0;
}

}  // namespace

int helper_main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() >= 3 && args[0] == "write") {
    if (args.size() >= 4) kill_at = std::stol(args[3]);
    ck::detail::file_op_hook = [](ck::detail::FileOp op, const fs::path&) {
      step(ck::detail::op_name(op));
      return 0;
    };
    write(args[1], std::stol(args[2]));
    std::printf("steps %ld\n", steps);
    return 0;
  }
  if (args.size() == 2 && args[0] == "verify") return verify(args[1]);
  if (args.size() == 3 && args[0] == "sample") return sample(args[1], args[2]);
  if (args.size() == 2 && args[0] == "read") return read(args[1]);
  std::fprintf(stderr, "usage: checkpoint_writer write DIR GEN [KILL_AT] | verify DIR | sample FILE SIDECAR | read FILE\n");
  return 2;
}

GRADSYNC_TEST_HELPER_REPORTING_EXCEPTIONS("checkpoint_writer", helper_main);

}  // namespace checkpoint_writer

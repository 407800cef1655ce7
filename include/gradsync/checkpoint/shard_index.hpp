#pragma once
/// \file The index of a sharded checkpoint: for each tensor, its full spec
/// and the pieces (file, byte offset, element range, checksum) that hold it.
/// Any world size reads any element range from whichever files hold it.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "gradsync/checkpoint/atomic_file.hpp"
#include "gradsync/checkpoint/crc32.hpp"
#include "gradsync/checkpoint/json.hpp"
#include "gradsync/checkpoint/safetensors_reader.hpp"
#include "gradsync/checkpoint/shard_writer.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/core/error.hpp"

namespace gradsync::checkpoint {

/// Elements [begin, end) of a tensor, stored in `file` (relative to the
/// index's directory) at byte `offset`, with the CRC-32 of those bytes.
struct ShardPiece {
  std::string file;
  std::uint64_t offset = 0;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::uint32_t crc32 = 0;
};

/// A tensor of a sharded checkpoint: full spec and pieces sorted by `begin`
/// that cover [0, elements) exactly once (none for an empty tensor).
struct ShardedTensor {
  TensorInfo spec;
  std::vector<ShardPiece> pieces;
};

/// Where to load elements [begin, end) of a tensor, and the spec expected of it.
struct RangeSlot {
  TensorInfo spec;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::span<std::byte> data;
};

/// The index JSON of a sharded checkpoint:
///
///     {"format":"gradsync.sharded","version":1,"checkpoint_id":"…",
///      "tensors":{"w":{"dtype":"F32","shape":[4,3],
///        "pieces":[{"file":"…","offset":128,"begin":0,"end":6,"crc32":"…"}, …]}, …}}
///
/// A sharded checkpoint exists once its index is renamed into place, which
/// `write` does only after reading back every shard file's header.
class ShardIndex {
 public:
  ShardIndex() = default;

  /// Builds the index from the committed shard files `files` in `dir`
  /// (reading only their headers) and checks that the pieces tile every
  /// tensor of `tensors` exactly and belong to checkpoint `id`.
  static ShardIndex from_shard_files(const std::filesystem::path& dir, std::string id,
                                     std::span<const std::string> files, std::span<const TensorInfo> tensors) {
    ShardIndex index;
    index.dir_ = dir;
    index.id_ = std::move(id);
    for (const auto& t : tensors) index.tensors_.push_back({t, {}});
    for (const auto& f : files) {
      SafetensorsReader r(dir / f);
      auto it = r.metadata().find(std::string(checkpoint_id_key));
      if (it == r.metadata().end() || it->second != index.id_)
        throw Error("checkpoint: shard file '" + (dir / f).string() + "' belongs to checkpoint '" +
                    (it == r.metadata().end() ? std::string("?") : it->second) + "', not '" + index.id_ + "'");
      for (const auto& e : r.tensors()) {
        auto [name, begin, end] = split_piece_name(e.spec.name, (dir / f).string());
        auto& t = index.tensor_mut(name, (dir / f).string());
        if (e.spec.dtype != t.spec.dtype || e.spec.shape != std::vector<std::uint64_t>{end - begin})
          throw Error("checkpoint: shard file '" + (dir / f).string() + "': piece '" + e.spec.name +
                      "' does not match tensor '" + name + "' (" + std::string(dtype_name(t.spec.dtype)) + ")");
        t.pieces.push_back({f, e.offset, begin, end, e.crc32.value_or(0)});
      }
    }
    index.validate("shard files in '" + dir.string() + "'");
    return index;
  }

  /// Reads and validates the index at `path`; the shard files are opened on demand.
  static ShardIndex read(const std::filesystem::path& path) {
    ShardIndex index;
    index.dir_ = path.parent_path();
    std::ifstream in(path, std::ios::binary);
    if (!in) throw Error("checkpoint: cannot open index '" + path.string() + "'");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto bad = [&](const std::string& what) { fail_index(path, what); };
    detail::JsonDocument doc;
    try {
      doc = detail::parse_json(std::move(text));
    } catch (const detail::JsonError& e) {
      bad(std::string("not valid JSON (corrupted or truncated?): ") + e.what());
    }
    const auto& j = doc.root();
    auto str = [&](const detail::Json* v, const std::string& what) -> std::string {
      if (!v || !v->is_string()) fail_index(path, what + " is missing or not a string");
      return std::string(v->string());
    };
    auto num = [&](const detail::Json* v, const std::string& what) -> std::uint64_t {
      if (!v || !v->is_integer()) fail_index(path, what + " is missing or not an integer");
      return v->integer();
    };
    if (!j.is_object()) bad("not a JSON object");
    if (str(j.find("format"), "format") != "gradsync.sharded") bad("format is not \"gradsync.sharded\"");
    if (num(j.find("version"), "version") != 1) bad("unsupported version");
    index.id_ = str(j.find("checkpoint_id"), "checkpoint_id");
    const auto* tensors = j.find("tensors");
    if (!tensors || !tensors->is_object()) bad("tensors is missing or not an object");
    for (const auto& [key, value] : tensors->members()) {
      const std::string name(key);
      const auto& v = *value;
      const std::string where = "tensor '" + name + "'";
      if (!v.is_object()) bad(where + " is not an object");
      ShardedTensor t;
      t.spec.name = name;
      auto dt = parse_dtype(str(v.find("dtype"), where + " dtype"));
      if (!dt) bad(where + " has an unknown dtype");
      t.spec.dtype = *dt;
      const auto* shape = v.find("shape");
      if (!shape || !shape->is_array()) bad(where + " shape is missing or not an array");
      for (const auto& d : shape->array()) t.spec.shape.push_back(num(&d, where + " shape"));
      if (!t.spec.checked_bytes()) bad(where + " is too large");
      const auto* pieces = v.find("pieces");
      if (!pieces || !pieces->is_array()) bad(where + " pieces is missing or not an array");
      for (const auto& p : pieces->array()) {
        if (!p.is_object()) bad(where + " has a piece that is not an object");
        ShardPiece piece;
        piece.file = str(p.find("file"), where + " piece file");
        if (piece.file.empty() || piece.file.find('/') != std::string::npos || piece.file.starts_with("."))
          bad(where + " piece file '" + piece.file + "' is not a plain file name");
        piece.offset = num(p.find("offset"), where + " piece offset");
        piece.begin = num(p.find("begin"), where + " piece begin");
        piece.end = num(p.find("end"), where + " piece end");
        auto crc = parse_crc32_hex(str(p.find("crc32"), where + " piece crc32"));
        if (!crc) bad(where + " piece crc32 is not 8 hex digits");
        piece.crc32 = *crc;
        t.pieces.push_back(std::move(piece));
      }
      index.tensors_.push_back(std::move(t));
    }
    index.validate("index '" + path.string() + "'");
    return index;
  }

  /// Writes the index atomically to `path`, which must be in the shard
  /// files' directory (pieces name their files relative to it).
  void write(const std::filesystem::path& path) const {
    std::error_code ec;
    auto parent = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
    auto dir = dir_.empty() ? std::filesystem::path(".") : dir_;
    if (!std::filesystem::equivalent(parent, dir, ec))
      throw InvalidArgument("checkpoint: index '" + path.string() + "' must be written in the shard files' directory '" +
                            dir.string() + "'");
    std::string s = "{\"format\":\"gradsync.sharded\",\"version\":1,\"checkpoint_id\":";
    detail::append_json_string(s, id_);
    s += ",\"tensors\":{";
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const auto& t = tensors_[i];
      s += i ? ",\n" : "\n";
      detail::append_json_string(s, t.spec.name);
      s += ":{\"dtype\":\"" + std::string(dtype_name(t.spec.dtype)) + "\",\"shape\":[";
      for (std::size_t d = 0; d < t.spec.shape.size(); ++d) s += (d ? "," : "") + std::to_string(t.spec.shape[d]);
      s += "],\"pieces\":[";
      for (std::size_t k = 0; k < t.pieces.size(); ++k) {
        const auto& p = t.pieces[k];
        s += k ? ",{\"file\":" : "{\"file\":";
        detail::append_json_string(s, p.file);
        s += ",\"offset\":" + std::to_string(p.offset) + ",\"begin\":" + std::to_string(p.begin) +
             ",\"end\":" + std::to_string(p.end) + ",\"crc32\":\"" + crc32_hex(p.crc32) + "\"}";
      }
      s += "]}";
    }
    s += "}}\n";
    AtomicFile f(path);
    f.write(std::as_bytes(std::span(s)));
    f.commit();
  }

  const std::string& checkpoint_id() const noexcept { return id_; }
  const std::vector<ShardedTensor>& tensors() const noexcept { return tensors_; }
  const std::filesystem::path& directory() const noexcept { return dir_; }

  /// The tensor called `name`; throws InvalidArgument if absent.
  const ShardedTensor& tensor(std::string_view name) const {
    for (const auto& t : tensors_)
      if (t.spec.name == name) return t;
    throw InvalidArgument("checkpoint: sharded checkpoint '" + id_ + "' in '" + dir_.string() + "' has no tensor '" +
                          std::string(name) + "'");
  }

  /// Every file the index refers to, once each.
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    for (const auto& t : tensors_)
      for (const auto& p : t.pieces)
        if (std::find(out.begin(), out.end(), p.file) == out.end()) out.push_back(p.file);
    return out;
  }

  /// Loads each slot's element range, all or nothing: specs must match the
  /// index, and every piece touched is read whole and its checksum verified
  /// (and its file's header checked against the index) before any slot is
  /// written. Reads only the pieces that overlap the ranges asked for.
  void load(std::span<const RangeSlot> slots) const {
    for (const auto& s : slots) {
      const auto& t = tensor(s.spec.name);
      if (t.spec.dtype != s.spec.dtype || t.spec.shape != s.spec.shape)
        throw InvalidArgument("checkpoint: sharded checkpoint '" + id_ + "' in '" + dir_.string() +
                              "' does not match: tensor '" + s.spec.name + "' is " +
                              std::string(dtype_name(t.spec.dtype)) + " " + shape_string(t.spec.shape) +
                              ", expected " + std::string(dtype_name(s.spec.dtype)) + " " +
                              shape_string(s.spec.shape));
      if (s.begin > s.end || s.end > t.spec.elements() ||
          s.data.size() != (s.end - s.begin) * dtype_size(t.spec.dtype))
        throw InvalidArgument("checkpoint: range [" + std::to_string(s.begin) + ", " + std::to_string(s.end) +
                              ") of tensor '" + s.spec.name + "' with " + std::to_string(s.data.size()) +
                              " bytes does not fit its " + std::to_string(t.spec.elements()) + " elements");
    }
    std::map<std::string, std::unique_ptr<SafetensorsReader>> readers;
    std::vector<std::vector<std::byte>> staged(slots.size());
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const auto& s = slots[i];
      const auto& t = tensor(s.spec.name);
      const auto esize = dtype_size(t.spec.dtype);
      staged[i].resize(s.data.size());
      std::vector<std::byte> piece;
      for (const auto& p : t.pieces) {
        std::uint64_t lo = std::max(p.begin, s.begin), hi = std::min(p.end, s.end);
        if (lo >= hi) continue;
        piece.resize((p.end - p.begin) * esize);
        try {
          read_piece(readers, t, p, piece);
        } catch (const InvalidArgument& e) {
          throw InvalidArgument(std::string(e.what()) + " (loading tensor '" + t.spec.name + "')");
        } catch (const Error& e) {
          throw Error(std::string(e.what()) + " (loading tensor '" + t.spec.name + "')");
        }
        std::memcpy(staged[i].data() + (lo - s.begin) * esize, piece.data() + (lo - p.begin) * esize,
                    (hi - lo) * esize);
      }
    }
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (!staged[i].empty()) std::memcpy(slots[i].data.data(), staged[i].data(), staged[i].size());
  }

 private:
  [[noreturn]] static void fail_index(const std::filesystem::path& path, const std::string& what) {
    throw Error("checkpoint: index '" + path.string() + "': " + what);
  }

  // "w[3:7]" -> ("w", 3, 7).
  static std::tuple<std::string, std::uint64_t, std::uint64_t> split_piece_name(const std::string& n,
                                                                                const std::string& file) {
    auto open = n.rfind('[');
    auto colon = n.rfind(':');
    auto bad = [&] { throw Error("checkpoint: shard file '" + file + "' holds '" + n + "', which is not a piece name"); };
    if (open == std::string::npos || colon == std::string::npos || colon < open || n.back() != ']') bad();
    auto parse = [&](std::string_view d) {
      std::uint64_t v = 0;
      if (d.empty()) bad();
      for (char c : d) {
        if (c < '0' || c > '9' || v > (UINT64_MAX - 9) / 10) bad();
        v = v * 10 + static_cast<std::uint64_t>(c - '0');
      }
      return v;
    };
    std::string_view sv(n);
    auto b = parse(sv.substr(open + 1, colon - open - 1));
    auto e = parse(sv.substr(colon + 1, n.size() - colon - 2));
    if (e < b) bad();
    return {n.substr(0, open), b, e};
  }

  ShardedTensor& tensor_mut(const std::string& name, const std::string& file) {
    for (auto& t : tensors_)
      if (t.spec.name == name) return t;
    throw Error("checkpoint: shard file '" + file + "' holds a piece of tensor '" + name + "', which is not declared");
  }

  // Pieces sorted, contiguous, covering every element exactly once.
  void validate(const std::string& where) {
    // Never quadratic in the tensors, which a hostile index may list by the million.
    const auto twice = detail::DuplicateKeys().first(
        tensors_.size(), [&](std::size_t k) { return std::string_view(tensors_[k].spec.name); });
    if (twice < tensors_.size())
      throw Error("checkpoint: " + where + ": tensor '" + tensors_[twice].spec.name + "' appears twice");
    for (auto& t : tensors_) {
      std::erase_if(t.pieces, [](const ShardPiece& p) { return p.begin == p.end; });
      std::sort(t.pieces.begin(), t.pieces.end(),
                [](const ShardPiece& a, const ShardPiece& b) { return a.begin < b.begin; });
      std::uint64_t next = 0;
      for (const auto& p : t.pieces) {
        if (p.end < p.begin || p.begin != next)
          throw Error("checkpoint: " + where + ": tensor '" + t.spec.name + "' has piece [" + std::to_string(p.begin) +
                      ", " + std::to_string(p.end) + ") in '" + p.file + "' where element " + std::to_string(next) +
                      (p.begin < next ? " was already covered (overlap)" : " should start (gap)"));
        next = p.end;
      }
      if (next != t.spec.elements())
        throw Error("checkpoint: " + where + ": tensor '" + t.spec.name + "' pieces cover " + std::to_string(next) +
                    " of its " + std::to_string(t.spec.elements()) + " elements");
    }
  }

  void read_piece(std::map<std::string, std::unique_ptr<SafetensorsReader>>& readers, const ShardedTensor& t,
                  const ShardPiece& p, std::span<std::byte> out) const {
    auto& r = readers[p.file];
    const auto path = dir_ / p.file;
    if (!r) {
      r = std::make_unique<SafetensorsReader>(path);
      auto it = r->metadata().find(std::string(checkpoint_id_key));
      if (it == r->metadata().end() || it->second != id_)
        throw Error("checkpoint: shard file '" + path.string() + "' belongs to checkpoint '" +
                    (it == r->metadata().end() ? std::string("?") : it->second) + "', but the index is for '" + id_ +
                    "'");
    }
    const auto name = piece_name(t.spec.name, p.begin, p.end);
    const auto* e = r->find(name);
    if (!e || e->offset != p.offset || e->spec.dtype != t.spec.dtype || e->crc32 != p.crc32)
      throw Error("checkpoint: shard file '" + path.string() + "' does not match the index for tensor '" +
                  t.spec.name + "' (piece '" + name + "' " + (e ? "differs" : "is missing") + ")");
    r->read(name, out);
  }

  std::filesystem::path dir_;
  std::string id_;
  std::vector<ShardedTensor> tensors_;
};

}  // namespace gradsync::checkpoint

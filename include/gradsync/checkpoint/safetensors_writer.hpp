#pragma once
/// \file Streams tensors into one safetensors file, written atomically.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/checkpoint/atomic_file.hpp"
#include "gradsync/checkpoint/crc32.hpp"
#include "gradsync/checkpoint/json.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/checkpoint/utf8.hpp"
#include "gradsync/core/error.hpp"

namespace gradsync::checkpoint {

static_assert(std::endian::native == std::endian::little,
              "gradsync checkpoints store little-endian data as it lies in memory; a big-endian host would need byte swapping, which is not written");

/// `__metadata__` of a safetensors file: string keys to string values.
using Metadata = std::map<std::string, std::string>;

/// The `__metadata__` key holding the CRC-32 (8 hex digits) of tensor `name`'s data.
inline std::string crc32_key(std::string_view name) { return "gradsync.crc32:" + std::string(name); }

/// The `__metadata__` key that marks a file gradsync wrote (value "1").
inline constexpr std::string_view format_key = "gradsync.format";

/// Writes one safetensors file whose tensors are declared up front and whose
/// data is then streamed in declaration order, in pieces of any size, so a
/// writer never holds the whole model. The header is written first with
/// placeholder checksums and rewritten (same length) at `commit()`. Data
/// starts at a multiple of 8 bytes (the header is padded with spaces, as the
/// format allows). Nothing appears under `path` before `commit()` returns.
class SafetensorsWriter {
 public:
  /// Plans the file. Throws InvalidArgument for an empty, duplicate,
  /// reserved or non-UTF-8 name, a size that overflows, a reserved metadata
  /// key (`gradsync.format`, `gradsync.crc32:*`) or non-UTF-8 metadata.
  SafetensorsWriter(std::filesystem::path path, std::vector<TensorInfo> tensors, Metadata metadata = {})
      : path_(std::move(path)), tensors_(std::move(tensors)), metadata_(std::move(metadata)) {
    for (const auto& [k, v] : metadata_) {
      if (k.starts_with("gradsync.crc32:") || k == format_key)
        fail_arg("metadata key '" + k + "' is reserved (gradsync writes it)");
      if (auto at = detail::invalid_utf8_at(k); at != std::string_view::npos) not_utf8("metadata key", k, at);
      if (auto at = detail::invalid_utf8_at(v); at != std::string_view::npos)
        not_utf8("the value of metadata key '" + k + "'", v, at);
    }
    std::map<std::string_view, std::size_t> seen;
    std::uint64_t offset = 0;
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const auto& t = tensors_[i];
      if (t.name.empty() || t.name == "__metadata__")
        fail_arg("tensor " + std::to_string(i) + " has the name '" + t.name + "', which safetensors does not allow");
      if (auto at = detail::invalid_utf8_at(t.name); at != std::string_view::npos)
        not_utf8("tensor " + std::to_string(i) + "'s name", t.name, at);
      if (!seen.emplace(t.name, i).second) fail_arg("tensor '" + t.name + "' is declared twice");
      auto bytes = t.checked_bytes();
      if (!bytes || offset + *bytes < offset)
        fail_arg("tensor '" + t.name + "' of shape " + shape_string(t.shape) + " is too large");
      begin_.push_back(offset);
      offset += *bytes;
    }
    begin_.push_back(offset);
    crc_.resize(tensors_.size());
    file_ = std::make_unique<AtomicFile>(path_);
    auto header = header_bytes();
    std::uint64_t len = header.size();
    std::byte len_le[8];
    for (int i = 0; i < 8; ++i) len_le[i] = static_cast<std::byte>(len >> (8 * i));
    file_->write(len_le);
    file_->write(std::as_bytes(std::span(header)));
    data_start_ = 8 + len;
  }

  /// Appends `bytes` to tensor `name`, which must be the first tensor not yet
  /// complete (tensors are written in declaration order).
  void write(std::string_view name, std::span<const std::byte> bytes) {
    if (committed_) fail_arg("tensor '" + std::string(name) + "' written after commit");
    while (next_ < tensors_.size() && done_ == size_of(next_)) advance();
    if (next_ >= tensors_.size() || tensors_[next_].name != name) {
      // An empty write to a tensor that is already complete (or empty) is harmless.
      if (bytes.empty() && is_complete(name)) return;
      fail_arg(next_ < tensors_.size()
                   ? "tensor '" + std::string(name) + "' written out of order; '" + tensors_[next_].name + "' comes next"
                   : "tensor '" + std::string(name) + "' written after every declared tensor is complete");
    }
    if (bytes.size() > size_of(next_) - done_)
      fail_arg("tensor '" + std::string(name) + "' given " + std::to_string(done_ + bytes.size()) +
               " bytes in all, but its dtype and shape make " + std::to_string(size_of(next_)));
    file_->write(bytes);
    crc_[next_].update(bytes);
    done_ += bytes.size();
  }

  /// Appends typed values to tensor `name` (checks the element type against its dtype).
  template <class T>
  void write(std::string_view name, std::span<const T> values) {
    if (auto* t = find(name); t && t->dtype != tensor_dtype_of<T>)
      fail_arg("tensor '" + std::string(name) + "' is declared " + std::string(dtype_name(t->dtype)) +
               " but given " + std::string(dtype_name(tensor_dtype_of<T>)) + " values");
    write(name, std::as_bytes(values));
  }

  /// Fills in the checksums and makes the file durable and visible. Throws
  /// InvalidArgument (and publishes nothing) if a tensor is incomplete.
  void commit() {
    if (committed_) fail_arg("the file was already committed");
    while (next_ < tensors_.size() && done_ == size_of(next_)) advance();
    if (next_ < tensors_.size())
      fail_arg("tensor '" + tensors_[next_].name + "' has " + std::to_string(done_) + " of its " +
               std::to_string(size_of(next_)) + " bytes; every declared tensor must be complete before commit");
    auto header = header_bytes();
    if (8 + header.size() != data_start_) throw Error("checkpoint: header of '" + path_.string() + "' changed size");
    file_->write_at(8, std::as_bytes(std::span(header)));
    file_->commit();
    committed_ = true;
  }

  const std::filesystem::path& path() const noexcept { return path_; }
  const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }

 private:
  [[noreturn]] void fail_arg(const std::string& what) const {
    throw InvalidArgument("checkpoint: writing '" + path_.string() + "': " + what);
  }

  // A header is UTF-8 JSON: readers (gradsync's, Python's) refuse any other bytes in it.
  [[noreturn]] void not_utf8(const std::string& what, std::string_view s, std::size_t at) const {
    fail_arg(what + " '" + detail::printable_utf8(s) + "' is not UTF-8 (byte " + std::to_string(at) +
             " starts no valid character); a safetensors header holds only UTF-8 text, so pass it as UTF-8");
  }

  std::uint64_t size_of(std::size_t i) const noexcept { return begin_[i + 1] - begin_[i]; }

  void advance() {
    checksums_.push_back(crc_[next_].value());
    ++next_;
    done_ = 0;
  }

  const TensorInfo* find(std::string_view name) const {
    for (const auto& t : tensors_)
      if (t.name == name) return &t;
    return nullptr;
  }

  bool is_complete(std::string_view name) const {
    for (std::size_t i = 0; i < tensors_.size(); ++i)
      if (tensors_[i].name == name) return i < next_ || (i == next_ && done_ == size_of(i));
    return false;
  }

  // The header JSON padded to a multiple of 8 bytes; checksums not yet known are zeros.
  std::string header_bytes() const {
    Metadata meta = metadata_;
    meta[std::string(format_key)] = "1";
    for (std::size_t i = 0; i < tensors_.size(); ++i)
      meta[crc32_key(tensors_[i].name)] = crc32_hex(i < checksums_.size() ? checksums_[i] : 0);
    std::string h = "{\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : meta) {
      if (!first) h += ',';
      first = false;
      detail::append_json_string(h, k);
      h += ':';
      detail::append_json_string(h, v);
    }
    h += '}';
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const auto& t = tensors_[i];
      h += ',';
      detail::append_json_string(h, t.name);
      h += ":{\"dtype\":\"";
      h += dtype_name(t.dtype);
      h += "\",\"shape\":[";
      for (std::size_t d = 0; d < t.shape.size(); ++d) h += (d ? "," : "") + std::to_string(t.shape[d]);
      h += "],\"data_offsets\":[" + std::to_string(begin_[i]) + "," + std::to_string(begin_[i + 1]) + "]}";
    }
    h += '}';
    h.append((8 - h.size() % 8) % 8, ' ');
    return h;
  }

  std::filesystem::path path_;
  std::vector<TensorInfo> tensors_;
  Metadata metadata_;
  std::vector<std::uint64_t> begin_;
  std::vector<Crc32> crc_;
  std::vector<std::uint32_t> checksums_;
  std::unique_ptr<AtomicFile> file_;
  std::uint64_t data_start_ = 0;
  std::size_t next_ = 0;
  bool committed_ = false;
  std::uint64_t done_ = 0;
};

}  // namespace gradsync::checkpoint

#pragma once
/// \file detail::CheckpointSource: a training checkpoint opened for loading,
/// a full safetensors file or a sharded index, read by element ranges alike.

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradsync/checkpoint/safetensors_reader.hpp"
#include "gradsync/checkpoint/safetensors_writer.hpp"
#include "gradsync/checkpoint/shard_index.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/train/checkpoint/checkpoint_directory.hpp"
#include "gradsync/train/common/hash_bytes.hpp"

namespace gradsync::detail {

/// The `__metadata__` key that marks a file as a gradsync training checkpoint.
inline constexpr std::string_view checkpoint_kind_key = "gradsync.checkpoint";

inline constexpr std::uint64_t fingerprint_seed = 0x510e527fade682d1ull;

/// A hash of a sharded checkpoint's tensor names and every piece's range and
/// CRC-32, as its index lists them (see CheckpointSource::fingerprint).
inline std::uint64_t fingerprint_of(const checkpoint::ShardIndex& index) noexcept {
  std::uint64_t h = fingerprint_seed;
  for (const checkpoint::ShardedTensor& t : index.tensors()) {
    h = hash_bytes(t.spec.name.data(), t.spec.name.size(), h);
    for (const checkpoint::ShardPiece& p : t.pieces) {
      const std::array<std::uint64_t, 3> words{p.begin, p.end, p.crc32};
      h = hash_bytes(words.data(), sizeof words, h);
    }
  }
  return h;
}

/// A checkpoint to load: `path` may name the full file, the index, or a
/// directory (checkpoint_directory.hpp: the generation its commit file
/// names, or the single layout of a directory saved before commit files).
class CheckpointSource {
 public:
  explicit CheckpointSource(const std::filesystem::path& path) {
    const std::optional<CheckpointEntry> entry = find_checkpoint(path);
    if (!entry) {
      const std::filesystem::path commit = path / commit_file_name;
      throw FileError("gradsync: load_checkpoint: cannot open '" + commit.string() + "': " + std::strerror(ENOENT) +
                          "; '" + path.string() + "' holds no checkpoint: give the directory save_checkpoint wrote, "
                          "or a checkpoint file",
                      commit.string(), ENOENT);
    }
    file_ = entry->file;
    if (!entry->sharded) {
      reader_.emplace(file_);
      metadata_ = reader_->metadata();
      return;
    }
    index_ = checkpoint::ShardIndex::read(file_);
    if (!entry->id.empty() && index_.checkpoint_id() != entry->id) {
      throw Error("gradsync: load_checkpoint: index '" + file_.string() + "' is of checkpoint '" +
                  index_.checkpoint_id() + "', but the commit file beside it names generation " + entry->id +
                  "; something else changed the directory: write a new checkpoint");
    }
    // Rank 0's shard file carries the strings of the training state.
    for (const std::string& f : index_.files()) {
      checkpoint::SafetensorsReader r(index_.directory() / f);
      if (r.metadata().contains(std::string(checkpoint_kind_key))) {
        metadata_ = r.metadata();
        break;
      }
    }
  }

  /// The full file or the index: what an error names.
  const std::filesystem::path& file() const noexcept { return file_; }
  bool sharded() const noexcept { return !reader_; }
  const checkpoint::Metadata& metadata() const noexcept { return metadata_; }

  /// The spec of tensor `name`, or null if the checkpoint has none.
  const checkpoint::TensorInfo* find(std::string_view name) const {
    if (reader_) {
      const checkpoint::TensorEntry* e = reader_->find(name);
      return e ? &e->spec : nullptr;
    }
    for (const checkpoint::ShardedTensor& t : index_.tensors()) {
      if (t.spec.name == name) return &t.spec;
    }
    return nullptr;
  }

  /// A hash of every tensor's name and content checksums (the full file's
  /// per-tensor CRC-32s, or every piece's in the index): the same for every
  /// rank that opened the same checkpoint, and, but for a collision,
  /// different for checkpoints of different contents, such as two runs'
  /// saves at the same step and learning rate.
  std::uint64_t fingerprint() const noexcept {
    if (!reader_) return fingerprint_of(index_);
    std::uint64_t h = fingerprint_seed;
    for (const checkpoint::TensorEntry& e : reader_->tensors()) {
      h = hash_bytes(e.spec.name.data(), e.spec.name.size(), h);
      const std::uint32_t crc = e.crc32.value_or(0);
      h = hash_bytes(&crc, sizeof crc, h);
    }
    return h;
  }

  /// Every tensor's name.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    if (reader_) {
      for (const checkpoint::TensorEntry& e : reader_->tensors()) out.push_back(e.spec.name);
    } else {
      for (const checkpoint::ShardedTensor& t : index_.tensors()) out.push_back(t.spec.name);
    }
    return out;
  }

  /// Reads each slot's element range, every checksum verified: a sharded
  /// checkpoint reads the pieces that overlap it, a full file the whole
  /// tensor (its checksum covers all of it) and copies the range out.
  void load(std::span<const checkpoint::RangeSlot> slots) const {
    if (!reader_) {
      index_.load(slots);
      return;
    }
    std::vector<std::byte> whole;
    for (const checkpoint::RangeSlot& s : slots) {
      const checkpoint::TensorEntry& e = reader_->tensor(s.spec.name);
      const std::size_t esize = checkpoint::dtype_size(e.spec.dtype);
      if (s.begin == 0 && s.end == e.spec.elements()) {
        reader_->read(s.spec.name, s.data);
        continue;
      }
      whole.resize(e.spec.bytes());
      reader_->read(s.spec.name, whole);
      std::memcpy(s.data.data(), whole.data() + s.begin * esize, (s.end - s.begin) * esize);
    }
  }

 private:
  std::filesystem::path file_;
  std::optional<checkpoint::SafetensorsReader> reader_;
  checkpoint::ShardIndex index_;
  checkpoint::Metadata metadata_;
};

}  // namespace gradsync::detail

#pragma once
/// \file detail::CheckpointSource: a training checkpoint opened for loading,
/// a full safetensors file or a sharded index, read by element ranges alike.

#include <algorithm>
#include <cstddef>
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

namespace gradsync::detail {

/// A sharded checkpoint in directory D is D/checkpoint.index.json and the
/// files it names, D/checkpoint-<id>-rank….safetensors.
inline constexpr std::string_view index_file_name = "checkpoint.index.json";
inline constexpr std::string_view shard_stem = "checkpoint";
inline constexpr std::string_view full_file_name = "checkpoint.safetensors";

/// The `__metadata__` key that marks a file as a gradsync training checkpoint.
inline constexpr std::string_view checkpoint_kind_key = "gradsync.checkpoint";

/// A checkpoint to load: `path` may name the full file, the index, or the
/// directory holding one of them.
class CheckpointSource {
 public:
  explicit CheckpointSource(const std::filesystem::path& path) {
    namespace fs = std::filesystem;
    bool sharded = false;
    if (path.extension() == ".safetensors") {
      file_ = path;
    } else if (path.filename() == index_file_name) {
      file_ = path;
      sharded = true;
    } else {
      const fs::path index = path / index_file_name, full = path / full_file_name;
      std::error_code ec;
      const bool has_index = fs::exists(index, ec), has_full = fs::exists(full, ec);
      if (has_index && has_full) {
        throw InvalidArgument("gradsync: load_checkpoint: '" + path.string() + "' holds a full checkpoint ('" +
                              std::string(full_file_name) + "') and a sharded one ('" + std::string(index_file_name) +
                              "'); name the file or the index to load");
      }
      sharded = has_index;
      file_ = has_index ? index : full;
    }
    if (!sharded) {
      reader_.emplace(file_);
      metadata_ = reader_->metadata();
      return;
    }
    index_ = checkpoint::ShardIndex::read(file_);
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

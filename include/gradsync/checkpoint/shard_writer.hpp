#pragma once
/// \file One rank's file of a sharded checkpoint: the element ranges of each
/// tensor that the rank owns, as a plain safetensors file.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/checkpoint/safetensors_writer.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/core/error.hpp"

namespace gradsync::checkpoint {

/// The `__metadata__` key naming the checkpoint a shard file belongs to.
inline constexpr std::string_view checkpoint_id_key = "gradsync.checkpoint_id";

/// Elements [begin, end) of a tensor, in row-major order of its full shape.
struct ShardRange {
  std::string tensor;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

/// The name a piece has inside a shard file: "w[0:12]" for elements 0..11 of
/// "w", stored as a 1-D tensor of 12 elements.
inline std::string piece_name(std::string_view tensor, std::uint64_t begin, std::uint64_t end) {
  return std::string(tensor) + "[" + std::to_string(begin) + ":" + std::to_string(end) + "]";
}

/// "model-<id>-rank00002-of-00004.safetensors": the id keeps a new
/// checkpoint's files from overwriting those the current index points to.
inline std::string shard_file_name(std::string_view stem, std::string_view id, int rank, int size) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "-rank%05d-of-%05d.safetensors", rank, size);
  return std::string(stem) + "-" + std::string(id) + buf;
}

/// Writes the ranges one rank owns into its shard file, streamed tensor by
/// tensor (in the order of `ranges`), atomically at `commit()`. Empty ranges
/// are dropped; a rank that owns nothing still writes a (tensorless) file.
/// The index is written afterwards by one rank (ShardIndex::from_shard_files)
/// once every rank's commit has returned.
class ShardWriter {
 public:
  /// `tensors`: full specs (dtype and full shape) of every tensor in the
  /// checkpoint; `ranges`: what this rank owns. `id` must be the same on every
  /// rank and differ from the previous checkpoint's. `metadata`: more
  /// `__metadata__` entries for this file (a trainer puts its training
  /// state's strings in rank 0's).
  ShardWriter(const std::filesystem::path& dir, std::string_view stem, std::string_view id, int rank, int size,
              std::span<const TensorInfo> tensors, std::vector<ShardRange> ranges, Metadata metadata = {})
      : ranges_(std::move(ranges)) {
    const auto path = dir / shard_file_name(stem, id, rank, size);
    std::erase_if(ranges_, [](const ShardRange& r) { return r.begin == r.end; });
    std::vector<TensorInfo> pieces;
    for (const auto& r : ranges_) {
      const TensorInfo* full = nullptr;
      for (const auto& t : tensors)
        if (t.name == r.tensor) full = &t;
      if (!full) throw InvalidArgument("checkpoint: shard range names tensor '" + r.tensor + "', which is not declared");
      if (r.begin > r.end || r.end > full->elements())
        throw InvalidArgument("checkpoint: shard range [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                              ") of tensor '" + r.tensor + "' is outside its " + std::to_string(full->elements()) +
                              " elements");
      pieces.push_back(TensorInfo{piece_name(r.tensor, r.begin, r.end), full->dtype, {r.end - r.begin}});
    }
    Metadata meta = std::move(metadata);
    meta[std::string(checkpoint_id_key)] = std::string(id);
    meta["gradsync.shard"] = std::to_string(rank) + "/" + std::to_string(size);
    writer_.emplace(path, std::move(pieces), std::move(meta));
  }

  /// Appends bytes of `range`'s data (ranges are written in the order given;
  /// writing nothing to an empty range is allowed and does nothing).
  void write(const ShardRange& range, std::span<const std::byte> bytes) {
    if (range.begin == range.end && bytes.empty()) return;
    writer_->write(piece_name(range.tensor, range.begin, range.end), bytes);
  }

  /// Makes the shard file durable and visible.
  void commit() { writer_->commit(); }

  const std::filesystem::path& path() const noexcept { return writer_->path(); }

 private:
  std::vector<ShardRange> ranges_;
  std::optional<SafetensorsWriter> writer_;
};

}  // namespace gradsync::checkpoint

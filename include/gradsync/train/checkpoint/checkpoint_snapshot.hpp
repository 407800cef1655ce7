#pragma once
/// \file detail::CheckpointSnapshot: a host copy of what one rank writes in
/// a save, taken between steps, then written and made durable from it alone
/// (no trainer, no communicator), so that the writing can run on another
/// thread while training goes on.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/checkpoint/file_ops.hpp"
#include "gradsync/checkpoint/safetensors_writer.hpp"
#include "gradsync/checkpoint/shard_index.hpp"
#include "gradsync/checkpoint/shard_writer.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/train/checkpoint/checkpoint_directory.hpp"

namespace gradsync::detail {

/// One rank's part of a save, copied: the pieces of its file in the order
/// they are written, their bytes in one buffer, and where they go. The
/// buffer is kept from one save to the next (the copy then touches no new
/// page), and grows only when a save needs more.
class CheckpointSnapshot {
 public:
  /// Where and what the next save writes. `writes`: this rank writes a file
  /// (a full file: rank 0; sharded: replica 0's ranks). `infos`: every
  /// tensor's full spec; `metadata`: the file's `__metadata__`; `bytes`: the
  /// pieces' total, which the buffer is made to hold.
  void plan(const std::filesystem::path& path, bool sharded, bool writes, std::vector<checkpoint::TensorInfo> infos,
            checkpoint::Metadata metadata, std::size_t bytes, int shard, int shards) {
    path_ = path;
    sharded_ = sharded;
    writes_ = writes;
    infos_ = std::move(infos);
    metadata_ = std::move(metadata);
    shard_ = shard;
    shards_ = shards;
    generation_ = 0;
    pieces_.clear();
    used_ = 0;
    error_ = nullptr;
    reserve(bytes);
  }

  /// Makes the buffer hold at least `bytes` (a larger one is kept).
  void reserve(std::size_t bytes) {
    if (bytes <= capacity_) return;
    // Left uninitialised: every byte of a piece is copied in before it is written.
    buffer_.reset();
    capacity_ = 0;
    buffer_ = std::make_unique_for_overwrite<std::byte[]>(bytes);
    capacity_ = bytes;
  }

  /// Writes every page of the buffer once, so that the system maps them
  /// now rather than during a save's copy (the first save into a fresh
  /// buffer otherwise spends most of its time in page faults). Touches the
  /// buffer only: another thread may run it while no save is in progress.
  void fault_in() noexcept {
    // One write per 4 KiB suffices on every page size of 4 KiB or more.
    constexpr std::size_t page = 4096;
    for (std::size_t i = 0; i < capacity_; i += page) buffer_[i] = std::byte{0};
  }

  /// Bytes held for the copies (kept between saves).
  std::size_t bytes() const noexcept { return capacity_; }

  /// True on a writing rank until a copy fails: the sink a trainer's
  /// write_full streams a full file's tensors into, as into the file itself.
  bool writing() const noexcept { return writes_ && !error_; }

  /// Copies tensor `name`'s next values (a full file's pieces).
  template <class T>
  void write(std::string_view name, std::span<const T> data) {
    if (writing()) copy(std::string(name), {}, std::as_bytes(data));
  }

  /// Copies one range of a sharded file.
  void add(const checkpoint::ShardRange& range, std::span<const std::byte> data) {
    if (writing()) copy({}, range, data);
  }

  /// Keeps a failure of the copying for the save's agreement.
  void fail(std::exception_ptr e) noexcept {
    if (!error_) error_ = std::move(e);
  }
  const std::exception_ptr& error() const noexcept { return error_; }

  /// The generation a sharded save writes, which every rank agreed on.
  void set_generation(std::uint64_t g) noexcept { generation_ = g; }

  /// Writes this rank's file from the copies and makes it durable (a full
  /// file to a directory first picks its generation there, rank 0 being its
  /// only writer). Touches nothing but the file system and this snapshot;
  /// throws what the file layer throws.
  void write_files() {
    if (sharded_) {
      checkpoint::ShardWriter out(path_, shard_stem, generation_id(generation_), shard_, shards_, infos_, ranges(),
                                  metadata_);
      for (const Piece& p : pieces_) out.write(p.range, data_of(p));
      out.commit();
      return;
    }
    std::filesystem::path file = path_;
    if (in_directory()) {
      generation_ = prepare_generation(path_);
      file = path_ / full_file_name_of(generation_);
    } else if (path_.has_parent_path()) {
      checkpoint::detail::make_directories(path_.parent_path());
    }
    checkpoint::SafetensorsWriter out(file, infos_, metadata_);
    for (const Piece& p : pieces_) out.write(p.name, data_of(p));
    out.commit();
  }

  /// Whether the save's commit is a directory's commit file (else the full
  /// file's own rename, done by write_files()).
  bool in_directory() const { return sharded_ || path_.extension() != ".safetensors"; }

  /// Rank 0, once every rank's files are durable: commits the generation
  /// (a sharded one after writing its index) and removes the others' files.
  void commit() const {
    if (sharded_) {
      commit_sharded(path_, generation_, shards_, infos_);
      return;
    }
    commit_generation(path_, generation_, full_file_name_of(generation_));
    remove_leftovers(path_, generation_);
  }

 private:
  struct Piece {
    std::string name;
    checkpoint::ShardRange range;
    std::size_t offset = 0, size = 0;
  };

  void copy(std::string name, checkpoint::ShardRange range, std::span<const std::byte> data) {
    if (data.size() > capacity_ - used_) {
      fail(std::make_exception_ptr(Error("gradsync: internal error: a checkpoint's snapshot was planned at " +
                                         std::to_string(capacity_) + " bytes, and its pieces need more")));
      return;
    }
    if (!data.empty()) std::memcpy(buffer_.get() + used_, data.data(), data.size());
    pieces_.push_back({std::move(name), std::move(range), used_, data.size()});
    used_ += data.size();
  }

  std::span<const std::byte> data_of(const Piece& p) const noexcept { return {buffer_.get() + p.offset, p.size}; }

  std::vector<checkpoint::ShardRange> ranges() const {
    std::vector<checkpoint::ShardRange> r;
    for (const Piece& p : pieces_) r.push_back(p.range);
    return r;
  }

  std::filesystem::path path_;
  bool sharded_ = false, writes_ = false;
  std::vector<checkpoint::TensorInfo> infos_;
  checkpoint::Metadata metadata_;
  int shard_ = 0, shards_ = 1;
  std::uint64_t generation_ = 0;
  std::vector<Piece> pieces_;
  std::unique_ptr<std::byte[]> buffer_;
  std::size_t capacity_ = 0, used_ = 0;
  std::exception_ptr error_;
};

}  // namespace gradsync::detail

#pragma once
/// \file detail: the files of a checkpoint directory, and how a save commits
/// one generation of them.
///
/// A save to directory D writes generation g, one more than any generation
/// named in D, under names no earlier save used:
///
///     D/checkpoint-0000000g.safetensors                           full layout
///     D/checkpoint-0000000g-rankRRRRR-of-NNNNN.safetensors, and
///     D/checkpoint-0000000g.index.json                            sharded layout
///
/// Each file is written to a temporary, fsynced, renamed into place and
/// its directory fsynced. Once every rank's files are durable (an
/// agreement), rank 0 writes `D/checkpoint.commit`, naming g and its entry
/// file, the same way: that one rename is the commit point. A load reads
/// only what the commit file names, so a save killed at any moment leaves
/// the previous generation or the new one, never a mix. After the commit,
/// rank 0 removes every other generation's files, the single-layout files
/// of directories written before commit files, and stale temporaries.
///
/// A directory without a commit file is read as such an older one:
/// `checkpoint.safetensors`, or `checkpoint.index.json` and the shard files
/// it names (one of the two).

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "gradsync/checkpoint/commit_record.hpp"
#include "gradsync/checkpoint/file_ops.hpp"
#include "gradsync/checkpoint/shard_index.hpp"
#include "gradsync/checkpoint/shard_writer.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/core/error.hpp"

namespace gradsync::detail {

/// The commit file of a checkpoint directory.
inline constexpr std::string_view commit_file_name = "checkpoint.commit";
/// What every checkpoint file's name starts with.
inline constexpr std::string_view shard_stem = "checkpoint";
/// The entry files of a directory written before commit files.
inline constexpr std::string_view full_file_name = "checkpoint.safetensors";
inline constexpr std::string_view index_file_name = "checkpoint.index.json";

/// "00000007": the checkpoint id of generation 7 (a sharded index and its shard files carry it too).
inline std::string generation_id(std::uint64_t generation) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%08llu", static_cast<unsigned long long>(generation));
  return buf;
}

inline std::string full_file_name_of(std::uint64_t generation) {
  return std::string(shard_stem) + "-" + generation_id(generation) + ".safetensors";
}

inline std::string index_file_name_of(std::uint64_t generation) {
  return std::string(shard_stem) + "-" + generation_id(generation) + ".index.json";
}

/// The generation whose file `name` is ("checkpoint-<digits>" then '.' or
/// '-'), if it is one.
inline std::optional<std::uint64_t> generation_of(std::string_view name) {
  const std::string_view prefix = "checkpoint-";
  if (!name.starts_with(prefix)) return std::nullopt;
  name.remove_prefix(prefix.size());
  std::uint64_t g = 0;
  const auto [end, ec] = std::from_chars(name.data(), name.data() + name.size(), g);
  if (ec != std::errc() || end == name.data() || end == name.data() + name.size() || (*end != '.' && *end != '-')) {
    return std::nullopt;
  }
  return g;
}

/// Whether `name` is a file a checkpoint save writes: a generation's, an
/// older directory's, or a temporary of either.
inline bool is_checkpoint_file(std::string_view name) {
  if (name == full_file_name || name == index_file_name) return true;
  if (name.starts_with(".checkpoint") && name.find(".tmp-") != std::string_view::npos) return true;
  return name.starts_with("checkpoint-") && (name.ends_with(".safetensors") || name.ends_with(".index.json"));
}

/// Rank 0's first step of a save to `dir`: creates it, and returns the
/// generation to write, one past every generation named there (committed
/// or left by a failed save), so that no file of the new one overwrites any.
inline std::uint64_t prepare_generation(const std::filesystem::path& dir) {
  checkpoint::detail::make_directories(dir);
  std::uint64_t last = 0;
  for (const std::string& name : checkpoint::detail::list_directory(dir)) {
    if (const auto g = generation_of(name); g && *g > last) last = *g;
  }
  if (last == UINT64_MAX) {
    throw Error("gradsync: save_checkpoint: '" + dir.string() +
                "' holds a file of the last generation number; remove the files named checkpoint-* there");
  }
  return last + 1;
}

/// Commits generation `generation` of `dir`, whose entry file is `file`:
/// the atomic rename of the commit file, then the fsync of the directory.
inline void commit_generation(const std::filesystem::path& dir, std::uint64_t generation, const std::string& file) {
  checkpoint::CommitRecord{generation, file}.write(dir / commit_file_name);
}

/// After a commit: removes every checkpoint file of `dir` that is not of
/// `generation` (no load reads them). A file that cannot be removed stays,
/// for the next save.
inline void remove_leftovers(const std::filesystem::path& dir, std::uint64_t generation) noexcept {
  try {
    for (const std::string& name : checkpoint::detail::list_directory(dir)) {
      if (is_checkpoint_file(name) && generation_of(name) != generation) {
        checkpoint::detail::remove_file(dir / name);
      }
    }
  } catch (...) {
    // A directory that cannot be listed now keeps its leftovers for the next save.
  }
}

/// Rank 0's part once every shard file of generation `g` is durable: the
/// index from the files' headers, the commit, and the removal of the other
/// generations' files.
inline void commit_sharded(const std::filesystem::path& dir, std::uint64_t g, int shards,
                           const std::vector<checkpoint::TensorInfo>& infos) {
  const std::string id = generation_id(g);
  std::vector<std::string> files;
  for (int r = 0; r < shards; ++r) files.push_back(checkpoint::shard_file_name(shard_stem, id, r, shards));
  const auto index = checkpoint::ShardIndex::from_shard_files(dir, id, files, infos);
  index.write(dir / index_file_name_of(g));
  commit_generation(dir, g, index_file_name_of(g));
  remove_leftovers(dir, g);
}

/// What load_checkpoint reads for a path, and whether it is a sharded index.
struct CheckpointEntry {
  std::filesystem::path file;
  bool sharded = false;
  /// The committed generation's id when a commit file named it ("" otherwise).
  std::string id;
};

/// The entry a path names: a `.safetensors` file or an `.index.json` index
/// itself; in a directory, what its commit file names or, without one, the
/// older layout's entry file. Nullopt for a directory that holds none.
inline std::optional<CheckpointEntry> find_checkpoint(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  const std::string name = path.filename().string();
  if (path.extension() == ".safetensors") return CheckpointEntry{path, false, ""};
  if (name.ends_with(".index.json")) return CheckpointEntry{path, true, ""};
  if (const auto commit = checkpoint::CommitRecord::read(path / commit_file_name)) {
    return CheckpointEntry{path / commit->file, commit->file.ends_with(".index.json"), generation_id(commit->generation)};
  }
  const fs::path index = path / index_file_name, full = path / full_file_name;
  std::error_code ec;
  const bool has_index = fs::exists(index, ec), has_full = fs::exists(full, ec);
  if (has_index && has_full) {
    throw InvalidArgument("gradsync: load_checkpoint: '" + path.string() + "' has no '" +
                          std::string(commit_file_name) + "' and holds both a full checkpoint ('" +
                          std::string(full_file_name) + "') and a sharded one ('" + std::string(index_file_name) +
                          "'); name the file or the index to load");
  }
  if (has_index) return CheckpointEntry{index, true, ""};
  if (has_full) return CheckpointEntry{full, false, ""};
  return std::nullopt;
}

}  // namespace gradsync::detail

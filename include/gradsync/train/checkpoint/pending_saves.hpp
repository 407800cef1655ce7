#pragma once
/// \file detail::PendingSaves: the paths each trainer's AsyncCheckpointer has a save pending to.

#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <system_error>

namespace gradsync::detail {

/// A synchronous save_checkpoint to the path an AsyncCheckpointer of the
/// same trainer has not committed yet would race with it: both number the
/// same generation of files, and the later commit, or its clean-up of the
/// other generations, removes or replaces the one the other committed. So
/// save() records its path here until wait() settles it, and save_checkpoint
/// refuses that path meanwhile. Keyed by trainer, so that each rank (a
/// thread of one process on Threads) asks about its own checkpointer only.
class PendingSaves {
 public:
  static void add(const void* trainer, const std::filesystem::path& path) {
    const std::lock_guard<std::mutex> lock(mutex());
    paths()[trainer] = normal(path);
  }
  static void remove(const void* trainer) noexcept {
    const std::lock_guard<std::mutex> lock(mutex());
    paths().erase(trainer);
  }
  /// The pending save's path, if `trainer` has one to `path` (as written, or
  /// the same after making both absolute and normal).
  static std::optional<std::filesystem::path> to(const void* trainer, const std::filesystem::path& path) {
    const std::lock_guard<std::mutex> lock(mutex());
    const auto it = paths().find(trainer);
    if (it == paths().end() || it->second != normal(path)) return std::nullopt;
    return it->second;
  }

 private:
  static std::filesystem::path normal(const std::filesystem::path& path) {
    std::error_code ec;
    std::filesystem::path p = std::filesystem::absolute(path, ec);
    if (ec) p = path;
    p = p.lexically_normal();
    // "ckpt/" and "ckpt" are one directory.
    return p.has_filename() ? p : p.parent_path();
  }
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<const void*, std::filesystem::path>& paths() {
    static std::map<const void*, std::filesystem::path> m;
    return m;
  }
};

}  // namespace gradsync::detail

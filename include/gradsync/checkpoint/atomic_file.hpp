#pragma once
/// \file A file that appears under its name complete or not at all (POSIX):
/// written to a temporary in the same directory, fsynced, renamed over the
/// target, and the directory fsynced so the rename itself survives a crash.

#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <utility>

#include "gradsync/checkpoint/file_ops.hpp"
#include "gradsync/core/error.hpp"

namespace gradsync::checkpoint {

/// Makes a rename or creation in `dir` durable (fsync of the directory).
inline void sync_directory(const std::filesystem::path& dir) { detail::sync_directory(dir); }

/// Writes a file atomically. Bytes go to `.<name>.tmp-<pid>-<n>-<random>` beside the
/// target; `commit()` fsyncs it, renames it over the target and fsyncs the
/// directory. Destroyed without commit (an exception, an abandoned write), it
/// removes the temporary and the target is untouched. A process killed
/// mid-write leaves only a stale temporary, never a partial target.
class AtomicFile {
 public:
  explicit AtomicFile(std::filesystem::path target) : target_(std::move(target)) {
    // pid, a per-process counter and a random number: unique across threads,
    // processes and hosts that share the directory.
    static std::atomic<unsigned> counter{0};
    static const unsigned nonce = std::random_device{}();
    temp_ = target_.parent_path() / ("." + target_.filename().string() + ".tmp-" + std::to_string(::getpid()) +
                                     "-" + std::to_string(counter.fetch_add(1)) + "-" + std::to_string(nonce));
    fd_ = detail::create_file(temp_);
  }

  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  ~AtomicFile() {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(temp_.c_str());
    }
  }

  /// Appends `bytes` at the current end.
  void write(std::span<const std::byte> bytes) {
    write_at(size_, bytes);
    size_ += bytes.size();
  }

  /// Overwrites bytes already written (a header whose checksums are known only at the end).
  void write_at(std::uint64_t offset, std::span<const std::byte> bytes) {
    if (fd_ < 0) throw InvalidArgument("checkpoint: '" + target_.string() + "' written after commit");
    detail::write_at(fd_, temp_, offset, bytes);
  }

  /// Bytes appended so far.
  std::uint64_t size() const noexcept { return size_; }
  const std::filesystem::path& target() const noexcept { return target_; }

  /// Makes the file durable and visible under its name, replacing any old one.
  void commit() {
    if (fd_ < 0) throw InvalidArgument("checkpoint: '" + target_.string() + "' was already committed");
    detail::sync_file(fd_, temp_);
    try {
      detail::close_file(std::exchange(fd_, -1), temp_);
      detail::rename_file(temp_, target_);
    } catch (...) {
      ::unlink(temp_.c_str());
      throw;
    }
    detail::sync_directory(detail::parent_of(target_));
  }

 private:
  std::filesystem::path target_;
  std::filesystem::path temp_;
  std::uint64_t size_ = 0;
  int fd_ = -1;
};

}  // namespace gradsync::checkpoint

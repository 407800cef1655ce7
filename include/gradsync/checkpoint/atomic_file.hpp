#pragma once
/// \file A file that appears under its name complete or not at all (POSIX):
/// written to a temporary in the same directory, fsynced, renamed over the
/// target, and the directory fsynced so the rename itself survives a crash.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <utility>

#include "gradsync/core/error.hpp"

namespace gradsync::checkpoint {

namespace detail {

/// Test hook: called at each step of an atomic write ("write", "fsync",
/// "rename", "sync_dir"); the kill test sets it to die at a chosen step.
inline void (*io_step_hook)(const char* step) = nullptr;

inline void io_step(const char* step) {
  if (io_step_hook) io_step_hook(step);
}

[[noreturn]] inline void throw_io(const std::string& what, const std::filesystem::path& path, int err) {
  throw Error("checkpoint: " + what + " '" + path.string() + "' failed: " + std::strerror(err));
}

}  // namespace detail

/// Makes a rename or creation in `dir` durable (fsync of the directory).
inline void sync_directory(const std::filesystem::path& dir) {
  const auto d = dir.empty() ? std::filesystem::path(".") : dir;
  int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) detail::throw_io("opening directory", d, errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) detail::throw_io("fsync of directory", d, err);
}

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
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0) detail::throw_io("creating temporary file", temp_, errno);
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
    const std::byte* p = bytes.data();
    std::size_t n = bytes.size();
    while (n > 0) {
      ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) detail::throw_io("writing", temp_, errno);
      p += w;
      n -= static_cast<std::size_t>(w);
      offset += static_cast<std::uint64_t>(w);
      detail::io_step("write");
    }
  }

  /// Bytes appended so far.
  std::uint64_t size() const noexcept { return size_; }
  const std::filesystem::path& target() const noexcept { return target_; }

  /// Makes the file durable and visible under its name, replacing any old one.
  void commit() {
    if (fd_ < 0) throw InvalidArgument("checkpoint: '" + target_.string() + "' was already committed");
    detail::io_step("fsync");
    if (::fsync(fd_) != 0) detail::throw_io("fsync of", temp_, errno);
    int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) {
      int err = errno;
      ::unlink(temp_.c_str());
      detail::throw_io("closing", temp_, err);
    }
    detail::io_step("rename");
    if (::rename(temp_.c_str(), target_.c_str()) != 0) {
      int err = errno;
      ::unlink(temp_.c_str());
      detail::throw_io("renaming into place", target_, err);
    }
    detail::io_step("sync_dir");
    sync_directory(target_.parent_path());
  }

 private:
  std::filesystem::path target_;
  std::filesystem::path temp_;
  std::uint64_t size_ = 0;
  int fd_ = -1;
};

}  // namespace gradsync::checkpoint

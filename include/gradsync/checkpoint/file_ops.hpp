#pragma once
/// \file detail: the file-system operations a checkpoint save makes. Each
/// one is checked (a refusal is a FileError naming the path, the system's
/// reason and the fix) and is shown first to a test hook, which can make it
/// fail with a chosen errno or end the process right there.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "gradsync/core/error.hpp"

namespace gradsync::checkpoint::detail {

/// What a save does to the file system, one value per system call.
enum class FileOp : std::uint8_t {
  make_directory,
  create,
  write,
  sync,
  close,
  rename,
  open_directory,
  sync_directory,
  list_directory,
  remove,
};

inline const char* op_name(FileOp op) noexcept {
  switch (op) {
    case FileOp::make_directory: return "make_directory";
    case FileOp::create: return "create";
    case FileOp::write: return "write";
    case FileOp::sync: return "sync";
    case FileOp::close: return "close";
    case FileOp::rename: return "rename";
    case FileOp::open_directory: return "open_directory";
    case FileOp::sync_directory: return "sync_directory";
    case FileOp::list_directory: return "list_directory";
    case FileOp::remove: return "remove";
  }
  return "?";
}

/// Test hook, called before each operation with its kind and path. It
/// returns 0 to let the operation run, or an errno value to make it fail as
/// if the system had refused with that error: a full disk or a read-only
/// file system, which a test cannot always make the system give. The kill
/// tests end the process from it. Set it before the ranks start: every
/// rank's thread calls it.
inline int (*file_op_hook)(FileOp op, const std::filesystem::path& path) = nullptr;

inline int injected(FileOp op, const std::filesystem::path& path) {
  return file_op_hook ? file_op_hook(op, path) : 0;
}

/// What to do about a refusal, by its errno.
inline std::string_view remedy(int err) noexcept {
  switch (err) {
    case ENOSPC:
    case EDQUOT: return "free space on that file system, or save elsewhere";
    case EROFS: return "the file system is mounted read-only: save to a writable one";
    case EACCES:
    case EPERM: return "give this process write permission there, or save elsewhere";
    case ENOTDIR: return "a component of the path is a file, not a directory: move it away or choose another path";
    case EISDIR: return "a directory stands where the file goes: move it away or choose another path";
    case ENAMETOOLONG: return "shorten the path (at most 255 bytes a name, 4095 in all)";
    case ENOENT: return "a directory of the path is missing (was it removed meanwhile?)";
    case EIO: return "the device reported an I/O error: check it, and save elsewhere";
    case EMFILE:
    case ENFILE: return "too many files are open: raise the limit (ulimit -n)";
    default: return "check the path and its file system";
  }
}

[[noreturn]] inline void throw_file_error(std::string_view doing, const std::filesystem::path& path, int err) {
  throw FileError("checkpoint: " + std::string(doing) + " '" + path.string() + "' failed: " + std::strerror(err) +
                      "; " + std::string(remedy(err)),
                  path.string(), err);
}

/// The directory holding `path` ("." for a bare name).
inline std::filesystem::path parent_of(const std::filesystem::path& path) {
  return path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
}

/// Makes a rename or creation in `dir` durable (fsync of the directory).
inline void sync_directory(const std::filesystem::path& dir) {
  const auto d = dir.empty() ? std::filesystem::path(".") : dir;
  if (int e = injected(FileOp::open_directory, d)) throw_file_error("opening directory", d, e);
  const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw_file_error("opening directory", d, errno);
  int err = injected(FileOp::sync_directory, d);
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  ::close(fd);
  if (err != 0) throw_file_error("fsync of directory", d, err);
}

/// Creates `dir` and every missing directory above it, each made durable in
/// its parent; an existing directory is left as it is.
inline void make_directories(const std::filesystem::path& dir) {
  std::filesystem::path at;
  for (const auto& part : dir) {
    at /= part;
    if (part.empty()) continue;
    struct stat st {};
    if (::stat(at.c_str(), &st) == 0) {
      if (S_ISDIR(st.st_mode)) continue;
      throw_file_error("creating directory", at, ENOTDIR);
    }
    if (errno != ENOENT) throw_file_error("looking up directory", at, errno);
    if (int e = injected(FileOp::make_directory, at)) throw_file_error("creating directory", at, e);
    if (::mkdir(at.c_str(), 0777) != 0 && errno != EEXIST) throw_file_error("creating directory", at, errno);
    sync_directory(parent_of(at));
  }
}

/// Creates `path`, which must not exist, for writing; returns its descriptor.
inline int create_file(const std::filesystem::path& path) {
  if (int e = injected(FileOp::create, path)) throw_file_error("creating file", path, e);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw_file_error("creating file", path, errno);
  return fd;
}

/// Writes all of `bytes` at `offset` of the file `fd` (named `path`).
inline void write_at(int fd, const std::filesystem::path& path, std::uint64_t offset, std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    if (int e = injected(FileOp::write, path)) throw_file_error("writing", path, e);
    const ssize_t w = ::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) throw_file_error("writing", path, errno);
    // A regular file takes at least a byte or says why not; nothing taken and no reason is a device fault.
    if (w == 0) throw_file_error("writing", path, EIO);
    bytes = bytes.subspan(static_cast<std::size_t>(w));
    offset += static_cast<std::uint64_t>(w);
  }
}

/// Makes the file's data durable (fsync).
inline void sync_file(int fd, const std::filesystem::path& path) {
  if (int e = injected(FileOp::sync, path)) throw_file_error("fsync of", path, e);
  if (::fsync(fd) != 0) throw_file_error("fsync of", path, errno);
}

/// Closes the file; the descriptor is released whatever the outcome.
inline void close_file(int fd, const std::filesystem::path& path) {
  const int e = injected(FileOp::close, path);
  const int rc = ::close(fd);
  if (e != 0) throw_file_error("closing", path, e);
  // After EINTR the descriptor is gone on Linux and the data was already synced.
  if (rc != 0 && errno != EINTR) throw_file_error("closing", path, errno);
}

/// Renames `from` over `to`, atomically.
inline void rename_file(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (int e = injected(FileOp::rename, to)) throw_file_error("renaming into place", to, e);
  if (::rename(from.c_str(), to.c_str()) != 0) throw_file_error("renaming into place", to, errno);
}

/// The names in directory `dir`.
inline std::vector<std::string> list_directory(const std::filesystem::path& dir) {
  if (int e = injected(FileOp::list_directory, dir)) throw_file_error("listing directory", dir, e);
  std::vector<std::string> names;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    names.push_back(it->path().filename().string());
  }
  if (ec) throw_file_error("listing directory", dir, ec.value());
  return names;
}

/// Removes file `path`; false if it could not be (a clean-up that can wait for the next save).
inline bool remove_file(const std::filesystem::path& path) noexcept {
  if (injected(FileOp::remove, path) != 0) return false;
  return ::unlink(path.c_str()) == 0 || errno == ENOENT;
}

}  // namespace gradsync::checkpoint::detail

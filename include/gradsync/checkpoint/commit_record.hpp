#pragma once
/// \file The small file whose atomic rename commits one generation of a
/// checkpoint directory: it names the generation and its entry file.

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>

#include "gradsync/checkpoint/atomic_file.hpp"
#include "gradsync/checkpoint/file_ops.hpp"
#include "gradsync/checkpoint/json.hpp"
#include "gradsync/core/error.hpp"

namespace gradsync::checkpoint {

/// The content of a commit file, one line of JSON:
///
///     {"format":"gradsync.commit","version":1,"generation":7,"file":"checkpoint-00000007.safetensors"}
///
/// `file` is a plain name in the commit file's own directory: the entry
/// point of the committed generation (a safetensors file, or a sharded
/// index naming the generation's other files).
struct CommitRecord {
  std::uint64_t generation = 0;
  std::string file;

  /// Reads the commit file at `path`; nullopt if there is none. Throws
  /// FileError if the system refuses to read it, Error if it is not a
  /// commit record, each naming the path.
  static std::optional<CommitRecord> read(const std::filesystem::path& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 && (errno == ENOENT || errno == ENOTDIR)) return std::nullopt;
    if (fd < 0) detail::throw_file_error("opening commit file", path, errno);
    std::string text;
    char buf[512];
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int err = errno;
        ::close(fd);
        detail::throw_file_error("reading commit file", path, err);
      }
      if (n == 0) break;
      text.append(buf, static_cast<std::size_t>(n));
    }
    ::close(fd);
    auto bad = [&](const std::string& what) -> CommitRecord {
      throw Error("checkpoint: commit file '" + path.string() + "' " + what +
                  "; a save writes it whole or not at all, so something else changed it: restore it from a copy "
                  "or write a new checkpoint");
    };
    detail::JsonDocument doc;
    try {
      doc = detail::parse_json(std::move(text));
    } catch (const detail::JsonError& e) {
      return bad(std::string("is not valid JSON: ") + e.what());
    }
    const detail::Json& j = doc.root();
    if (!j.is_object()) return bad("is not a JSON object");
    const detail::Json* format = j.find("format");
    const detail::Json* version = j.find("version");
    const detail::Json* generation = j.find("generation");
    const detail::Json* file = j.find("file");
    if (!format || !format->is_string() || format->string() != "gradsync.commit")
      return bad("is not a gradsync commit record (its \"format\" is not \"gradsync.commit\")");
    if (!version || !version->is_integer() || version->integer() != 1) return bad("has an unsupported \"version\"");
    if (!generation || !generation->is_integer()) return bad("has no integer \"generation\"");
    if (!file || !file->is_string() || file->string().empty() || file->string().find('/') != std::string::npos ||
        file->string().starts_with(".")) {
      return bad("does not name a plain file in its directory");
    }
    return CommitRecord{generation->integer(), std::string(file->string())};
  }

  /// Writes the record atomically over `path` (fsync of the file, rename,
  /// fsync of the directory): the rename is the commit.
  void write(const std::filesystem::path& path) const {
    std::string s = "{\"format\":\"gradsync.commit\",\"version\":1,\"generation\":" + std::to_string(generation) +
                    ",\"file\":";
    detail::append_json_string(s, file);
    s += "}\n";
    AtomicFile f(path);
    f.write(std::as_bytes(std::span(s)));
    f.commit();
  }
};

}  // namespace gradsync::checkpoint

#pragma once
/// \file The small file whose atomic rename commits one generation of a
/// checkpoint directory: it names the generation and its entry file.

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <span>
#include <string>

#include "gradsync/checkpoint/atomic_file.hpp"
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
  /// Error naming the path if it cannot be read or is not a commit record.
  static std::optional<CommitRecord> read(const std::filesystem::path& path) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec) && !ec) return std::nullopt;
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      throw Error("checkpoint: cannot open commit file '" + path.string() +
                  "'; give this process read permission there");
    }
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto bad = [&](const std::string& what) -> CommitRecord {
      throw Error("checkpoint: commit file '" + path.string() + "' " + what +
                  "; a save writes it whole or not at all, so something else changed it: restore it from a copy "
                  "or write a new checkpoint");
    };
    detail::Json j;
    try {
      j = detail::parse_json(text);
    } catch (const detail::JsonError& e) {
      return bad(std::string("is not valid JSON: ") + e.what());
    }
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
    return CommitRecord{generation->integer(), file->string()};
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

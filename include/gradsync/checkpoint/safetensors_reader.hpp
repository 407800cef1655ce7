#pragma once
/// \file Reads and validates one safetensors file; loads a set of tensors
/// all or nothing.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/checkpoint/crc32.hpp"
#include "gradsync/checkpoint/json.hpp"
#include "gradsync/checkpoint/safetensors_writer.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/core/error.hpp"

namespace gradsync::checkpoint {

/// A tensor as a file holds it: its spec, where its data lies in the file
/// (absolute byte offset) and its stored checksum.
struct TensorEntry {
  TensorInfo spec;
  std::uint64_t offset = 0;
  std::optional<std::uint32_t> crc32;
};

/// Where to load one tensor: the spec the caller expects and its memory.
struct TensorSlot {
  TensorInfo spec;
  std::span<std::byte> data;
};

/// One tensor to save: its spec and its bytes.
struct TensorData {
  TensorInfo spec;
  std::span<const std::byte> data;
};

/// An open safetensors file whose header has been checked against the
/// format and the file's size: known dtypes, shapes that match their byte
/// ranges, ranges that tile the data exactly (a truncated or extended file
/// fails here), and, for a file gradsync wrote, a checksum for every tensor.
/// Every error is a gradsync::Error that names the file (and the tensor).
class SafetensorsReader {
 public:
  /// Largest header accepted (the Python package's own limit).
  static constexpr std::uint64_t max_header_bytes = 100'000'000;

  /// Opens and validates `path`. `require_checksums`: refuse a file without a
  /// CRC-32 for each tensor (files from other writers have none; pass false).
  explicit SafetensorsReader(std::filesystem::path path, bool require_checksums = true) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) fail("cannot open: " + std::string(std::strerror(errno)));
    try {
      parse(require_checksums);
    } catch (const std::bad_alloc&) {
      ::close(fd_);
      // A header of tiny values (`[0,0,...`) takes up to about 40 bytes of memory per byte to parse.
      fail("there is not enough memory to parse its header (up to about 40 times its size; is the file corrupted?)");
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }

  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;
  SafetensorsReader(SafetensorsReader&& o) noexcept
      : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)), tensors_(std::move(o.tensors_)),
        by_name_(std::move(o.by_name_)), metadata_(std::move(o.metadata_)), file_size_(o.file_size_) {}
  ~SafetensorsReader() {
    if (fd_ >= 0) ::close(fd_);
  }

  const std::filesystem::path& path() const noexcept { return path_; }
  /// Tensors in the order of their data in the file.
  const std::vector<TensorEntry>& tensors() const noexcept { return tensors_; }
  /// `__metadata__`, including gradsync's own keys.
  const Metadata& metadata() const noexcept { return metadata_; }

  /// The tensor called `name`, or null. Logarithmic in the tensors.
  const TensorEntry* find(std::string_view name) const noexcept {
    const NameKey want{std::hash<std::string_view>{}(name), 0};
    auto it = std::lower_bound(by_name_.begin(), by_name_.end(), want, [&](const NameKey& a, const NameKey& b) {
      return a.hash != b.hash ? a.hash < b.hash : tensors_[a.index].spec.name < name;
    });
    return it != by_name_.end() && it->hash == want.hash && tensors_[it->index].spec.name == name
               ? &tensors_[it->index]
               : nullptr;
  }

  /// The tensor called `name`; throws InvalidArgument naming the file if absent.
  const TensorEntry& tensor(std::string_view name) const {
    if (auto* t = find(name)) return *t;
    throw InvalidArgument("checkpoint: '" + path_.string() + "' has no tensor '" + std::string(name) + "'");
  }

  /// Reads `out.size()` raw bytes of `name`'s data starting `byte_offset` bytes into it; no checksum.
  void read_bytes(const TensorEntry& t, std::uint64_t byte_offset, std::span<std::byte> out) const {
    if (byte_offset > t.spec.bytes() || out.size() > t.spec.bytes() - byte_offset)
      fail("read of bytes [" + std::to_string(byte_offset) + ", +" + std::to_string(out.size()) +
           ") is outside tensor '" + t.spec.name + "'");
    pread_all(t.offset + byte_offset, out, t.spec.name);
  }

  /// Reads all of `name`'s data into `out` (exactly its size) and checks its CRC-32.
  void read(std::string_view name, std::span<std::byte> out) const {
    const auto& t = tensor(name);
    if (out.size() != t.spec.bytes())
      throw InvalidArgument("checkpoint: reading tensor '" + t.spec.name + "' of '" + path_.string() + "' into " +
                            std::to_string(out.size()) + " bytes; it has " + std::to_string(t.spec.bytes()));
    pread_all(t.offset, out, t.spec.name);
    verify(t, out);
  }

  /// Throws Error naming file and tensor if `data` (all of `t`'s bytes) does not match its stored CRC-32.
  void verify(const TensorEntry& t, std::span<const std::byte> data) const {
    if (!t.crc32) return;
    auto got = Crc32::of(data);
    if (got != *t.crc32)
      fail("tensor '" + t.spec.name + "' is corrupted: its data has CRC-32 " + crc32_hex(got) + ", the header says " +
           crc32_hex(*t.crc32));
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw Error("checkpoint: '" + path_.string() + "': " + what);
  }

  void pread_all(std::uint64_t offset, std::span<std::byte> out, std::string_view tensor) const {
    std::byte* p = out.data();
    std::size_t n = out.size();
    while (n > 0) {
      ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) fail("reading tensor '" + std::string(tensor) + "': " + std::strerror(errno));
      if (r == 0) fail("tensor '" + std::string(tensor) + "' is truncated (the file ended while reading it)");
      p += r;
      n -= static_cast<std::size_t>(r);
      offset += static_cast<std::uint64_t>(r);
    }
  }

  void parse(bool require_checksums) {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) fail("cannot stat: " + std::string(std::strerror(errno)));
    file_size_ = static_cast<std::uint64_t>(st.st_size);
    if (file_size_ < 8)
      fail("truncated: " + std::to_string(file_size_) +
           " bytes, shorter than the 8-byte header length (the file is cut short or not a safetensors file)");
    std::byte len_le[8];
    pread_all(0, len_le, "(header length)");
    std::uint64_t len = 0;
    for (int i = 7; i >= 0; --i) len = len << 8 | static_cast<std::uint64_t>(len_le[i]);
    if (len > max_header_bytes)
      fail("the header length says " + std::to_string(len) + " bytes, more than safetensors' limit of " +
           std::to_string(max_header_bytes) + " (the file is corrupted or not a safetensors file)");
    if (len > file_size_ - 8)
      fail("truncated: the header says it is " + std::to_string(len) + " bytes, but only " +
           std::to_string(file_size_ - 8) + " follow the length");
    std::string text(len, '\0');
    pread_all(8, std::as_writable_bytes(std::span(text)), "(header)");
    // The format's own rule, which also keeps a file of another kind from parsing as JSON by chance.
    if (text.empty() || text[0] != '{')
      fail("the header does not start with '{' at byte 8 (a safetensors header is a JSON object; the file is "
           "corrupted or not a safetensors file)");
    detail::JsonDocument doc;
    try {
      doc = detail::parse_json(std::move(text));
    } catch (const detail::JsonError& e) {
      fail("the header is not valid: " + e.reason() + " at byte " + std::to_string(8 + e.offset()) +
           " of the file (it is corrupted or was not written as safetensors)");
    }
    const auto& header = doc.root();
    const std::uint64_t data_start = 8 + len;
    for (const auto& member : header.array()) {
      const auto name = member.key();
      if (name == "__metadata__") {
        if (!member.is_object()) fail("__metadata__ is not an object");
        // Sorted keys (every writer that uses a sorted map) go in at the end in constant time.
        for (const auto& m : member.array()) {
          if (!m.is_string()) fail("__metadata__ value of '" + std::string(m.key()) + "' is not a string");
          metadata_.emplace_hint(metadata_.end(), m.key(), m.string());
        }
        continue;
      }
      tensors_.push_back(parse_tensor(std::string(name), member, 8 + doc.offset_of(member), data_start));
    }
    // Writers list tensors in data order, mostly: then there is nothing to move.
    auto by_offset = [](const TensorEntry& a, const TensorEntry& b) {
      return a.offset != b.offset ? a.offset < b.offset : a.spec.bytes() < b.spec.bytes();
    };
    if (!std::is_sorted(tensors_.begin(), tensors_.end(), by_offset))
      std::sort(tensors_.begin(), tensors_.end(), by_offset);
    // The format's rule: the tensors cover the data exactly, with no overlap and no hole.
    std::uint64_t end = data_start;
    const TensorEntry* before = nullptr;
    for (const auto& t : tensors_) {
      if (t.offset != end) {
        const auto at = std::to_string(t.offset - data_start);
        const auto prev = before ? "tensor '" + before->spec.name + "'" : std::string("the start of the data");
        if (t.offset < end)
          fail("tensor '" + t.spec.name + "' starts at data offset " + at + ", inside " + prev + " (data_offsets " +
               "overlap; the header is corrupted)");
        fail("tensor '" + t.spec.name + "' starts at data offset " + at + ", leaving " +
             std::to_string(t.offset - end) + " bytes after " + prev +
             " that no tensor holds (safetensors allows no holes; the header is corrupted)");
      }
      end += t.spec.bytes();
      before = &t;
    }
    if (end != file_size_)
      fail("the file has " + std::to_string(file_size_ - end) +
           " bytes after the last tensor's data (safetensors allows no holes; the file is corrupted)");
    index_names();
    // The checksum keys lie together in the sorted metadata; each finds its tensor by name.
    const std::string prefix = crc32_key("");
    for (auto it = metadata_.lower_bound(prefix); it != metadata_.end() && it->first.starts_with(prefix); ++it) {
      const auto* t = find(std::string_view(it->first).substr(prefix.size()));
      if (!t) continue;
      auto& entry = tensors_[static_cast<std::size_t>(t - tensors_.data())];
      entry.crc32 = parse_crc32_hex(it->second);
      if (!entry.crc32)
        fail("checksum of tensor '" + entry.spec.name + "' is not 8 lower-case hex digits: '" + it->second + "'");
    }
    if (require_checksums || metadata_.contains(std::string(format_key)))
      for (const auto& t : tensors_)
        if (!t.crc32)
          fail("tensor '" + t.spec.name + "' has no checksum ('" + crc32_key(t.spec.name) + "' in __metadata__)");
  }

  // `at`: the byte of the file where the tensor's entry starts.
  TensorEntry parse_tensor(std::string name, const detail::Json& v, std::uint64_t at, std::uint64_t data_start) const {
    TensorEntry t;
    t.spec.name = std::move(name);
    auto bad = [&](const std::string& what) {
      fail("tensor '" + t.spec.name + "' (its header entry at byte " + std::to_string(at) + "): " + what);
    };
    if (!v.is_object()) bad("entry is not an object");
    const auto* dtype = v.find("dtype");
    const auto* shape = v.find("shape");
    const auto* offsets = v.find("data_offsets");
    if (!dtype || !shape || !offsets || v.size() != 3)
      bad("entry must have exactly the keys dtype, shape and data_offsets");
    if (!dtype->is_string()) bad("dtype is not a string");
    auto dt = parse_dtype(dtype->string());
    if (!dt)
      bad("unknown dtype '" + std::string(dtype->string().substr(0, 16)) +
          (dtype->string().size() > 16 ? "...'" : "'") +
          " (gradsync reads F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8 and BOOL)");
    t.spec.dtype = *dt;
    if (!shape->is_array()) bad("shape is not an array");
    t.spec.shape.reserve(shape->size());
    for (const auto& d : shape->array()) {
      if (!d.is_integer()) bad("shape holds a non-integer");
      t.spec.shape.push_back(d.integer());
    }
    if (!offsets->is_array() || offsets->size() != 2 || !offsets->array()[0].is_integer() ||
        !offsets->array()[1].is_integer())
      bad("data_offsets is not a pair of integers");
    const auto b = offsets->array()[0].integer(), e = offsets->array()[1].integer();
    auto pair = [&] { return "data_offsets [" + std::to_string(b) + ", " + std::to_string(e) + "]"; };
    // A corrupted header's shape can have millions of dimensions: a message shows the first few.
    auto shown_shape = [&] {
      const auto& d = t.spec.shape;
      if (d.size() <= 8) return shape_string(d);
      auto head = shape_string({d.begin(), d.begin() + 8});
      return head.substr(0, head.size() - 1) + ", ... (" + std::to_string(d.size()) + " dimensions)]";
    };
    auto bytes = t.spec.checked_bytes();
    if (!bytes)
      bad("shape " + shown_shape() + " of " + std::string(dtype_name(t.spec.dtype)) +
          " is larger than 2^64 bytes (its size overflows 64 bits; the header is corrupted)");
    if (e < b) bad(pair() + " end before they begin (the header is corrupted)");
    if (e - b != *bytes)
      bad(pair() + " hold " + std::to_string(e - b) + " bytes, but dtype " + std::string(dtype_name(t.spec.dtype)) +
          " and shape " + shown_shape() + " need " + std::to_string(*bytes));
    // Checked here, before any sum: offsets near 2^64 in a corrupted header must not wrap around.
    if (e > file_size_ - data_start)
      fail("truncated: tensor '" + t.spec.name + "' has " + pair() + ", but the file holds " +
           std::to_string(file_size_ - data_start) + " bytes of data after its header");
    t.offset = data_start + b;
    return t;
  }

  // A tensor's place in by_name_: sorted by the hash of its name, then by
  // name, so that sorting and finding compare integers, and text only where
  // hashes agree (which a hostile file can arrange, at a cost of log n).
  struct NameKey {
    std::size_t hash;
    std::size_t index;
  };

  void index_names() {
    by_name_.resize(tensors_.size());
    for (std::size_t i = 0; i < tensors_.size(); ++i)
      by_name_[i] = {std::hash<std::string_view>{}(tensors_[i].spec.name), i};
    std::sort(by_name_.begin(), by_name_.end(), [&](const NameKey& a, const NameKey& b) {
      return a.hash != b.hash ? a.hash < b.hash : tensors_[a.index].spec.name < tensors_[b.index].spec.name;
    });
  }

  std::filesystem::path path_;
  int fd_ = -1;
  std::vector<TensorEntry> tensors_;
  std::vector<NameKey> by_name_;
  Metadata metadata_;
  std::uint64_t file_size_ = 0;
};

/// Loads the tensors `slots` names from `path`, all or nothing: every
/// tensor's name, dtype and shape must match the file (and, unless
/// `allow_extra`, the file may hold no other tensor), and every checksum must
/// verify, before any slot is written. The data is staged in memory first,
/// so this needs as much free memory as the tensors loaded.
inline void load_safetensors(const std::filesystem::path& path, std::span<const TensorSlot> slots,
                             bool allow_extra = false) {
  SafetensorsReader reader(path);
  auto mismatch = [&](const std::string& what) {
    throw InvalidArgument("checkpoint: '" + path.string() + "' does not match: " + what);
  };
  for (const auto& s : slots) {
    const auto* t = reader.find(s.spec.name);
    if (!t) mismatch("it has no tensor '" + s.spec.name + "'");
    if (t->spec.dtype != s.spec.dtype || t->spec.shape != s.spec.shape)
      mismatch("tensor '" + s.spec.name + "' is " + std::string(dtype_name(t->spec.dtype)) + " " +
               shape_string(t->spec.shape) + ", expected " + std::string(dtype_name(s.spec.dtype)) + " " +
               shape_string(s.spec.shape));
    if (s.data.size() != s.spec.bytes())
      throw InvalidArgument("checkpoint: slot for tensor '" + s.spec.name + "' has " + std::to_string(s.data.size()) +
                            " bytes; its dtype and shape need " + std::to_string(s.spec.bytes()));
  }
  if (!allow_extra) {
    std::vector<std::string_view> asked;
    for (const auto& s : slots) asked.push_back(s.spec.name);
    std::sort(asked.begin(), asked.end());
    for (const auto& t : reader.tensors())
      if (!std::binary_search(asked.begin(), asked.end(), std::string_view(t.spec.name)))
        mismatch("it holds tensor '" + t.spec.name + "', which was not asked for");
  }
  std::vector<std::vector<std::byte>> staged(slots.size());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    staged[i].resize(slots[i].data.size());
    reader.read(slots[i].spec.name, staged[i]);
  }
  for (std::size_t i = 0; i < slots.size(); ++i)
    if (!staged[i].empty()) std::memcpy(slots[i].data.data(), staged[i].data(), staged[i].size());
}

/// Writes `tensors` to `path` in one go, atomically.
inline void save_safetensors(const std::filesystem::path& path, std::span<const TensorData> tensors,
                             Metadata metadata = {}) {
  std::vector<TensorInfo> specs;
  for (const auto& t : tensors) specs.push_back(t.spec);
  SafetensorsWriter w(path, std::move(specs), std::move(metadata));
  for (const auto& t : tensors) w.write(t.spec.name, t.data);
  w.commit();
}

}  // namespace gradsync::checkpoint

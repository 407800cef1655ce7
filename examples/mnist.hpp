#pragma once
// MNIST's IDX files: images (magic 0x00000803: unsigned bytes, 3 dimensions)
// and labels (0x00000801: unsigned bytes, 1 dimension), every header field
// a big-endian 32-bit integer; plain or gzip-compressed, as MNIST and
// Fashion-MNIST are distributed. Needs the standard library and zlib only,
// so that its test builds without Eigen.
//
// Shared by examples/data_source.hpp and test/examples/test_mnist_reader.cpp.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <zlib.h>

namespace example::mnist {

/// The images of one IDX file: `count` images of rows x cols bytes, each row by row.
struct Images {
  std::size_t count = 0, rows = 0, cols = 0;
  std::vector<std::uint8_t> pixels;  // image i at pixels[i * rows * cols]
};

/// Images and labels of the same count, every label a digit 0..9.
struct LabelledImages {
  Images images;
  std::vector<std::uint8_t> labels;
};

inline constexpr std::uint32_t images_magic = 0x00000803;
inline constexpr std::uint32_t labels_magic = 0x00000801;

namespace detail {

/// The whole file as stored; a file that cannot be opened or read is an error naming it.
inline std::vector<std::uint8_t> read_raw(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw std::runtime_error("cannot open " + path);
  const std::streamoff size = f.tellg();
  if (size < 0) throw std::runtime_error("cannot read " + path);
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(size));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot read " + path);
  return bytes;
}

/// Whether `b` starts as every gzip stream does (RFC 1952's ID1 ID2).
inline bool is_gzip(std::span<const std::uint8_t> b) { return b.size() >= 2 && b[0] == 0x1f && b[1] == 0x8b; }

/// The bytes a gzip file holds, member after member (gzip allows several,
/// one after another); a truncated or corrupt stream, or bytes after the
/// last member that start none, is an error naming `path`.
inline std::vector<std::uint8_t> gunzip(std::span<const std::uint8_t> in, const std::string& path) {
  std::vector<std::uint8_t> out;
  // The trailer's ISIZE is the last member's length mod 2^32: a hint to reserve, never trusted as a length.
  if (in.size() >= 18) {
    const std::size_t n = in.size();
    const std::uint32_t hint = std::uint32_t(in[n - 4]) | (std::uint32_t(in[n - 3]) << 8) |
                               (std::uint32_t(in[n - 2]) << 16) | (std::uint32_t(in[n - 1]) << 24);
    out.reserve(std::min<std::size_t>(hint, std::size_t(1) << 30));
  }
  z_stream z{};
  // 16 + MAX_WBITS: a gzip wrapper only, whose CRC-32 and length zlib checks.
  if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) throw std::runtime_error(path + ": cannot start zlib's inflate");
  struct End {
    z_stream& z;
    ~End() { inflateEnd(&z); }
  } end{z};
  std::size_t at = 0;
  std::uint8_t chunk[1 << 16];
  while (true) {
    // avail_in is 32 bits: a file over 4 GiB is fed in pieces.
    if (z.avail_in == 0 && at < in.size()) {
      const std::size_t piece = std::min<std::size_t>(in.size() - at, 1u << 30);
      z.next_in = const_cast<Bytef*>(in.data() + at);
      z.avail_in = static_cast<uInt>(piece);
      at += piece;
    }
    z.next_out = chunk;
    z.avail_out = sizeof chunk;
    const int rc = inflate(&z, Z_NO_FLUSH);
    out.insert(out.end(), chunk, chunk + (sizeof chunk - z.avail_out));
    if (rc == Z_STREAM_END) {
      const std::size_t left = z.avail_in + (in.size() - at);
      if (left == 0) return out;
      const std::size_t next = in.size() - left;
      if (!is_gzip(in.subspan(next))) {
        throw std::runtime_error(path + ": " + std::to_string(left) +
                                 " bytes after the end of its gzip stream, which start no other; a corrupt file");
      }
      inflateReset(&z);
      continue;
    }
    if (rc == Z_OK) continue;
    if (rc == Z_BUF_ERROR && z.avail_in == 0 && at == in.size()) {
      throw std::runtime_error(path + " is truncated: its gzip stream ends early, after " +
                               std::to_string(out.size()) + " bytes of data; download it again");
    }
    const std::string why = z.msg ? z.msg : "zlib error " + std::to_string(rc);
    throw std::runtime_error(path + " is not a valid gzip file (" + why + " at byte " +
                             std::to_string(at - z.avail_in) + " of " + std::to_string(in.size()) +
                             "): a corrupt download?");
  }
}

/// The file's bytes, decompressed when it is gzip: told by its first two
/// bytes, not by its name, so a renamed file reads either way.
inline std::vector<std::uint8_t> read_file(const std::string& path) {
  std::vector<std::uint8_t> bytes = read_raw(path);
  return is_gzip(bytes) ? gunzip(bytes, path) : bytes;
}

inline std::uint32_t be32(std::span<const std::uint8_t> b, std::size_t at) {
  return (std::uint32_t(b[at]) << 24) | (std::uint32_t(b[at + 1]) << 16) | (std::uint32_t(b[at + 2]) << 8) |
         std::uint32_t(b[at + 3]);
}

inline std::string hex(std::uint32_t v) {
  char s[16];
  std::snprintf(s, sizeof s, "0x%08x", static_cast<unsigned>(v));
  return s;
}

/// Checks the magic number and that `header` bytes are there; names the fix when it can.
inline void check_header(std::span<const std::uint8_t> b, const std::string& path, std::uint32_t magic,
                         std::size_t header) {
  if (b.size() >= 4) {
    const std::uint32_t got = be32(b, 0);
    if (got != magic) {
      std::string what = path + ": magic number " + hex(got) + ", expected " + hex(magic) + " (" +
                         (magic == images_magic ? "IDX images" : "IDX labels") + ")";
      if (got == images_magic) what += "; this is an images file";
      if (got == labels_magic) what += "; this is a labels file";
      throw std::runtime_error(what);
    }
  }
  if (b.size() < header) {
    throw std::runtime_error(path + " is truncated: " + std::to_string(b.size()) + " bytes, less than its " +
                             std::to_string(header) + "-byte IDX header");
  }
}

/// Checks that the data after the header is exactly `expected` bytes.
inline void check_size(std::span<const std::uint8_t> b, const std::string& path, std::size_t header,
                       std::uint64_t expected, const std::string& what) {
  const std::uint64_t got = b.size() - header;
  if (got < expected) {
    throw std::runtime_error(path + " is truncated: its header says " + what + " (" + std::to_string(expected) +
                             " bytes), the file holds " + std::to_string(got) + " bytes after the header");
  }
  if (got > expected) {
    throw std::runtime_error(path + " has " + std::to_string(got - expected) + " bytes more than its header's " +
                             what + "; not an IDX file, or a corrupt one");
  }
}

}  // namespace detail

/// Parses an IDX images file already in memory; `path` names it in errors.
inline Images parse_images(std::span<const std::uint8_t> bytes, const std::string& path) {
  constexpr std::size_t header = 16;
  detail::check_header(bytes, path, images_magic, header);
  const std::uint32_t count = detail::be32(bytes, 4), rows = detail::be32(bytes, 8), cols = detail::be32(bytes, 12);
  if (rows == 0 || cols == 0 || rows > 65535 || cols > 65535) {
    throw std::runtime_error(path + ": images of " + std::to_string(rows) + " x " + std::to_string(cols) +
                             " pixels; each side must be 1..65535");
  }
  // count < 2^32 and rows * cols < 2^32: the product fits in 64 bits.
  const std::uint64_t expected = std::uint64_t(count) * rows * cols;
  if (expected > std::numeric_limits<std::size_t>::max()) throw std::runtime_error(path + " is too large");
  detail::check_size(bytes, path, header, expected,
                     std::to_string(count) + " images of " + std::to_string(rows) + " x " + std::to_string(cols));
  Images im{count, rows, cols, {}};
  im.pixels.assign(bytes.begin() + header, bytes.end());
  return im;
}

/// Parses an IDX labels file already in memory; `path` names it in errors.
inline std::vector<std::uint8_t> parse_labels(std::span<const std::uint8_t> bytes, const std::string& path) {
  constexpr std::size_t header = 8;
  detail::check_header(bytes, path, labels_magic, header);
  const std::uint32_t count = detail::be32(bytes, 4);
  detail::check_size(bytes, path, header, count, std::to_string(count) + " labels");
  return {bytes.begin() + header, bytes.end()};
}

/// Reads an IDX images file (e.g. train-images-idx3-ubyte).
inline Images read_images(const std::string& path) { return parse_images(detail::read_file(path), path); }

/// Reads an IDX labels file (e.g. train-labels-idx1-ubyte).
inline std::vector<std::uint8_t> read_labels(const std::string& path) {
  return parse_labels(detail::read_file(path), path);
}

/// Reads a matching pair; the counts must agree and every label be 0..9.
inline LabelledImages read(const std::string& images_path, const std::string& labels_path) {
  LabelledImages d{read_images(images_path), read_labels(labels_path)};
  if (d.labels.size() != d.images.count) {
    throw std::runtime_error(images_path + " holds " + std::to_string(d.images.count) + " images but " +
                             labels_path + " holds " + std::to_string(d.labels.size()) + " labels");
  }
  for (std::size_t i = 0; i < d.labels.size(); ++i) {
    if (d.labels[i] > 9) {
      throw std::runtime_error(labels_path + ": label " + std::to_string(d.labels[i]) + " at index " +
                               std::to_string(i) + " is not a digit 0..9");
    }
  }
  return d;
}

/// `dir`/`name` or `dir`/`name`.gz, whichever is a file. Neither is an error
/// naming both; so is both (`gunzip -k`, or two downloads): which one holds
/// the data meant is not ours to guess, and taking each of the four files
/// from its own kind could pair images and labels of two versions.
inline std::string find(const std::string& dir, const std::string& name) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) throw std::runtime_error(dir + " is not a directory of IDX files");
  const fs::path plain = fs::path(dir) / name, gz = fs::path(dir) / (name + ".gz");
  for (const fs::path& p : {plain, gz}) {
    if (fs::exists(p) && !fs::is_regular_file(p)) throw std::runtime_error(p.string() + " is not a regular file");
  }
  const bool has_plain = fs::exists(plain), has_gz = fs::exists(gz);
  if (has_plain && has_gz) {
    throw std::runtime_error("both " + plain.string() + " and " + gz.string() + " exist: keep one of them");
  }
  if (has_plain) return plain.string();
  if (has_gz) return gz.string();
  throw std::runtime_error("neither " + plain.string() + " nor " + gz.string() + " exists");
}

/// One split of the MNIST layout in `dir` (`split`: "train" or "t10k"):
/// {split}-images-idx3-ubyte and {split}-labels-idx1-ubyte, each plain or .gz.
inline LabelledImages read_split(const std::string& dir, const std::string& split) {
  // One at a time: the images file is looked for first, and named first when missing.
  const std::string images = find(dir, split + "-images-idx3-ubyte");
  return read(images, find(dir, split + "-labels-idx1-ubyte"));
}

}  // namespace example::mnist
